"""Evaluation during training on the held-out split (spec.evaluation): pass@k and maj@k.

Every ``every`` steps the loop samples ``samples`` completions of each held-out prompt (the task's
``eval_prompts``, spec.dataset.evalSize of them) at the evaluation's temperature and grades them with the
task's reward; a completion is correct when its reward is 1 (full marks; the built-in tasks grade 1 or 0).

- pass@k: the unbiased estimator of the Codex paper (Chen et al. 2021, https://arxiv.org/abs/2107.03374,
  eq. 1): with n samples of which c are correct, 1 - C(n - c, k) / C(n, k), computed as their numerically
  stable product; averaged over prompts.
- maj@k: the share of prompts whose most common answer among their first k samples is correct. An answer
  is what the task's optional ``answer(prompt, tokens, text)`` returns (the math task: the final answer
  math-verify extracts), else the completion's text, stripped; a tie goes to the answer seen first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rljob.recipes.api import EvaluationReport

CORRECT = 1.0 - 1e-6  # a reward at least this is correct


@dataclass(frozen=True)
class EvalOptions:
    """spec.evaluation as the loop reads it (the plan filled samples and temperature)."""

    every: int = 10  # 0: never
    pass_k: int = 1
    maj_k: int = 0  # 0: not measured
    samples: int = 1
    temperature: float = 0.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with ``n`` samples, ``c`` of them correct (k <= n)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_correct(answers: Sequence[Any], correct: Sequence[bool]) -> bool:
    """Whether the most common of ``answers`` (the first seen on a tie; None never wins while another
    answer is there) belongs to a correct sample."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    best = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == best)
    return any(ok for a, ok in zip(answers, correct, strict=True) if a == winner)


def answer_of(task: Any) -> Callable[[Any, list[int], str], Any]:
    """The task's answer extractor (its own ``answer``, or that of the task it wraps: the loop's chat and
    reward-service wrappers keep theirs as ``.task``), else the completion's text, stripped."""
    node = task
    while node is not None:
        fn = getattr(node, "answer", None)
        if fn is not None:
            return fn  # type: ignore[no-any-return]
        node = getattr(node, "task", None)
    return lambda _prompt, _tokens, text: text.strip()


def scores(opts: EvalOptions, per_prompt: Sequence[Sequence[tuple[float, Any]]]) -> dict[str, float]:
    """The evaluation's metrics from each prompt's (reward, answer) samples, in sampling order:
    ``eval_reward`` (mean reward of every sample), ``eval_pass_at_k`` and, with majK, ``eval_maj_at_k``."""
    rewards = [r for samples in per_prompt for r, _ in samples]
    out = {"eval_reward": float(np.mean(rewards)) if rewards else 0.0}
    passes, majs = [], []
    for samples in per_prompt:
        ok = [r >= CORRECT for r, _ in samples]
        passes.append(pass_at_k(len(ok), sum(ok), opts.pass_k))
        if opts.maj_k:
            first = samples[: opts.maj_k]
            majs.append(majority_correct([a for _, a in first], ok[: opts.maj_k]))
    out["eval_pass_at_k"] = float(np.mean(passes)) if passes else 0.0
    out["eval_pass_k"] = float(opts.pass_k)
    if opts.maj_k:
        out["eval_maj_at_k"] = float(np.mean(majs)) if majs else 0.0
        out["eval_maj_k"] = float(opts.maj_k)
    return out


def report(step: int, metrics: dict[str, float]) -> EvaluationReport | None:
    """The ProgressReport's evaluation from a step's metrics (:func:`scores`); None: no evaluation ran."""
    if "eval_pass_at_k" not in metrics:
        return None
    maj = "eval_maj_at_k" in metrics
    return EvaluationReport(
        step=step,
        reward_mean=metrics["eval_reward"],
        pass_k=int(metrics["eval_pass_k"]),
        pass_at_k=metrics["eval_pass_at_k"],
        maj_k=int(metrics["eval_maj_k"]) if maj else None,
        maj_at_k=metrics["eval_maj_at_k"] if maj else None,
    )


__all__ = ["CORRECT", "EvalOptions", "answer_of", "majority_correct", "pass_at_k", "report", "scores"]
