"""The one HTTP client of rljob's processes: aiohttp, with the same rules for every caller.

- **Bounded concurrency**: at most ``concurrency`` requests of one client are on the wire at once.
- **Retries** with exponential backoff and jitter (:class:`Retry`) on what may pass: no connection, a
  timeout, a dropped or truncated answer, HTTP 5xx and HTTP 429 (whose ``Retry-After`` is honoured, up to the
  cap). Another 4xx is never retried: it raises :class:`HttpStatusError` at once.
- **A timeout per request** (each attempt), and **a bounded answer**: a body over ``max_body`` bytes raises
  :class:`ResponseTooLarge` (never retried).
- **JSON helpers** (:meth:`AsyncHttp.get_json`, :meth:`AsyncHttp.post_json`).
- **A synchronous facade** (:class:`SyncHttp`) for callers on plain threads (the trainer loop's): the async
  client on an event loop of its own thread; :meth:`SyncHttp.close` ends every call in progress
  (:class:`HttpClosed`), a wait for a server that is not up yet included.

aiohttp's client reference: https://docs.aiohttp.org/en/stable/client_reference.html. Backoff with jitter:
https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/.
"""

from __future__ import annotations

import asyncio
import atexit
import json as jsonlib
import logging
import random
import threading
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

__all__ = [
    "NO_RETRY",
    "AsyncHttp",
    "HttpClosed",
    "HttpError",
    "HttpStatusError",
    "HttpUnavailable",
    "Response",
    "ResponseTooLarge",
    "Retry",
    "SyncHttp",
    "shared",
]

log = logging.getLogger("rljob.common.http")

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_BODY = 64 * 1024 * 1024
DEFAULT_CONCURRENCY = 16
_ERROR_BODY = 4096  # bytes of an error answer kept for its message


class HttpError(Exception):
    """A request that did not give an answer to use; ``url`` is the one asked."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


class HttpStatusError(HttpError):
    """An answer that is not retried: a 4xx other than 429 (``status``; ``body``: its first bytes)."""

    def __init__(self, url: str, status: int, body: bytes) -> None:
        super().__init__(f"{url}: HTTP {status}: {body[:300].decode(errors='replace')}", url)
        self.status, self.body = status, body

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class HttpUnavailable(HttpError):
    """Every attempt failed for a reason that may pass; ``last`` describes the last one (``HTTP 503``,
    ``ConnectionRefusedError: ...``), ``status`` is its HTTP status or None (no answer), ``body`` the first
    bytes of that answer."""

    def __init__(self, url: str, attempts: int, last: str, status: int | None, body: bytes = b"") -> None:
        super().__init__(f"{url}: no answer in {attempts} attempt(s) ({last})", url)
        self.attempts, self.last, self.status, self.body = attempts, last, status, body

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")


class ResponseTooLarge(HttpError):
    """The answer's body is over the client's ``max_body`` bytes."""


class HttpClosed(HttpError):
    """The client was closed while the request was in flight or waiting to retry."""


@dataclass(frozen=True)
class Retry:
    """How often and how long to retry. ``attempts``: the most requests in all (None: until the client is
    closed). Before attempt ``k + 1`` the client waits ``min(cap_s, base_s * 2**k)``, times a random factor in
    [0.5, 1] (jitter: clients that failed together do not come back together); a 429's ``Retry-After``
    (seconds) replaces that wait when longer, still at most ``cap_s``."""

    attempts: int | None = 5
    base_s: float = 0.1
    cap_s: float = 10.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"Retry.attempts: {self.attempts} must be >= 1 (or None)")
        if self.base_s < 0 or self.cap_s < 0:
            raise ValueError(f"Retry: base_s {self.base_s} and cap_s {self.cap_s} must be >= 0")

    def delay(self, attempt: int) -> float:
        """The wait after failed attempt number ``attempt`` (0-based)."""
        return min(self.cap_s, self.base_s * 2.0 ** min(attempt, 60)) * self.rng.uniform(0.5, 1.0)


NO_RETRY = Retry(attempts=1)


@dataclass(frozen=True)
class Response:
    url: str
    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        return jsonlib.loads(self.body)


class _Retryable(Exception):
    def __init__(self, last: str, status: int | None, after_s: float | None, body: bytes = b"") -> None:
        super().__init__(last)
        self.last, self.status, self.after_s, self.body = last, status, after_s, body


def _describe(e: BaseException) -> str:
    if isinstance(e, aiohttp.ClientConnectorError) and e.os_error is not None:
        e = e.os_error
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None  # an HTTP date: the backoff applies


async def _read(resp: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """At most ``limit`` bytes of the body, and whether there was more."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        if size + len(chunk) > limit:
            chunks.append(chunk[: limit - size])
            return b"".join(chunks), True
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), False


