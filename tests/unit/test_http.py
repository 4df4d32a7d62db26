"""rljob.common.http against a real aiohttp server on a loopback port: retries on 5xx and 429 (Retry-After
honoured), none on another 4xx, the per-request timeout, the bounded answer, the concurrency bound, and
close() ending a wait."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from rljob.common.http import (
    AsyncHttp,
    HttpClosed,
    HttpStatusError,
    HttpUnavailable,
    ResponseTooLarge,
    Retry,
    SyncHttp,
)
from rljob.common.ports import free_port

FAST = Retry(attempts=5, base_s=0.01, cap_s=0.05)


class Server:
    """An aiohttp server in a thread; ``handler(request, n)`` answers the n-th request (0-based)."""

    def __init__(self, handler: Callable[[web.Request, int], Any]) -> None:
        self.count = 0
        self.active = self.max_active = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def handle(request: web.Request) -> web.StreamResponse:
            n = self.count
            self.count += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            try:
                out = handler(request, n)
                got: web.StreamResponse = await out if asyncio.iscoroutine(out) else out
                return got
            finally:
                self.active -= 1

        async def start() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handle)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
            ready.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        ready.wait(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[web.Request, int], Any]], Server]]:
    started: list[Server] = []

    def start(handler: Callable[[web.Request, int], Any]) -> Server:
        started.append(Server(handler))
        return started[-1]

    yield start
    for s in started:
        s.close()


@pytest.fixture
def http() -> Iterator[SyncHttp]:
    client = SyncHttp(retry=FAST, timeout=5.0)
    yield client
    client.close()


def test_a_503_is_retried_then_the_answer_counts(serve: Any, http: SyncHttp) -> None:
    srv = serve(lambda req, n: web.Response(status=503) if n < 2 else web.json_response({"ok": n}))
    assert http.get_json(f"{srv.url}/x") == {"ok": 2}
    assert srv.count == 3


def test_every_attempt_failing_says_the_last_reason(serve: Any, http: SyncHttp) -> None:
    srv = serve(lambda req, n: web.Response(status=500, text="down"))
    with pytest.raises(HttpUnavailable, match=r"no answer in 3 attempt\(s\) \(HTTP 500\)$") as e:
        http.get(f"{srv.url}/x", retry=Retry(attempts=3, base_s=0.01))
    assert e.value.status == 500 and srv.count == 3


def test_a_400_is_not_retried(serve: Any, http: SyncHttp) -> None:
    srv = serve(lambda req, n: web.Response(status=400, text="bad field"))
    with pytest.raises(HttpStatusError, match=r"HTTP 400: bad field$") as e:
        http.post_json(f"{srv.url}/x", {"a": 1})
    assert e.value.status == 400 and e.value.text == "bad field" and srv.count == 1


def test_a_429_waits_its_retry_after(serve: Any, http: SyncHttp) -> None:
    def busy(after: str) -> Callable[[web.Request, int], web.Response]:
        def answer(req: web.Request, n: int) -> web.Response:
            return web.Response(status=429, headers={"Retry-After": after}) if n == 0 else web.Response()

        return answer

    srv = serve(busy("1"))
    t0 = time.monotonic()
    assert http.get(f"{srv.url}/x", retry=Retry(attempts=3, base_s=0.01, cap_s=5.0)).status == 200
    assert srv.count == 2 and 1.0 <= time.monotonic() - t0 < 3.0
    # The cap bounds what a server may ask.
    srv2 = serve(busy("60"))
    t0 = time.monotonic()
    assert http.get(f"{srv2.url}/x", retry=Retry(attempts=3, base_s=0.01, cap_s=0.2)).status == 200
    assert time.monotonic() - t0 < 2.0


def test_nothing_listening_is_retried_then_unavailable(http: SyncHttp) -> None:
    with pytest.raises(HttpUnavailable, match=r"in 2 attempt\(s\) \(ConnectionRefusedError: .*Errno") as e:
        http.get(f"http://127.0.0.1:{free_port()}/x", retry=Retry(attempts=2, base_s=0.01))
    assert e.value.status is None


def test_a_slow_answer_times_out(serve: Any, http: SyncHttp) -> None:
    async def slow(req: web.Request, n: int) -> web.Response:
        await asyncio.sleep(0.8)
        return web.Response()

    srv = serve(slow)
    t0 = time.monotonic()
    with pytest.raises(HttpUnavailable, match=r"in 2 attempt\(s\) \(.*Timeout"):
        http.get(f"{srv.url}/x", timeout=0.2, retry=Retry(attempts=2, base_s=0.01))
    assert srv.count == 2 and time.monotonic() - t0 < 1.5


def test_an_oversize_body_is_refused(serve: Any) -> None:
    big = b"x" * 5000

    def chunked(req: web.Request, n: int) -> Any:
        async def stream() -> web.StreamResponse:
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(req)
            for _ in range(5):
                await resp.write(b"y" * 1000)
            await resp.write_eof()
            return resp

        return stream()

    srv = serve(lambda req, n: web.Response(body=big))
    chunks = serve(chunked)
    with SyncHttp(max_body=4096, retry=FAST) as small:
        with pytest.raises(ResponseTooLarge, match=r"5000 bytes \(> 4096\)"):
            small.get(f"{srv.url}/x")
        with pytest.raises(ResponseTooLarge, match=r"more than 4096 bytes"):  # no Content-Length
            small.get(f"{chunks.url}/x")
        assert small.get(f"{srv.url}/x", max_body=5000).body == big
    assert srv.count == 2 and chunks.count == 1  # never retried


def test_concurrency_is_bounded(serve: Any) -> None:
    async def slow(req: web.Request, n: int) -> web.Response:
        await asyncio.sleep(0.05)
        return web.json_response(n)

    srv = serve(slow)

    async def many(aio: AsyncHttp) -> list[Any]:
        return await asyncio.gather(*(aio.get_json(f"{srv.url}/x") for _ in range(12)))

    with SyncHttp(concurrency=3) as http:
        assert sorted(http.run(many(http.aio))) == list(range(12))
    assert srv.max_active == 3


def test_close_ends_a_wait_for_a_server_that_is_not_up() -> None:
    http = SyncHttp(retry=Retry(attempts=None, base_s=0.02, cap_s=0.05))
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            http.get(f"http://127.0.0.1:{free_port()}/x")
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    t.join(0.4)
    assert t.is_alive(), "attempts=None gave up"
    http.close()
    t.join(3)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], HttpClosed)
    with pytest.raises(HttpClosed):
        http.get("http://127.0.0.1:9/x")


def test_backoff_grows_to_its_cap_with_jitter() -> None:
    r = Retry(attempts=None, base_s=1.0, cap_s=8.0)
    for k, top in enumerate([1, 2, 4, 8, 8, 8]):
        waits = [r.delay(k) for _ in range(50)]
        assert all(top / 2 <= w <= top for w in waits) and len(set(waits)) > 1
    with pytest.raises(ValueError, match="attempts"):
        Retry(attempts=0)
