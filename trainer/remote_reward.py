"""Rewards from an HTTP service (spec.dataset.rewardUrl): for rewards that run code, in a sandbox of its own.

The trainer POSTs each completion to the URL as JSON::

    {"completion": "...", "reference": <the prompt's reference>, "prompt": "..." or null, "id": "..."}

(``prompt``: the prompt's text as the sampler got it, null for a token-id prompt) and takes the answer's
reward: a JSON number, or an object with a number under ``"reward"``. A step's completions are graded
concurrently (``MAX_CONCURRENT`` requests at once) through rljob.common.http. A request that fails for a
reason that may pass (no connection, a timeout, HTTP 5xx or 429) is retried with exponential backoff and
jitter; when every attempt has failed, or the service answers another status, a body over
``MAX_ANSWER_BYTES`` or a body without a reward, the trainer stops with RewardUnavailable, a crash
(restarted and counted, contract 3): a made-up reward would train the policy on noise.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Coroutine
from typing import Any, TypeVar

from rljob.common.http import (
    HttpClosed,
    HttpStatusError,
    HttpUnavailable,
    ResponseTooLarge,
    Retry,
    SyncHttp,
)
from rljob.trainer.data import Prompt, Task

T = TypeVar("T")

TIMEOUT_S = 60.0  # per request
ATTEMPTS = 6  # backoff up to 1, 2, 4, 8, 16 s between them (jitter: half to all of it): < 31 s unreachable
BACKOFF_S = 1.0
MAX_CONCURRENT = 16
MAX_ANSWER_BYTES = 1 << 16


class RewardUnavailable(RuntimeError):
    """The reward service did not grade a completion (after every retry, or with an answer it never will)."""


class RemoteReward:
    """A task whose completions are graded by the service at ``url`` instead of the task's own reward; its
    prompts are the task's."""

    def __init__(
        self,
        task: Task,
        url: str,
        *,
        timeout: float = TIMEOUT_S,
        attempts: int = ATTEMPTS,
        backoff: float = BACKOFF_S,
        concurrent: int = MAX_CONCURRENT,
    ) -> None:
        self.task, self.url = task, url
        self.name, self.max_tokens = task.name, task.max_tokens
        self.timeout, self.attempts, self.backoff = timeout, max(1, attempts), backoff
        self._http = SyncHttp(
            "reward",
            concurrency=max(1, concurrent),
            timeout=timeout,
            max_body=MAX_ANSWER_BYTES,
            retry=Retry(attempts=self.attempts, base_s=backoff, cap_s=backoff * 2 ** (self.attempts - 2)),
        )

    def train_prompts(self, step: int, count: int) -> list[Prompt]:
        return self.task.train_prompts(step, count)

    def eval_prompts(self) -> list[Prompt]:
        return self.task.eval_prompts()

    def reward(self, prompt: Prompt, completion_tokens: list[int], completion_text: str) -> float:
        return self._run(self._post(prompt, completion_text))

    def rewards(self, graded: list[tuple[Prompt, list[int], str]]) -> list[float]:
        """The rewards of many completions, requested concurrently, in order."""

        async def each() -> list[float]:
            return list(await asyncio.gather(*(self._post(g[0], g[2]) for g in graded)))

        return self._run(each())

    def close(self) -> None:
        self._http.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return self._http.run(coro)
        except HttpClosed:
            raise RewardUnavailable(f"spec.dataset.rewardUrl: {self.url}: the trainer is stopping") from None

    async def _post(self, prompt: Prompt, completion: str) -> float:
        body = {"completion": completion, "reference": prompt.answer, "prompt": prompt.text, "id": prompt.id}
        try:
            answer = (await self._http.aio.request("POST", self.url, json=body)).body
        except HttpStatusError as e:
            raise RewardUnavailable(
                f"spec.dataset.rewardUrl: {self.url} answered HTTP {e.status}: {e.text[:300]}"
            ) from None
        except HttpUnavailable as e:
            raise RewardUnavailable(
                f"spec.dataset.rewardUrl: {self.url} did not grade a completion in {e.attempts} attempts "
                f"({e.last})"
            ) from None
        except ResponseTooLarge:
            raise RewardUnavailable(
                f"spec.dataset.rewardUrl: {self.url} answered more than {MAX_ANSWER_BYTES} bytes, not a "
                'finite number or {"reward": number}'
            ) from None
        return _reward_of(answer, self.url)


def _reward_of(answer: bytes, url: str) -> float:
    try:
        value: Any = json.loads(answer)
    except (json.JSONDecodeError, UnicodeDecodeError):
        value = None
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardUnavailable(
            f"spec.dataset.rewardUrl: {url} answered {answer[:200]!r}, not a finite number or "
            '{"reward": number}'
        )
    return float(value)


__all__ = ["RemoteReward", "RewardUnavailable"]