class AsyncHttp:
    """The async client. Bound to the event loop of its first request; :meth:`close` it on that loop."""

    def __init__(
        self,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_body: int = DEFAULT_MAX_BODY,
        retry: Retry | None = None,
    ) -> None:
        if concurrency < 1 or timeout <= 0 or max_body < 0:
            raise ValueError(f"AsyncHttp: concurrency {concurrency}, timeout {timeout}, max_body {max_body}")
        self.concurrency, self.timeout, self.max_body = concurrency, timeout, max_body
        self.retry = retry or Retry()
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._closing: asyncio.Event | None = None
        self.closed = False

    def _ensure(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore, asyncio.Event]:
        if self.closed:
            raise HttpClosed("the HTTP client is closed", "")
        if self._session is None or self._slots is None or self._closing is None:
            self._slots = asyncio.Semaphore(self.concurrency)
            self._closing = asyncio.Event()
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency), raise_for_status=False
            )
        return self._session, self._slots, self._closing

    async def close(self) -> None:
        self.closed = True
        if self._closing is not None:
            self._closing.set()
        if self._session is not None:
            await self._session.close()

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or raise HttpClosed as soon as the client is closed."""
        _, _, closing = self._ensure()
        try:
            await asyncio.wait_for(closing.wait(), seconds)
        except TimeoutError:
            return
        raise HttpClosed("the HTTP client was closed", "")

    async def request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        data: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        retry: Retry | None = None,
        max_body: int | None = None,
    ) -> Response:
        """The answer (status < 400) to one request, retried per ``retry`` (the client's by default).

        Raises HttpStatusError (a 4xx other than 429), HttpUnavailable (every attempt failed for a reason
        that may pass), ResponseTooLarge, HttpClosed."""
        session, slots, _ = self._ensure()
        policy = retry or self.retry
        limit = self.max_body if max_body is None else max_body
        if json is not None:
            data = jsonlib.dumps(json).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        client_timeout = aiohttp.ClientTimeout(total=timeout or self.timeout)
        attempt = 0
        while True:
            try:
                async with slots:
                    if self.closed:
                        raise HttpClosed(f"{url}: the HTTP client was closed", url)
                    return await self._once(session, method, url, data, headers, client_timeout, limit)
            except _Retryable as failed:
                attempt += 1
                if policy.attempts is not None and attempt >= policy.attempts:
                    raise HttpUnavailable(url, attempt, failed.last, failed.status, failed.body) from None
                wait = policy.delay(attempt - 1)
                if failed.after_s is not None:
                    wait = min(policy.cap_s, max(wait, failed.after_s))
                log.debug("%s %s: %s; retrying in %.2fs", method, url, failed.last, wait)
                try:
                    await self.sleep(wait)
                except HttpClosed:
                    raise HttpClosed(f"{url}: the HTTP client was closed ({failed.last})", url) from None

    async def _once(
        self,
        session: aiohttp.ClientSession,
        method: str,
        url: str,
        data: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: aiohttp.ClientTimeout,
        limit: int,
    ) -> Response:
        try:
            async with session.request(method, url, data=data, headers=headers, timeout=timeout) as resp:
                if resp.status >= 400:
                    body, _ = await _read(resp, _ERROR_BODY)
                    if resp.status >= 500 or resp.status == 429:
                        after = _retry_after(resp.headers.get("Retry-After"))
                        raise _Retryable(f"HTTP {resp.status}", resp.status, after, body)
                    raise HttpStatusError(url, resp.status, body)
                if resp.content_length is not None and resp.content_length > limit:
                    size = resp.content_length
                    raise ResponseTooLarge(f"{url}: an answer of {size} bytes (> {limit})", url)
                body, more = await _read(resp, limit)
                if more:
                    raise ResponseTooLarge(f"{url}: an answer of more than {limit} bytes", url)
                return Response(url, resp.status, dict(resp.headers), body)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError, OSError) as e:
            if self.closed:
                raise HttpClosed(f"{url}: the HTTP client was closed", url) from None
            raise _Retryable(_describe(e), None, None) from None

    async def get(self, url: str, **kw: Any) -> Response:
        return await self.request("GET", url, **kw)

    async def post(self, url: str, **kw: Any) -> Response:
        return await self.request("POST", url, **kw)

    async def get_json(self, url: str, **kw: Any) -> Any:
        """The JSON answer of a GET (ValueError when it is not JSON)."""
        return (await self.request("GET", url, **kw)).json()

    async def post_json(self, url: str, body: Any, **kw: Any) -> Any:
        """POST ``body`` as JSON; the JSON answer (ValueError when it is not JSON)."""
        return (await self.request("POST", url, json=body, **kw)).json()


class SyncHttp:
    """The client for synchronous callers: an :class:`AsyncHttp` on an event loop in a thread of its own.
    Any number of threads may call it at once (up to ``concurrency`` of their requests on the wire)."""

    def __init__(self, name: str = "http", **kw: Any) -> None:
        self.aio = AsyncHttp(**kw)
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name=f"{name}-loop")
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if self._closed.is_set():
                coro.close()
                raise HttpClosed("the HTTP client is closed", "")
            return await coro
        except asyncio.CancelledError:
            if self._closed.is_set():
                raise HttpClosed("the HTTP client was closed", "") from None
            raise
        finally:
            self._tasks.discard(task)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the client's loop (it may use :attr:`aio`) and return its result; HttpClosed when
        the client is or gets closed."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SyncHttp.run from its own event loop: await the coroutine instead")
        if self._closed.is_set():
            coro.close()
            raise HttpClosed("the HTTP client is closed", "")
        fut = asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)
        while True:
            try:
                return fut.result(timeout=1.0)
            except TimeoutError:
                if self._closed.is_set() and not self._loop.is_running():
                    fut.cancel()
                    raise HttpClosed("the HTTP client was closed", "") from None

    def request(self, method: str, url: str, **kw: Any) -> Response:
        return self.run(self.aio.request(method, url, **kw))

    def get(self, url: str, **kw: Any) -> Response:
        return self.run(self.aio.request("GET", url, **kw))

    def post(self, url: str, **kw: Any) -> Response:
        return self.run(self.aio.request("POST", url, **kw))

    def get_json(self, url: str, **kw: Any) -> Any:
        return self.run(self.aio.get_json(url, **kw))

    def post_json(self, url: str, body: Any, **kw: Any) -> Any:
        return self.run(self.aio.post_json(url, body, **kw))

    def close(self) -> None:
        """End every call in progress (HttpClosed) and stop the loop's thread."""
        if self._closed.is_set():
            return
        self._closed.set()

        async def shut() -> None:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            # Each call ends (HttpClosed) before the loop stops: a task left pending would leave its caller
            # waiting forever.
            if tasks:
                await asyncio.wait(tasks, timeout=5)
            await self.aio.close()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=10)

    def __enter__(self) -> SyncHttp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: SyncHttp | None = None
_shared_lock = threading.Lock()


def shared() -> SyncHttp:
    """The process's client for occasional synchronous calls (readiness polls, one-off requests); closed
    when the interpreter exits (its connections then close cleanly, without aiohttp's unclosed-session
    warnings)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = SyncHttp("http-shared")
            atexit.register(_shared.close)
        return _shared
