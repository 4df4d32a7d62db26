"""A stand-in for a vLLM sampler replica, for rehearsals and benchmarks: no model, a fixed delay.

It answers the part of vLLM's OpenAI server the RL loop uses (the same paths and response shapes as
rljob.sampler.cpu_server): `GET /health`, `GET /v1/models` (the base model and the adapter
`<prefix>-v<version>`), `POST /v1/completions` (each prompt's `n` choices carry `token_ids`,
`prompt_token_ids` and `logprobs.token_logprobs`; the completion is the prompt's last token + 1, ... so an
answer can be checked against its prompt). Every completion request takes `delay_s` seconds, whatever its
size, as a replica's decode step does for a batch under its `--max-num-seqs`; the server counts the
requests it served and the most it held at once.

    python -m rljob.sampler.standin --port 8000 --delay-s 0.2 --prefix myjob
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from typing import Any

from aiohttp import web
from rljob.common.ports import free_port


class StandinReplica:
    """One stand-in replica on ``host:port`` (port 0: a free loopback port from rljob.common.ports), served by
    aiohttp.web from an event loop in a daemon thread between :meth:`start` and :meth:`stop`."""

    def __init__(
        self,
        prefix: str,
        delay_s: float = 0.0,
        version: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        max_tokens_cap: int = 64,
        barrier: threading.Barrier | None = None,
    ) -> None:
        # Tests: every completion request waits here for the other parties (requests that are not
        # concurrent break it after barrier_timeout_s, and the request fails).
        self.barrier, self.barrier_timeout_s = barrier, 10.0
        self.prefix, self.delay_s, self.version = prefix, delay_s, version
        self.max_tokens_cap = max_tokens_cap
        self.requests = 0  # completion requests served
        self.sequences = 0  # completions returned
        self.active = 0
        self.max_active = 0  # the most completion requests held at once
        self.lock = threading.Lock()
        self.host, self.port = host, port or free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="standin")
        self.runner = web.AppRunner(self.app(), access_log=None)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> StandinReplica:
        async def serve() -> None:
            await self.runner.setup()
            await web.TCPSite(self.runner, self.host, self.port).start()

        self.thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop).result(30)
        return self

    def stop(self) -> None:
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def __enter__(self) -> StandinReplica:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompts = body.get("prompt")
        if not isinstance(prompts, list) or not prompts or not isinstance(prompts[0], list):
            prompts = [prompts]
        n = int(body.get("n", 1))
        max_tokens = min(int(body.get("max_tokens", 16)), self.max_tokens_cap)
        # As vLLM's TPU engine: no log-probs for `logprobs: 0` (tpu-inference 0.32; recipes/runconfig.py
        # SAMPLED_LOGPROBS), one per sampled token for 1 or more.
        want_lp = int(body.get("logprobs") or 0) >= 1
        choices = []
        for p, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt] if isinstance(prompt, list) else list(str(prompt).encode())
            last = ids[-1] if ids else 0
            toks = [(last + 1 + k) % 256 for k in range(max_tokens)]
            for j in range(n):
                choices.append(
                    {
                        "index": p * n + j,
                        "text": "",
                        "token_ids": toks,
                        "prompt_token_ids": ids,
                        "logprobs": {"token_logprobs": [-1.0] * len(toks) if want_lp else []},
                        "finish_reason": "length",
                    }
                )
        return {"object": "text_completion", "model": str(body.get("model", "")), "choices": choices}

    def app(self) -> web.Application:
        async def get(request: web.Request) -> web.Response:
            if request.path_qs == "/health":
                return web.json_response({})
            if request.path_qs == "/v1/models":
                ids = ["base", f"{self.prefix}-v{self.version}"]
                return web.json_response(
                    {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}
                )
            return web.json_response({"error": request.path_qs}, status=404)

        async def post(request: web.Request) -> web.StreamResponse:
            body = json.loads(await request.read() or b"{}")
            if request.path_qs != "/v1/completions":
                return web.json_response({"error": request.path_qs}, status=404)
            with self.lock:
                self.active += 1
                self.max_active = max(self.max_active, self.active)
            try:
                if self.barrier is not None:
                    try:
                        await asyncio.to_thread(self.barrier.wait, timeout=self.barrier_timeout_s)
                    except threading.BrokenBarrierError:
                        # Dropped without an answer, as a replica that lost the request.
                        if request.transport is not None:
                            request.transport.close()
                        raise
                await asyncio.sleep(self.delay_s)
                out = self.complete(body)
            finally:
                with self.lock:
                    self.active -= 1
            with self.lock:
                self.requests += 1
                self.sequences += len(out["choices"])
            return web.json_response(out)

        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/{tail:.*}", get)
        app.router.add_post("/{tail:.*}", post)
        return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rljob.sampler.standin", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--prefix", default="rljob")
    p.add_argument("--version", type=int, default=0)
    args = p.parse_args(argv)
    replica = StandinReplica(args.prefix, args.delay_s, args.version, args.host, args.port).start()
    print(f"stand-in sampler serving on {replica.url}", flush=True)
    replica.thread.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
