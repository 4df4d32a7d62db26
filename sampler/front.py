"""The sampler's authenticating front: every route of the sampler's port requires the run's token but
`/health`.

vLLM's own API-key check (`--api-key` / VLLM_API_KEY) guards only paths under `/v1`, `/v2`, `/inference`
and `/cohere` (vllm/entrypoints/serve/middleware/authenticate.py, GUARDED_PREFIX, in the pinned vLLM; its
`--api-key` help says so). The same server also answers `POST /adapters` and `DELETE /adapters/{name}`
(registered with VLLM_ALLOW_RUNTIME_LORA_UPDATING, which the hot-swap needs: replacing the served adapter
in place under its name), `/invocations`, `/tokenize`, `/scale_elastic_ep`, `/pause`, `/sleep`, ... So vLLM
listens on loopback only and this front, on the pod's port, checks `Authorization: Bearer <token>` (in
constant time) on every method and path but `GET`/`HEAD /health` (the readiness probe's), answers 401
before reading a body otherwise, and forwards the request as it came (body and answer streamed) to vLLM
on 127.0.0.1. The route table the test asks through the front is the pinned vLLM's
(tests/sampler/data/vllm-<version>-routes.json, hack/extract_vllm_routes.py).
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
from aiohttp import web
from rljob.common.credentials import authorized

OPEN_PATHS = frozenset({"/health"})
"""Paths answered without the token (GET and HEAD only): the kubelet's probes carry no token."""
# Hop-by-hop headers (RFC 9110 section 7.6.1) and those the two connections set for themselves.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_CHUNK = 64 * 1024


def _forwarded(headers: object) -> dict[str, str]:
    items = headers.items()  # type: ignore[attr-defined]
    return {k: v for k, v in items if k.lower() not in _HOP}


def front_app(upstream: str, token: str) -> web.Application:
    """The front of the server at ``upstream`` (``http://127.0.0.1:<port>``), behind ``token``."""
    if not token:
        raise ValueError("front_app: no token (the sampler's port never serves without one)")
    upstream = upstream.rstrip("/")
    session: dict[str, aiohttp.ClientSession] = {}

    async def open_session(_app: web.Application) -> None:
        # No total timeout: a generation may take minutes. auto_decompress off: bytes go through as sent.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        session["s"] = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    async def close_session(_app: web.Application) -> None:
        await session["s"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        open_route = request.path in OPEN_PATHS and request.method in ("GET", "HEAD")
        if not open_route and not authorized(request.headers.get("Authorization"), token):
            return web.json_response({"error": "Unauthorized"}, status=401)
        body = request.content.iter_chunked(_CHUNK) if request.body_exists else None
        try:
            async with session["s"].request(
                request.method,
                upstream + request.raw_path,
                headers=_forwarded(request.headers),
                data=body,
                allow_redirects=False,
            ) as up:
                out = web.StreamResponse(status=up.status, reason=up.reason, headers=_forwarded(up.headers))
                await out.prepare(request)
                async for chunk in up.content.iter_chunked(_CHUNK):
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (TimeoutError, aiohttp.ClientConnectionError) as e:
            return web.json_response(
                {"error": f"sampler backend unavailable: {type(e).__name__}"}, status=503
            )

    app = web.Application(client_max_size=0)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


class AppThread:
    """An aiohttp application served on ``host:port`` from an event loop in a thread of its own; raises
    OSError when the port is taken."""

    def __init__(self, app: web.Application, host: str, port: int, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self.thread.start()
        self.runner = web.AppRunner(app, access_log=None)

        async def start() -> None:
            await self.runner.setup()
            await web.TCPSite(self.runner, host, port).start()

        try:
            asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        if not self.loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def serve_front(upstream: str, token: str, port: int, host: str = "0.0.0.0") -> AppThread:
    """:func:`front_app` on ``host:port`` (the pod's sampler port)."""
    return AppThread(front_app(upstream, token), host, port, "sampler-front")
