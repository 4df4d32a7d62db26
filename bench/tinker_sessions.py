"""The Tinker service's cost per session. ``--route sampling``: ``--total`` ``create_sampling_session``
requests (what the SDK's ``create_sampling_client`` sends; the SDK itself caches a client per model, so
they go over HTTP here, each a new session) in one client session. ``--route session``: ``--total``
``create_session`` requests (one per SDK ServiceClient), each a live client session, round-robin over
four keys (a key holds at most SESSIONS_PER_KEY live sessions). Timed per ``--batch``.

Each session is state the service keeps (and persists for a restart); the figure to watch is whether a
batch's time grows with the sessions created before it. One process: the tiny CPU model, the service in
a thread, storage on a local directory (the run's ``checkpoints`` and ``adapters``). JSON lines: metric
``batch_seconds`` (a batch's seconds), with ``route``, ``batch`` (index), ``requests``,
``sessions_held`` (the service's table after the batch: sampling sessions, or live client sessions),
``registry_bytes`` (registry.json after the batch: what a write of the whole registry writes).

Run: ``.venv/bin/python bench/tinker_sessions.py [--route sampling|session] [--total 3000] [--batch 1000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path

BENCH = "tinker_sessions"
KEYS = [f"tml-bench-sessions-{i}" for i in range(4)]  # client sessions go round-robin over the keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--route", choices=("sampling", "session"), default="sampling")
    args = ap.parse_args()
    os.environ["RLJOB_TINKER_API_KEYS"] = ",".join(KEYS)  # what spec.service.apiKeySecret's Secret provides

    import httpx
    from rljob.local.tinker_cpu import local_service_config
    from rljob.trainer.model import Policy
    from rljob.trainer.tinker.main import build, serve
    from rljob.trainer.tinypolicy import cpu_model_spec, cpu_shape

    work = Path(tempfile.mkdtemp(prefix="tinker-bench-"))
    rc = local_service_config("gs://bench", 1, work / "progress.json", service={"checkpointEvery": 0})
    storage = rc.storage.model_copy(
        update={"checkpoints": str(work / "ckpt"), "adapters": str(work / "adapters")}
    )
    rc = rc.model_copy(update={"storage": storage})
    vocab, max_len = cpu_shape(rc)
    lora = rc.spec.lora
    policy = Policy(cpu_model_spec(lora.rank, lora.alpha, vocab_size=vocab, max_len=max_len))
    service, _ = build(rc, "tiny", policy=policy)

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    stop = asyncio.Event()
    ready = threading.Event()
    url: dict[str, str] = {}

    def on_ready(u: str) -> None:
        url["u"] = u
        ready.set()

    done = asyncio.run_coroutine_threadsafe(serve(service, "127.0.0.1", 0, on_ready, stop), loop)
    assert ready.wait(60)
    base = service.cfg.base_model
    registry = work / "ckpt" / "tinker" / "registry.json"
    api = f"{url['u']}/api/v1"
    with httpx.Client(headers={"X-API-Key": KEYS[0]}, timeout=60) as http:
        body = {"tags": [], "user_metadata": {}, "sdk_version": "bench", "type": "create_session"}
        sid = http.post(f"{api}/create_session", json=body).raise_for_status().json()["session_id"]
        seq = 0
        for b in range(args.total // args.batch):
            t0 = time.perf_counter()
            for _ in range(args.batch):
                if args.route == "sampling":
                    req = {"session_id": sid, "sampling_session_seq_id": seq, "base_model": base}
                    http.post(f"{api}/create_sampling_session", json=req).raise_for_status()
                else:
                    key = {"X-API-Key": KEYS[seq % len(KEYS)]}
                    http.post(f"{api}/create_session", json=body, headers=key).raise_for_status()
                seq += 1
            held = service.sampling if args.route == "sampling" else service.sessions
            line = {
                "bench": BENCH,
                "metric": "batch_seconds",
                "value": round(time.perf_counter() - t0, 2),
                "route": args.route,
                "batch": b,
                "requests": args.batch,
                "sessions_held": len(held),
                "registry_bytes": registry.stat().st_size if registry.exists() else 0,
            }
            print(json.dumps(line), flush=True)
    loop.call_soon_threadsafe(stop.set)
    done.result(60)


if __name__ == "__main__":
    main()
