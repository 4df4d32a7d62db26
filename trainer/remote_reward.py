"""Rewards from an HTTP service (spec.dataset.rewardUrl): for rewards that run code, in a sandbox of its own.

The trainer POSTs each completion to the URL as JSON::

    {"completion": "...", "reference": <the prompt's reference>, "prompt": "..." or null, "id": "..."}

(``prompt``: the prompt's text as the sampler got it, null for a token-id prompt) and takes the answer's
reward: a JSON number, or an object with a number under ``"reward"``. A step's completions are graded
concurrently (``MAX_CONCURRENT`` requests at once). A request that fails for a reason that may pass (no
connection, a timeout, HTTP 5xx or 429) is retried with exponential backoff; when every attempt has failed,
or the service answers another status or a body without a reward, the trainer stops with RewardUnavailable,
a crash (restarted and counted, contract 3): a made-up reward would train the policy on noise.
"""

from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rljob.trainer.data import Prompt, Task

TIMEOUT_S = 60.0  # per request
ATTEMPTS = 6  # backoff 1, 2, 4, 8, 16 s between them: about half a minute of an unreachable service
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
        self.pool = ThreadPoolExecutor(max_workers=max(1, concurrent), thread_name_prefix="reward")
        self._closed = threading.Event()

    def train_prompts(self, step: int, count: int) -> list[Prompt]:
        return self.task.train_prompts(step, count)

    def eval_prompts(self) -> list[Prompt]:
        return self.task.eval_prompts()

    def reward(self, prompt: Prompt, completion_tokens: list[int], completion_text: str) -> float:
        return self._post(prompt, completion_text)

    def rewards(self, graded: list[tuple[Prompt, list[int], str]]) -> list[float]:
        """The rewards of many completions, requested concurrently, in order."""
        return list(self.pool.map(lambda g: self._post(g[0], g[2]), graded))

    def close(self) -> None:
        self._closed.set()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _post(self, prompt: Prompt, completion: str) -> float:
        body = json.dumps(
            {"completion": completion, "reference": prompt.answer, "prompt": prompt.text, "id": prompt.id}
        ).encode()
        last = ""
        for attempt in range(self.attempts):
            if attempt and self._closed.wait(self.backoff * 2 ** (attempt - 1)):
                break
            req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    answer = resp.read(MAX_ANSWER_BYTES + 1)
            except urllib.error.HTTPError as e:
                if e.code >= 500 or e.code == 429:
                    last = f"HTTP {e.code}"
                    continue
                text = e.read(300).decode(errors="replace")
                raise RewardUnavailable(
                    f"spec.dataset.rewardUrl: {self.url} answered HTTP {e.code}: {text}"
                ) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                continue
            return _reward_of(answer, self.url)
        raise RewardUnavailable(
            f"spec.dataset.rewardUrl: {self.url} did not grade a completion in {self.attempts} attempts "
            f"({last})"
        )


def _reward_of(answer: bytes, url: str) -> float:
    try:
        value: Any = json.loads(answer) if len(answer) <= MAX_ANSWER_BYTES else None
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
