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
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StandinReplica:
    """One stand-in replica on ``host:port`` (port 0: any free port), serving in a daemon thread."""

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
        self.server = ThreadingHTTPServer((host, port), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="standin")

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}" if isinstance(host, str) else f"http://127.0.0.1:{port}"

    def start(self) -> StandinReplica:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

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
                        "logprobs": {"token_logprobs": [-1.0] * len(toks)},
                        "finish_reason": "length",
                    }
                )
        return {"object": "text_completion", "model": str(body.get("model", "")), "choices": choices}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        replica = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _reply(self, code: int, payload: Any) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._reply(200, {})
                elif self.path == "/v1/models":
                    ids = ["base", f"{replica.prefix}-v{replica.version}"]
                    self._reply(200, {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]})
                else:
                    self._reply(404, {"error": self.path})

            def do_POST(self) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size) or b"{}")
                if self.path != "/v1/completions":
                    self._reply(404, {"error": self.path})
                    return
                with replica.lock:
                    replica.active += 1
                    replica.max_active = max(replica.max_active, replica.active)
                try:
                    if replica.barrier is not None:
                        replica.barrier.wait(timeout=replica.barrier_timeout_s)
                    time.sleep(replica.delay_s)
                    out = replica.complete(body)
                finally:
                    with replica.lock:
                        replica.active -= 1
                with replica.lock:
                    replica.requests += 1
                    replica.sequences += len(out["choices"])
                self._reply(200, out)

            def log_message(self, format: str, *args: object) -> None:
                return

        return Handler


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
