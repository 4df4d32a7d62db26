"""The sampler's authenticating front (rljob.sampler.front): every route of the pinned vLLM's route table,
asked through the front, is 401 without the run's token (the backend never sees it) and reaches the
backend with it; `/health` alone is open. The backend is a stand-in that records what reaches it."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from rljob.common.ports import free_port
from rljob.sampler.front import AppThread, serve_front

TOKEN = "t0ken-of-the-run"
ROUTES = json.loads((Path(__file__).parent / "data" / "vllm-0.32.0-routes.json").read_text())


def test_the_route_table_is_the_pinned_vllms() -> None:
    """The table was extracted from the vLLM the sampler image installs; the issue's routes are in it."""
    pinned = next(d for d in _deps() if d.startswith("vllm-tpu=="))
    assert pinned == f"vllm-tpu=={ROUTES['vllm']}"
    have = {(r["method"], r["path"]) for r in ROUTES["routes"]}
    for route in [
        ("POST", "/adapters"),
        ("DELETE", "/adapters/{adapter_name}"),
        ("POST", "/invocations"),
        ("POST", "/tokenize"),
        ("POST", "/scale_elastic_ep"),
        ("POST", "/v1/completions"),
        ("GET", "/health"),
    ]:
        assert route in have, route


def _deps() -> list[str]:
    import tomllib

    data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extras = data["project"]["optional-dependencies"]
    return [d for group in extras.values() for d in group]


