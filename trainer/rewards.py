"""Reward functions: the math verifier for real runs, exact match for the CPU toy task.

A reward function maps one completion to a float in [0, 1]. Real runs grade GSM8K/MATH-style answers
with Hugging Face's math-verify (LaTeX and plain numbers, equivalent forms such as 1/2 == 0.5); the toy
task of the CPU loop grades token ids by exact match.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from math_verify import parse, verify  # type: ignore[import-untyped]

_TIMEOUT_S = 5
MAX_GRADED_CHARS = 2000


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals `answer` mathematically, else 0.0.

    The completion's answer is what math-verify extracts (a \\boxed{...} value, or the last number);
    GSM8K's `#### 42` convention is honoured by taking the text after the last `####`.
    """
    timeout = _timeout()
    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$", parsing_timeout=timeout)
    pred = _prediction(completion)
    if not gold or not pred:
        return 0.0
    try:
        return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0
    except Exception:  # math-verify raises on pathological expressions; those are wrong answers
        return 0.0


def _timeout() -> int | None:
    # math-verify bounds its sympy work with signal.alarm, which only the main thread may set; elsewhere it
    # runs unbounded, so the text it sees is capped (the final answer is at the end).
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _prediction(completion: str) -> list[object]:
    """What math-verify extracts as the completion's final answer (after the last `####` when there is
    one; the last MAX_GRADED_CHARS characters)."""
    if "####" in completion:
        completion = completion.rsplit("####", 1)[1]
    return parse(completion[-MAX_GRADED_CHARS:], parsing_timeout=_timeout())  # type: ignore[no-any-return]


def math_answer(completion: str) -> str | None:
    """The completion's final answer as math-verify extracts it (its normalized expression), for maj@k's
    vote; None when it finds none."""
    pred = _prediction(completion)
    return str(pred[0]) if pred else None


def exact_match_reward(completion: Sequence[int], answer: Sequence[int]) -> float:
    """1.0 when the completion starts with exactly the answer's tokens, else 0.0."""
    n = len(answer)
    return 1.0 if n > 0 and list(completion[:n]) == list(answer) else 0.0


__all__ = ["exact_match_reward", "math_answer", "math_reward"]
