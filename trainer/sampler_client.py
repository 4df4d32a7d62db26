"""The trainer's client of the samplers: OpenAI-style completions over HTTP against one or more vLLM
servers (or the CPU backend), every replica asked at once with back-pressure per replica; an unreachable or
restarting sampler is waited for, a request it will never take (4xx) is refused."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from rljob.common.credentials import bearer
from rljob.common.http import (
    NO_RETRY,
    HttpClosed,
    HttpStatusError,
    HttpUnavailable,
    ResponseTooLarge,
    Retry,
    SyncHttp,
)
from rljob.recipes.runconfig import SAMPLED_LOGPROBS
from rljob.trainer.data import Prompt

log = logging.getLogger("rljob.trainer.sampler_client")

T = TypeVar("T")
MAX_ANSWER_BYTES = 1 << 30  # a /v1/completions answer: max_seqs sequences with a log-prob per token


class LoopConfigError(ValueError):
    """A setting the loop cannot run with; the message names the field."""


class SamplerUnavailable(RuntimeError):
    pass


class SamplerRejected(RuntimeError):
    """The sampler answered 4xx (other than 404, an adapter being swapped): a request it will never take."""


class SamplerClosed(RuntimeError):
    """The client was closed while a request was waiting for a sampler (the loop is shutting down)."""


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters of a completions request (spec.algorithm.sampling): those vLLM's TPU backend
    applies (rljob.recipes.api.SamplingSpec cites where); off values are not sent."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: tuple[str, ...] = ()

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"temperature": self.temperature}
        if self.top_p < 1:
            out["top_p"] = self.top_p
        if self.top_k > 0:
            out["top_k"] = self.top_k
        if self.stop:
            out["stop"] = list(self.stop)
        return out


@dataclass
class Completion:
    prompt_index: int
    tokens: list[int]
    logprobs: list[float]
    text: str
    adapter: str
    prompt_tokens: list[int] | None = None  # the sampler's tokenization of a text prompt

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids as the sampler saw them: the trainer trains on exactly those."""
        if prompt.tokens is not None:
            return list(prompt.tokens)
        if self.prompt_tokens is None:
            raise SamplerRejected(
                "a text prompt's completion came back without prompt_token_ids: the sampler must return "
                "them for return_token_ids (vLLM >= 0.10.2)"
            )
        return self.prompt_tokens