class Backend:
    """A stand-in for vLLM on loopback: answers 200 with what it received on every method and path."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None, bytes]] = []

        async def record(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            self.seen.append((request.method, request.raw_path, request.headers.get("Authorization"), body))
            if request.path == "/stream":
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await out.prepare(request)
                for i in range(3):
                    await out.write(f"data: {i}\n\n".encode())
                await out.write_eof()
                return out
            return web.json_response(
                {"path": request.raw_path, "bytes": len(body)}, headers={"X-Backend": "1"}
            )

        app = web.Application(client_max_size=1 << 24)
        app.router.add_route("*", "/{tail:.*}", record)
        self.port = free_port()
        self.server = AppThread(app, "127.0.0.1", self.port, "backend")


@pytest.fixture(scope="module")
def front() -> Any:
    backend = Backend()
    port = free_port()
    srv = serve_front(f"http://127.0.0.1:{backend.port}", TOKEN, port, "127.0.0.1")
    yield f"http://127.0.0.1:{port}", backend
    srv.shutdown()
    backend.server.shutdown()


def _ask(
    method: str, url: str, headers: dict[str, str] | None = None, data: bytes | None = None
) -> tuple[int, bytes]:
    async def go() -> tuple[int, bytes]:
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, url, headers=headers or {}, data=data, allow_redirects=False) as r,
        ):
            return r.status, await r.read()

    return asyncio.run(go())


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "x", path)


def test_every_route_but_health_requires_the_token(front: Any) -> None:
    base, backend = front
    tried = refused = reached = 0
    routes = sorted({(r["method"], r["path"]) for r in ROUTES["routes"]})
    for route in routes:
        method, path = route[0], _concrete(route[1])
        backend.seen.clear()
        if path == "/health":
            assert _ask(method, base + path)[0] == 200 and backend.seen, route
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"bearer {TOKEN}"}):
            tried += 1
            status, _ = _ask(method, base + path, headers, b'{"name": "x", "src": "gs://evil"}')
            assert status == 401 and backend.seen == [], (route, headers)
            refused += 1
        status, _ = _ask(method, base + path, {"Authorization": f"Bearer {TOKEN}"}, b'{"a": 1}')
        assert status == 200 and backend.seen and backend.seen[-1][:2] == (method, path), route
        assert backend.seen[-1][3] == (b'{"a": 1}' if method != "GET" else backend.seen[-1][3])
        reached += 1
    guarded = len(routes) - 1  # /health: GET only
    assert (tried, refused, reached) == (3 * guarded, 3 * guarded, guarded)


HOSTILE = [
    # (method, path): ways around an exact /health
    ("POST", "/health"),
    ("DELETE", "/health"),
    ("OPTIONS", "/v1/completions"),  # vLLM's own middleware skips OPTIONS
    ("OPTIONS", "/adapters"),
    ("GET", "/health/../adapters"),
    ("GET", "/health%2F..%2Fadapters"),
    ("GET", "//health"),
    ("GET", "/health/"),
    ("GET", "/HEALTH"),
    ("PUT", "/adapters"),
    ("PATCH", "/v1/models"),
    ("GET", "/no-such-route"),
]


@pytest.mark.parametrize(("method", "path"), HOSTILE)
def test_paths_around_health_are_refused(front: Any, method: str, path: str) -> None:
    base, backend = front
    backend.seen.clear()
    assert _ask(method, base + path)[0] == 401 and backend.seen == []


def test_bodies_answers_and_streams_pass_through(front: Any) -> None:
    base, backend = front
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    big = b"x" * (3 << 20)  # larger than aiohttp's default 1 MiB request limit
    status, body = _ask("POST", base + "/v1/completions?stream=false", auth, big)
    assert status == 200 and json.loads(body) == {"path": "/v1/completions?stream=false", "bytes": len(big)}
    assert backend.seen[-1][2] == f"Bearer {TOKEN}"  # vLLM's own key check still applies behind the front
    assert _ask("GET", base + "/stream", auth) == (200, b"data: 0\n\ndata: 1\n\ndata: 2\n\n")
    assert _ask("HEAD", base + "/health")[0] == 200


def test_a_backend_that_is_down_is_a_503_not_a_hang() -> None:
    port = free_port()
    srv = serve_front(f"http://127.0.0.1:{free_port()}", TOKEN, port, "127.0.0.1")
    try:
        assert _ask("GET", f"http://127.0.0.1:{port}/health")[0] == 503
        assert _ask("GET", f"http://127.0.0.1:{port}/v1/models")[0] == 401
    finally:
        srv.shutdown()


def test_vllm_listens_on_loopback_only() -> None:
    from fixtures.recipes import manifest, resolve
    from rljob.sampler.vllm import build_command

    cmd = build_command(resolve(manifest({})), port=12345, api_key=TOKEN)
    i = cmd.argv.index("--host")
    assert cmd.argv[i + 1] == "127.0.0.1" and cmd.argv[cmd.argv.index("--port") + 1] == "12345"


def test_the_cpu_backend_is_served_behind_the_same_front() -> None:
    """The CPU backend (make rl-cpu, rljob drill, make demo) listens on loopback behind the front, as vLLM:
    on the sampler's port every route of its own router and of vLLM's table is 401 without the token
    (its `GET /rljob/v1/adapter` answered anyone before), `/health` alone open, and the server itself on
    loopback only."""
    from types import SimpleNamespace

    from rljob.sampler.cpu_server import CpuSampler
    from rljob.sampler.main import serve_behind_front

    policy = SimpleNamespace(vocab_size=256, spec=SimpleNamespace(base_model="tiny"))
    server = CpuSampler(policy, max_loras=1, status=lambda: {"version": 3}, token=TOKEN)  # type: ignore[arg-type]
    app = server.app()
    own = sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None})
    port, backend = free_port(), free_port()
    loop = asyncio.new_event_loop()  # the backend's, in a thread of its own (as the sampler's main loop)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    served = asyncio.run_coroutine_threadsafe(
        serve_behind_front(app, TOKEN, "127.0.0.1", port, backend), loop
    )
    runner, front = served.result(60)
    try:
        base = f"http://127.0.0.1:{port}"
        routes = own + sorted({(r["method"], r["path"]) for r in ROUTES["routes"]})
        tried = refused = 0
        for method, path in routes:
            if method == "HEAD":
                continue
            if path == "/health" and method == "GET":
                assert _ask(method, base + path)[0] == 200
                continue
            tried += 1
            status, _ = _ask(method, base + _concrete(path), {}, b'{"lora_name": "x", "lora_path": "/tmp"}')
            assert status == 401, (method, path, status)
            refused += 1
        assert ("GET", "/rljob/v1/adapter") in own and tried == refused > len(own)
        status, body = _ask("GET", base + "/rljob/v1/adapter", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and json.loads(body)["version"] == 3
    finally:
        front.shutdown()
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
