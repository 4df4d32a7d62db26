"""The trainer's client of the samplers: OpenAI-style completions over HTTP against one or more vLLM
servers (or the CPU backend), every replica asked at once with back-pressure per replica; an unreachable or
restarting sampler is waited for, a request it will never take (4xx) is refused."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rljob.trainer.data import Prompt

log = logging.getLogger("rljob.trainer.sampler_client")


class LoopConfigError(ValueError):
    """A setting the loop cannot run with; the message names the field."""


class SamplerUnavailable(RuntimeError):
    pass


class SamplerRejected(RuntimeError):
    """The sampler answered 4xx (other than 404, an adapter being swapped): a request it will never take."""


class SamplerClosed(RuntimeError):
    """The client was closed while a request was waiting for a sampler (the loop is shutting down)."""


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
    """OpenAI-style completions against one or more samplers (vLLM or the CPU backend)."""

    def __init__(
        self,
        urls: list[str],
        name_prefix: str,
        timeout: float = 300.0,
        retry_s: float = 0.05,
        max_seqs: int = 256,
        inflight: int = 1,
    ) -> None:
        if not urls:
            raise LoopConfigError("endpoints.samplers: no sampler URL in the run config")
        if max_seqs < 1 or inflight < 1:
            raise LoopConfigError(f"spec.sampler.maxNumSeqs: {max_seqs} (and {inflight} slots) must be >= 1")
        self.max_seqs, self.inflight = max_seqs, inflight
        # Per replica: requests in flight at once (back-pressure), shared by every call of this client.
        self._slots = [threading.BoundedSemaphore(inflight) for _ in urls]
        self.urls = [u.rstrip("/") for u in urls]
        self.prefix = name_prefix
        self.timeout = timeout
        self.retry_s = retry_s
        self.waited_s = 0.0
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop waiting: a request that is waiting for a sampler (or for an adapter version that will never
        come, because the trainer failed) raises SamplerClosed within retry_s, so its thread ends and the
        process can exit. Without this a failed trainer would hang in its sampling thread at exit and its
        pod would never fail (no restart, no status)."""
        self._closed.set()

    def _request(self, url: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def _retrying(self, fn: Callable[[], Any], what: str) -> Any:
        """Call fn until it succeeds: an unreachable or restarting sampler is waited for, never fatal."""
        warned = False
        t0 = time.monotonic()
        while True:
            if self._closed.is_set():
                raise SamplerClosed(f"{what}: the sampler client was closed")
            try:
                out = fn()
                if warned:
                    log.warning("sampler back after %.1fs (%s)", time.monotonic() - t0, what)
                self.waited_s += time.monotonic() - t0 if warned else 0.0
                return out
            except (urllib.error.URLError, ConnectionError, TimeoutError, SamplerUnavailable, OSError) as e:
                if isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500 and e.code != 404:
                    # The sampler refuses the request itself: waiting would not help.
                    body = e.read().decode(errors="replace")[:300]
                    raise SamplerRejected(f"{what}: HTTP {e.code}: {body}") from e
                if not warned:
                    log.warning("sampler unavailable (%s): %s; waiting", what, e)
                    warned = True
                self._closed.wait(self.retry_s)

    def served_version(self, url: str) -> int | None:
        models = self._request(f"{url}/v1/models")
        best: int | None = None
        for m in models.get("data", []):
            mid = str(m.get("id", ""))
            if mid.startswith(self.prefix + "-v") and mid[len(self.prefix) + 2 :].isdigit():
                v = int(mid[len(self.prefix) + 2 :])
                best = v if best is None or v > best else best
        return best

    def wait_version(self, url: str, min_version: int) -> int:
        def check() -> int:
            v = self.served_version(url)
            if v is None or v < min_version:
                raise SamplerUnavailable(f"{url} serves adapter v{v}, waiting for >= v{min_version}")
            return v

        return int(self._retrying(check, f"adapter >= v{min_version}"))

    def complete(
        self, prompts: list[Prompt], n: int, max_tokens: int, temperature: float, min_version: int
    ) -> list[Completion]:
        """`n` completions per prompt, from all the samplers at once.

        The prompts are cut into requests of at most ``max_seqs`` sequences (a replica's
        ``--max-num-seqs``) and no more than an even share of the replicas; each replica has ``inflight``
        request slots (per client, so a concurrent evaluation shares them), and a free slot takes the next
        request from the queue: a faster replica serves more, and a replica that is down, restarting or
        still on an older adapter version puts its request back for the others (and retries after
        ``retry_s``). A 4xx answer (other than 404) fails the call (SamplerRejected).

        No per-request ``seed`` is sent: vLLM's TPU backend refuses any request that carries one
        (``TpuPlatform.validate_request`` in https://github.com/vllm-project/tpu-inference/blob/main/
        tpu_inference/platforms/tpu_platform.py: "JAX does not support per-request seed"); a
        sampler's randomness is its own (vLLM's server-wide ``--seed``; the CPU backend's likewise)."""
        if not prompts:
            return []
        per_request = max(1, min(self.max_seqs // max(1, n), -(-len(prompts) // len(self.urls))))
        queue: deque[list[int]] = deque(
            list(range(i, min(i + per_request, len(prompts)))) for i in range(0, len(prompts), per_request)
        )
        results: list[list[Completion]] = []
        failures: list[BaseException] = []
        cond = threading.Condition()
        state: dict[str, Any] = {"pending": len(queue), "wait_from": None}

        def body_of(idxs: list[int], version: int) -> dict[str, Any]:
            return {
                "model": f"{self.prefix}-v{version}",
                "prompt": [
                    prompts[i].tokens if prompts[i].tokens is not None else prompts[i].text for i in idxs
                ],
                "n": n,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "logprobs": 0,
                "return_token_ids": True,
            }

        def worker(u: int) -> None:
            url, slots = self.urls[u], self._slots[u]
            while True:
                with cond:
                    while not queue and state["pending"] and not failures and not self._closed.is_set():
                        cond.wait(self.retry_s)
                    if not state["pending"] or failures or self._closed.is_set():
                        return
                    idxs = queue.popleft()
                try:
                    with slots:
                        version = self.served_version(url)
                        if version is None or version < min_version:
                            raise SamplerUnavailable(
                                f"{url} serves adapter v{version}, waiting for >= v{min_version}"
                            )
                        resp = self._request(f"{url}/v1/completions", body_of(idxs, version))
                    comps = _completions(resp, idxs, n)
                except (
                    urllib.error.URLError,
                    ConnectionError,
                    TimeoutError,
                    SamplerUnavailable,
                    OSError,
                ) as e:
                    rejected = (
                        e
                        if isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500 and e.code != 404
                        else None
                    )
                    with cond:
                        if rejected is not None:
                            # The sampler refuses the request itself: waiting would not help.
                            text = rejected.read().decode(errors="replace")[:300]
                            failures.append(SamplerRejected(f"completions: HTTP {rejected.code}: {text}"))
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
                        cond.notify_all()
                    if rejected is None:
                        self._closed.wait(self.retry_s)
                    continue
                except (KeyError, ValueError, TypeError) as e:
                    with cond:
                        failures.append(SamplerRejected(f"completions from {url}: malformed answer: {e!r}"))
                        cond.notify_all()
                    return
                with cond:
                    results.append(comps)
                    state["pending"] -= 1
                    if state["wait_from"] is not None:
                        waited = time.monotonic() - state["wait_from"]
                        log.warning("sampler back after %.1fs", waited)
                        self.waited_s += waited
                        state["wait_from"] = None
                    cond.notify_all()

        threads = [
            threading.Thread(target=worker, args=(u,), daemon=True, name=f"sampler-{u}-{k}")
            for u in range(len(self.urls))
            for k in range(self.inflight)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise failures[0]
        if state["pending"]:
            raise SamplerClosed("completions: the sampler client was closed")
        out = [c for part in results for c in part]
        out.sort(key=lambda c: c.prompt_index)
        return out


def _completions(resp: Any, idxs: list[int], n: int) -> list[Completion]:
    """The completions of one /v1/completions answer for prompts ``idxs`` (``n`` choices each)."""
    model = str(resp["model"])
    out = []
    for ch in resp["choices"]:
        k = int(ch["index"])
        lp = ch.get("logprobs") or {}
        out.append(
            Completion(
                prompt_index=idxs[k // n],
                tokens=[int(t) for t in ch["token_ids"]],
                logprobs=[float(x) for x in lp.get("token_logprobs", [])],
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
