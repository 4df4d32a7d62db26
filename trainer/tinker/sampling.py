"""The Tinker service's side of the samplers: OpenAI-style completions with a saved adapter's name.

The run's samplers (vLLM in a pod, ``rljob-sampler --backend cpu`` locally; RunConfig.endpoints.samplers)
serve adapters by name. An adapter the service saved for sampling is a PEFT directory on the run's
storage; a sampler that does not serve it yet answers 404 for that model, and the service then asks the
sampler's adapter agent (``POST`` to the sampler's port + ADAPTER_AGENT_PORT_OFFSET at ADAPTER_AGENT_PATH,
rljob.sampler.adapters.AdapterAgent)
to download and load it, evicting the least recently used adapter beyond ``spec.sampler.maxLoras``, and
sends the request again. Both carry the run's token (``Authorization: Bearer``,
rljob.common.credentials), which the samplers require. A restarted sampler is therefore refilled on demand.
Requests go round-robin over the samplers (rljob.common.http); an unreachable sampler is retried, backing
off from ``retry_s``, until ``timeout`` (a sampler restarting). A sampler's 4xx for the request (the
client's input) fails it at once, as the client's fault; a 5xx answer is tried SERVER_ERROR_ATTEMPTS times
in all, then fails as the service's fault.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse, urlunparse

from rljob.common.credentials import bearer
from rljob.common.http import NO_RETRY, AsyncHttp, HttpStatusError, HttpUnavailable, Retry
from rljob.recipes.runconfig import ADAPTER_AGENT_PATH as AGENT_PATH
from rljob.recipes.runconfig import ADAPTER_AGENT_PORT_OFFSET as AGENT_PORT_OFFSET
from rljob.recipes.runconfig import SAMPLED_LOGPROBS

__all__ = ["Completion", "SamplerError", "SamplerPool", "agent_url"]

log = logging.getLogger("rljob.trainer.tinker.sampling")

SERVER_ERROR_ATTEMPTS = 3  # a sampler that answers 5xx to one request: its answer, not an outage


class SamplerError(RuntimeError):
    """A sampler refused a request (4xx other than an unknown adapter), or none answered in time."""

    def __init__(self, message: str, user: bool = False) -> None:
        super().__init__(message)
        self.user = user


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


def agent_url(sampler_url: str) -> str:
    """The adapter agent of a sampler: the same host, port + AGENT_PORT_OFFSET."""
    u = urlparse(sampler_url)
    port = (u.port or 80) + AGENT_PORT_OFFSET
    return urlunparse(u._replace(netloc=f"{u.hostname}:{port}")).rstrip("/")


class SamplerPool:
    def __init__(
        self, urls: list[str], *, timeout: float = 600.0, retry_s: float = 0.5, token: str | None = None
    ) -> None:
        if not urls:
            raise ValueError("endpoints.samplers: the run config names no sampler")
        self.urls = [u.rstrip("/") for u in urls]
        self.headers = bearer(token)
        self.timeout, self.retry_s = timeout, retry_s
        self._next = itertools.cycle(range(len(self.urls)))
        self.backoff = Retry(attempts=None, base_s=retry_s, cap_s=max(retry_s, 5.0))
        # Each attempt is one request (the deadline and the adapter reload are this pool's); bound to the
        # service's event loop at its first request.
        self._http = AsyncHttp(concurrency=100, timeout=timeout, max_body=1 << 30, retry=NO_RETRY)

    async def close(self) -> None:
        await self._http.close()

    async def _ensure(self, url: str, name: str, uri: str) -> None:
        try:
            await self._http.post(
                f"{agent_url(url)}{AGENT_PATH}", json={"name": name, "uri": uri}, headers=self.headers
            )
        except (HttpStatusError, HttpUnavailable) as e:
            if e.status is None:
                raise  # no connection: retried with the request
            raise SamplerError(
                f"sampler {url}: loading adapter {name} from {uri}: HTTP {e.status}: {e.text[:300]}"
            ) from None

    async def complete(
        self,
        prompt: list[int],
        *,
        n: int,
        params: dict[str, Any],
        model: str,
        adapter_uri: str | None,
    ) -> list[Completion]:
        """``n`` completions of ``prompt`` from ``model`` (a base model name, or an adapter name whose PEFT
        directory is at ``adapter_uri``); per-token log-probs of the sampled tokens."""
        url = self.urls[next(self._next)]
        body = {
            "model": model,
            "prompt": prompt,
            "n": n,
            "logprobs": SAMPLED_LOGPROBS,
            "return_token_ids": True,
            **params,
        }
        deadline = time.monotonic() + self.timeout
        loaded = False
        attempt = faults = 0
        while True:
            try:
                try:
                    out = await self._http.post_json(f"{url}/v1/completions", body, headers=self.headers)
                except HttpStatusError as e:
                    if e.status == 404 and adapter_uri is not None and not loaded:
                        await self._ensure(url, model, adapter_uri)
                        loaded = True
                        continue
                    raise SamplerError(
                        f"sampler refused the request: HTTP {e.status}: {e.text[:500]}", user=True
                    ) from None
                break
            except HttpUnavailable as e:
                if e.status is not None:  # an answer (5xx, 429): a few times, never until the deadline
                    faults += 1
                    if faults >= SERVER_ERROR_ATTEMPTS:
                        raise SamplerError(
                            f"sampler {url} failed the request {faults} times: HTTP {e.status}: "
                            f"{e.text[:300]}"
                        ) from None
                if time.monotonic() > deadline:
                    raise SamplerError(f"sampler {url} unavailable: {e.last}") from e
                log.warning("sampler %s unavailable (%s); retrying", url, e.last)
                await asyncio.sleep(self.backoff.delay(attempt))
                attempt += 1
                loaded = False
        result = []
        for ch in sorted(out["choices"], key=lambda c: int(c["index"])):
            lp = (ch.get("logprobs") or {}).get("token_logprobs") or []
            tokens = [int(t) for t in ch["token_ids"]]
            if len(lp) != len(tokens):
                raise SamplerError(
                    f"sampler {url}: choice {ch.get('index')}: {len(tokens)} tokens but {len(lp)} log-probs"
                )
            reason = "stop" if ch.get("finish_reason") == "stop" else "length"
            result.append(Completion(tokens, [float(x) for x in lp], reason))
        return result
