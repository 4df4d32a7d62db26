"""Prompt datasets of the RL loop: a toy task a tiny model learns on CPU, and math problems for real runs.

Both are registered by name like any other task (rljob.trainer.tasks, docs/tasks.md). A task yields, for
each step, a deterministic list of prompts (a function of the seed and the step, so a
resumed run sees exactly the prompts it would have seen) and grades a completion with a reward in [0, 1].
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rljob.trainer.rewards import exact_match_reward, math_answer, math_reward


@dataclass(frozen=True)
class Prompt:
    """One prompt: token ids (toy task), text (math) or chat messages, and the reference answer (what the
    task's reward grades a completion against).

    A prompt of chat ``messages`` (each {"role": ..., "content": ...}) reaches the sampler rendered by the
    model's chat template (rljob.trainer.tasks.ChatPrompts): as token ids when the tokenizer has one, else
    as text. The sampler gets ``tokens`` when set, else ``text``."""

    tokens: list[int] | None
    text: str | None
    answer: Any
    id: str = ""
    messages: Sequence[Mapping[str, str]] | None = None


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


class DatasetError(ValueError):
    """A dataset the run cannot use; the message starts with the field (spec.dataset.path: ...)."""


@dataclass
class MathTask:
    """Math word problems from JSON Lines of {"question": ..., "answer": ...} (GSM8K style: the final answer
    after `####`), graded by the math verifier. Prompts are text; the sampler tokenizes them and returns the
    token ids it used (vLLM's `return_token_ids`), which is what the trainer trains on.

    The first ``eval_size`` problems are held out for evaluation; training prompts are drawn from the rest
    as a function of (seed, step), so a resumed run sees exactly the prompts it would have seen."""

    rows: list[tuple[str, str]]
    name: str = "math"
    max_tokens: int = 1024
    eval_size: int = 64
    seed: int = 0

    @classmethod
    def from_jsonl(
        cls,
        text: str,
        source: str,
        template: str = "{question}",
        question_field: str = "question",
        answer_field: str = "answer",
        **kw: Any,
    ) -> MathTask:
        """Parse the file's text; every problem names ``source`` and its line. Each line is a JSON object
        with the question (text) under ``question_field`` and the answer under ``answer_field``."""
        rows: list[tuple[str, str]] = []
        field_ = "spec.dataset.path"
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{field_}: {source}:{i}: not JSON ({e.msg})") from None
            if (
                not isinstance(row, dict)
                or not isinstance(row.get(question_field), str)
                or answer_field not in row
            ):
                raise DatasetError(
                    f'{field_}: {source}:{i}: each line needs "{question_field}" (text) and "{answer_field}"'
                )
            answer = str(row[answer_field]).rsplit("####", 1)[-1].strip()
            if not answer:
                raise DatasetError(f"{field_}: {source}:{i}: empty answer")
            rows.append((template.format(question=row[question_field]), answer))
        task = cls(rows, **kw)
        if len(rows) <= task.eval_size:
            raise DatasetError(
                f"{field_}: {source}: {len(rows)} problems; spec.dataset.evalSize holds out "
                f"{task.eval_size}, so none would be left to train on"
            )
        return task

    def train_prompts(self, step: int, count: int) -> list[Prompt]:
        rng = random.Random(f"{self.seed}:{step}")
        pool = self.rows[self.eval_size :]
        out = []
        for _ in range(count):
            k = rng.randrange(len(pool))
            out.append(Prompt(None, pool[k][0], pool[k][1], id=str(self.eval_size + k)))
        return out

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(None, q, a, id=str(k)) for k, (q, a) in enumerate(self.rows[: self.eval_size])]

    def reward(self, prompt: Prompt, completion_tokens: list[int], completion_text: str) -> float:
        assert isinstance(prompt.answer, str)
        return math_reward(completion_text, prompt.answer)

    def answer(self, prompt: Prompt, completion_tokens: list[int], completion_text: str) -> str | None:
        """The completion's final answer for maj@k (rljob.trainer.evaluation)."""
        return math_answer(completion_text)


__all__ = ["DatasetError", "MathTask", "Prompt", "SuccessorTask", "Task"]