class SamplerClient:
    """OpenAI-style completions against one or more samplers (vLLM or the CPU backend), over
    rljob.common.http on an event loop of its own (the loop's threads call it synchronously); every request
    carries the run's ``token`` (the samplers require it: rljob.common.credentials)."""

    def __init__(
        self,
        urls: list[str],
        name_prefix: str,
        timeout: float = 300.0,
        retry_s: float = 0.05,
        max_seqs: int = 256,
        inflight: int = 1,
        retry_cap_s: float = 5.0,
        token: str | None = None,
    ) -> None:
        if not urls:
            raise LoopConfigError("endpoints.samplers: no sampler URL in the run config")
        if max_seqs < 1 or inflight < 1:
            raise LoopConfigError(f"spec.sampler.maxNumSeqs: {max_seqs} (and {inflight} slots) must be >= 1")
        self.max_seqs, self.inflight = max_seqs, inflight
        self.urls = [u.rstrip("/") for u in urls]
        self.prefix = name_prefix
        self.headers = bearer(token)
        self.timeout = timeout
        self.retry_s = retry_s
        # The wait for a sampler that is down, restarting or behind on the adapter version: retry_s, doubling
        # (with jitter) up to retry_cap_s. Each attempt is one request: the wait is this client's, so that a
        # request a replica cannot take goes back to the others.
        self.backoff = Retry(attempts=None, base_s=retry_s, cap_s=max(retry_s, retry_cap_s))
        self.waited_s = 0.0
        self._http = SyncHttp(
            "sampler-client",
            concurrency=max(16, 2 * len(urls) * inflight),
            timeout=timeout,
            max_body=MAX_ANSWER_BYTES,
            retry=NO_RETRY,
        )
        # Per replica: requests in flight at once (back-pressure), shared by every call of this client; made
        # on the client's loop.
        self._slots: list[asyncio.Semaphore] | None = None

    def close(self) -> None:
        """Stop waiting: a call in progress (waiting for a sampler, or for an adapter version that will never
        come because the trainer failed) raises SamplerClosed at once, so its thread ends and the process
        can exit. Without this a failed trainer would hang in its sampling thread at exit and its pod would
        never fail (no restart, no status)."""
        self._http.close()

    def _run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        try:
            return self._http.run(coro)
        except HttpClosed:
            raise SamplerClosed(f"{what}: the sampler client was closed") from None

    def _request(self, url: str, body: dict[str, Any] | None = None) -> Any:
        return self._run(self._arequest(url, body), url)

    async def _arequest(self, url: str, body: dict[str, Any] | None = None) -> Any:
        if body is None:
            return await self._http.aio.get_json(url, headers=self.headers)
        return await self._http.aio.post_json(url, body, headers=self.headers)

    async def _sleep(self, attempt: int) -> None:
        await self._http.aio.sleep(self.backoff.delay(attempt))

    async def _served_version(self, url: str) -> int | None:
        models = await self._arequest(f"{url}/v1/models")
        best: int | None = None
        for m in models.get("data", []):
            mid = str(m.get("id", ""))
            if mid.startswith(self.prefix + "-v") and mid[len(self.prefix) + 2 :].isdigit():
                v = int(mid[len(self.prefix) + 2 :])
                best = v if best is None or v > best else best
        return best

    def served_version(self, url: str) -> int | None:
        return self._run(self._served_version(url), f"{url}/v1/models")

    def wait_version(self, url: str, min_version: int) -> int:
        """The adapter version ``url`` serves once it is >= ``min_version``: an unreachable or restarting
        sampler is waited for (never fatal) until close()."""
        return self._run(self._wait_version(url, min_version), f"adapter >= v{min_version}")

    async def _wait_version(self, url: str, min_version: int) -> int:
        what = f"adapter >= v{min_version}"
        t0 = time.monotonic()
        attempt = 0
        while True:
            try:
                v = await self._served_version(url)
                if v is None or v < min_version:
                    raise SamplerUnavailable(f"{url} serves adapter v{v}, waiting for >= v{min_version}")
            except WAIT as e:
                if (rejected := _rejection(e, what)) is not None:
                    raise rejected from e
                if not attempt:
                    log.warning("sampler unavailable (%s): %s; waiting", what, e)
                await self._sleep(attempt)
                attempt += 1
                continue
            if attempt:
                waited = time.monotonic() - t0
                log.warning("sampler back after %.1fs (%s)", waited, what)
                self.waited_s += waited
            return v

    def complete(
        self, prompts: list[Prompt], n: int, max_tokens: int, sampling: Sampling | float, min_version: int
    ) -> list[Completion]:
        """`n` completions per prompt, from all the samplers at once (``sampling``: the parameters, or a
        temperature alone).

        The prompts are cut into requests of at most ``max_seqs`` sequences (a replica's
        ``--max-num-seqs``) and no more than an even share of the replicas; each replica has ``inflight``
        request slots (per client, so a concurrent evaluation shares them), and a free slot takes the next
        request from the queue: a faster replica serves more, and a replica that is down, restarting or
        still on an older adapter version puts its request back for the others (and retries after
        ``retry_s``, doubling up to ``retry_cap_s``). A 4xx answer (other than 404) fails the call
        (SamplerRejected).

        No per-request ``seed`` is sent: vLLM's TPU backend refuses any request that carries one
        (``TpuPlatform.validate_request`` in https://github.com/vllm-project/tpu-inference/blob/main/
        tpu_inference/platforms/tpu_platform.py: "JAX does not support per-request seed"); a
        sampler's randomness is its own (vLLM's server-wide ``--seed``; the CPU backend's likewise)."""
        if not prompts:
            return []
        if not isinstance(sampling, Sampling):
            sampling = Sampling(temperature=float(sampling))
        return self._run(self._complete(prompts, n, max_tokens, sampling, min_version), "completions")

    async def _complete(
        self, prompts: list[Prompt], n: int, max_tokens: int, sampling: Sampling, min_version: int
    ) -> list[Completion]:
        if self._slots is None:
            self._slots = [asyncio.Semaphore(self.inflight) for _ in self.urls]
        per_request = max(1, min(self.max_seqs // max(1, n), -(-len(prompts) // len(self.urls))))
        queue: deque[list[int]] = deque(
            list(range(i, min(i + per_request, len(prompts)))) for i in range(0, len(prompts), per_request)
        )
        results: list[list[Completion]] = []
        failures: list[BaseException] = []
        changed = asyncio.Condition()
        state: dict[str, Any] = {"pending": len(queue), "wait_from": None}

        def body_of(idxs: list[int], version: int) -> dict[str, Any]:
            return {
                "model": f"{self.prefix}-v{version}",
                "prompt": [
                    prompts[i].tokens if prompts[i].tokens is not None else prompts[i].text for i in idxs
                ],
                "n": n,
                "max_tokens": max_tokens,
                **sampling.body(),
                "logprobs": SAMPLED_LOGPROBS,
                "return_token_ids": True,
            }

        async def worker(u: int, slots: asyncio.Semaphore) -> None:
            url = self.urls[u]
            attempt = 0
            while True:
                async with changed:
                    await changed.wait_for(lambda: bool(queue) or not state["pending"] or bool(failures))
                    if not state["pending"] or failures:
                        return
                    idxs = queue.popleft()
                try:
                    async with slots:
                        version = await self._served_version(url)
                        if version is None or version < min_version:
                            raise SamplerUnavailable(
                                f"{url} serves adapter v{version}, waiting for >= v{min_version}"
                            )
                        resp = await self._arequest(f"{url}/v1/completions", body_of(idxs, version))
                    comps = _completions(resp, idxs, n)
                except WAIT as e:
                    rejected = _rejection(e, "completions")
                    async with changed:
                        if rejected is not None:
                            # The sampler refuses the request itself: waiting would not help.
                            failures.append(rejected)
                        else:
                            if state["wait_from"] is None:
                                state["wait_from"] = time.monotonic()
                                log.warning(
                                    "sampler unavailable (adapter >= v%d): %s: %s; waiting",
                                    min_version,
                                    url,
                                    e,
                                )
                            queue.appendleft(idxs)
                        changed.notify_all()
                    if rejected is not None:
                        return
                    await self._sleep(attempt)
                    attempt += 1
                    continue
                except (KeyError, ValueError, TypeError, ResponseTooLarge) as e:
                    async with changed:
                        failures.append(SamplerRejected(f"completions from {url}: malformed answer: {e!r}"))
                        changed.notify_all()
                    return
                attempt = 0
                async with changed:
                    results.append(comps)
                    state["pending"] -= 1
                    if state["wait_from"] is not None:
                        waited = time.monotonic() - state["wait_from"]
                        log.warning("sampler back after %.1fs", waited)
                        self.waited_s += waited
                        state["wait_from"] = None
                    changed.notify_all()

        await asyncio.gather(
            *(worker(u, self._slots[u]) for u in range(len(self.urls)) for _ in range(self.inflight))
        )
        if failures:
            raise failures[0]
        out = [c for part in results for c in part]
        out.sort(key=lambda c: c.prompt_index)
        return out


# What a sampler that is down, restarting or swapping adapters answers: waited for, unless _rejection says
# the answer is a refusal.
WAIT = (HttpUnavailable, HttpStatusError, SamplerUnavailable)


def _rejection(e: BaseException, what: str) -> SamplerRejected | None:
    """A 4xx other than 404 (an adapter being swapped) is a request the sampler will never take."""
    if isinstance(e, HttpStatusError) and e.status != 404:
        return SamplerRejected(f"{what}: HTTP {e.status}: {e.text[:300]}")
    return None


def _completions(resp: Any, idxs: list[int], n: int) -> list[Completion]:
    """The completions of one /v1/completions answer for prompts ``idxs`` (``n`` choices each)."""
    model = str(resp["model"])
    out = []
    for ch in resp["choices"]:
        k = int(ch["index"])
        lp = ch.get("logprobs") or {}
        tokens = [int(t) for t in ch["token_ids"]]
        logprobs = [float(x) for x in lp.get("token_logprobs", [])]
        if len(logprobs) != len(tokens):  # a malformed answer (SamplerRejected), never a short rollout
            raise ValueError(f"choice {k}: {len(tokens)} tokens but {len(logprobs)} log-probs")
        out.append(
            Completion(
                prompt_index=idxs[k // n],
                tokens=tokens,
                logprobs=logprobs,
                text=str(ch.get("text", "")),
                adapter=model,
                prompt_tokens=(
                    [int(t) for t in ch["prompt_token_ids"]] if ch.get("prompt_token_ids") else None
                ),
            )
        )
    return out


def version_of(adapter: str) -> int:
    return int(adapter.rsplit("-v", 1)[1])
