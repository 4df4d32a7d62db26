"""Reward functions: the math verifier for real runs, exact match for the CPU toy task.

A reward function maps one completion to a float in [0, 1]. Real runs grade GSM8K/MATH-style answers
with Hugging Face's math-verify (LaTeX and plain numbers, equivalent forms such as 1/2 == 0.5); the toy
task of the CPU loop grades token ids by exact match.
"""

from __future__ import annotations

from collections.abc import Sequence

from math_verify import parse, verify  # type: ignore[import-untyped]


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals `answer` mathematically, else 0.0.

    The completion's answer is what math-verify extracts (a \\boxed{...} value, or the last number);
    GSM8K's `#### 42` convention is honoured by taking the text after the last `####`.
    """
    if "####" in completion:
        completion = completion.rsplit("####", 1)[1]
    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    pred = parse(completion)
    if not gold or not pred:
        return 0.0
    try:
        return 1.0 if verify(gold, pred) else 0.0
    except Exception:  # math-verify raises on pathological expressions; those are wrong answers
        return 0.0


def exact_match_reward(completion: Sequence[int], answer: Sequence[int]) -> float:
    """1.0 when the completion starts with exactly the answer's tokens, else 0.0."""
    n = len(answer)
    return 1.0 if n > 0 and list(completion[:n]) == list(answer) else 0.0


__all__ = ["exact_match_reward", "math_reward"]
