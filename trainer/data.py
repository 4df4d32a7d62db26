"""Prompt datasets of the RL loop: a toy task a tiny model learns on CPU, and math problems for real runs.

A task yields, for each step, a deterministic list of prompts (a function of the seed and the step, so a
resumed run sees exactly the prompts it would have seen) and grades a completion with a reward in [0, 1].
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rljob.trainer.rewards import exact_match_reward, math_reward


@dataclass(frozen=True)
class Prompt:
    """One prompt: token ids (toy task) or text (math), and the reference answer."""

    tokens: list[int] | None
    text: str | None
    answer: list[int] | str
    id: str = ""


class Task(Protocol):
    name: str
    max_tokens: int

    def train_prompts(self, step: int, count: int) -> list[Prompt]: ...

    def eval_prompts(self) -> list[Prompt]: ...

    def reward(self, prompt: Prompt, completion_tokens: list[int], completion_text: str) -> float: ...


@dataclass
class SuccessorTask:
    """Toy task: prompt `[BOS, digit x, noise z]`, answer the token of digit (x + 1) mod K.

    Digits are token ids `digit0 .. digit0+K-1`, noise tokens `noise0 .. noise0+Z-1`. The (x, z) pairs are
    split into train and held-out sets (for every digit some noise values are held out), so evaluation
    measures whether the policy learned to ignore z. Chance is 1/vocab for an untrained model."""

    name: str = "successor"
    digits: int = 8
    noise: int = 8
    held_out_per_digit: int = 2
    bos: int = 1
    digit0: int = 4
    noise0: int = 16
    seed: int = 0
    max_tokens: int = 1
    _train: list[tuple[int, int]] = field(default_factory=list, init=False)
    _eval: list[tuple[int, int]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        for x in range(self.digits):
            zs = list(range(self.noise))
            rng.shuffle(zs)
            self._eval += [(x, z) for z in zs[: self.held_out_per_digit]]
            self._train += [(x, z) for z in zs[self.held_out_per_digit :]]

    def _prompt(self, x: int, z: int) -> Prompt:
        return Prompt(
            tokens=[self.bos, self.digit0 + x, self.noise0 + z],
            text=None,
            answer=[self.digit0 + (x + 1) % self.digits],
            id=f"{x}:{z}",
        )

    def train_prompts(self, step: int, count: int) -> list[Prompt]:
        rng = random.Random(f"{self.seed}:{step}")
        return [self._prompt(*rng.choice(self._train)) for _ in range(count)]

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(x, z) for x, z in self._eval]

    def reward(self, prompt: Prompt, completion_tokens: list[int], completion_text: str) -> float:
        assert isinstance(prompt.answer, list)
        return exact_match_reward(completion_tokens, prompt.answer)


@dataclass
class MathTask:
    """Math word problems from a JSONL file of {"question": ..., "answer": ...} (GSM8K style: the final
    answer after `####`), graded by the math verifier. Prompts are text; the sampler tokenizes."""

    path: Path
    name: str = "math"
    max_tokens: int = 1024
    eval_size: int = 64
    seed: int = 0
    template: str = "{question}\nPut the final answer after ####.\n"
    _rows: list[tuple[str, str]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        for i, line in enumerate(self.path.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{self.path}:{i + 1}: each line needs 'question' and 'answer'")
            answer = str(row["answer"]).rsplit("####", 1)[-1].strip()
            self._rows.append((self.template.format(question=row["question"]), answer))
        if len(self._rows) <= self.eval_size:
            raise ValueError(f"{self.path}: {len(self._rows)} problems, need more than {self.eval_size}")

    def train_prompts(self, step: int, count: int) -> list[Prompt]:
        rng = random.Random(f"{self.seed}:{step}")
        pool = self._rows[self.eval_size :]
        return [Prompt(None, *pool[rng.randrange(len(pool))]) for _ in range(count)]

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(None, q, a) for q, a in self._rows[: self.eval_size]]

    def reward(self, prompt: Prompt, completion_tokens: list[int], completion_text: str) -> float:
        assert isinstance(prompt.answer, str)
        return math_reward(completion_text, prompt.answer)


__all__ = ["MathTask", "Prompt", "SuccessorTask", "Task"]
