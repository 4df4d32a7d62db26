#!/usr/bin/env python3
"""Adapter hot-swap time: from the trainer's export to the sampler serving the new version.

A rank-32 LoRA with Qwen3-8B's shapes (36 layers; q/k/v/o and gate/up/down; hidden 4096, 32 query and
8 KV heads of 128, MLP 12288) is about 170 MB in 16-bit floats (float16 here; safetensors' numpy API has
no bfloat16; the same bytes). Random tensors, the real path otherwise, on the local GCS emulator:

1. export: the trainer runtime's rljob.trainer.export.AdapterPublisher (a background thread) runs
   publish_adapter, which writes v{N}/ and then LATEST; the trainer only waits for ``submit``;
2. the sampler's AdapterWatcher (rljob.sampler.adapters) polls LATEST, downloads v{N}, POSTs
   /v1/load_lora_adapter, then unloads v{N-1};
3. the serving side is a stand-in for vLLM's load: an HTTP server that reads the whole safetensors file
   into memory on load (vLLM on TPU additionally moves the tensors to the device: not measured here).

    .venv/bin/python bench/adapter_swap.py [--versions 4] [--dtype float16|float32]

JSON lines {"bench", "metric", "value", ...}: per version the seconds from LATEST written to served
(`export_to_serving_s`, goal <= 5) and from export start (`export_start_to_serving_s`), then the median.
Whether the loop waits: the trainer runtime hands v{N} to the background publisher (the trainer is
blocked only by ``submit``, `trainer_blocked_by_export_s`); the upload and the sampler side overlap
the next train step (the loop samples step s+2 with >= v{s+1} while step s+1 trains), so they are
waited on only when together they take longer than one train step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web
from safetensors.numpy import load_file

BENCH = "adapter_swap"
QWEN3_8B = {"layers": 36, "hidden": 4096, "q": 32 * 128, "kv": 8 * 128, "mlp": 12288}


def lora_tensors(rank: int, dtype: str, seed: int) -> dict[str, np.ndarray]:
    s = QWEN3_8B
    shapes = {  # module: (in, out)
        "self_attn.q_proj": (s["hidden"], s["q"]),
        "self_attn.k_proj": (s["hidden"], s["kv"]),
        "self_attn.v_proj": (s["hidden"], s["kv"]),
        "self_attn.o_proj": (s["q"], s["hidden"]),
        "mlp.gate_proj": (s["hidden"], s["mlp"]),
        "mlp.up_proj": (s["hidden"], s["mlp"]),
        "mlp.down_proj": (s["mlp"], s["hidden"]),
    }
    rng = np.random.default_rng(seed)
    out = {}
    for layer in range(s["layers"]):
        for mod, (fan_in, fan_out) in shapes.items():
            base = f"base_model.model.model.layers.{layer}.{mod}"
            out[f"{base}.lora_A.weight"] = rng.standard_normal((rank, fan_in), np.float32).astype(dtype)
            out[f"{base}.lora_B.weight"] = rng.standard_normal((fan_out, rank), np.float32).astype(dtype)
    return out


class LoadServer:
    """/v1/load_lora_adapter reads the adapter file fully; /v1/unload_lora_adapter drops it."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] = {}

    async def load(self, req: web.Request) -> web.Response:
        body = await req.json()
        path = Path(body["lora_path"]) / "adapter_model.safetensors"
        self.loaded[body["lora_name"]] = await asyncio.to_thread(load_file, str(path))
        return web.Response(text="ok")

    async def unload(self, req: web.Request) -> web.Response:
        body = await req.json()
        self.loaded.pop(body["lora_name"], None)
        return web.Response(text="ok")

    def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        threading.Thread(target=loop.run_forever, daemon=True).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"


def emit(metric: str, value: Any, **ctx: Any) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, **ctx}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=4)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    p.add_argument("--poll-s", type=float, default=0.2)
    args = p.parse_args(argv)

    from rljob.local.gcs_emulator import create_bucket
    from rljob.local.localrun import start_gcs

    work = Path(tempfile.mkdtemp(prefix="adapter-swap-"))
    gcs, endpoint = start_gcs(work)
    os.environ.update({"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": "rljob-bench"})
    try:
        from rljob.sampler.adapters import AdapterStore, AdapterWatcher, LoraEndpoint
        from rljob.trainer.export import AdapterPublisher, publish_adapter

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        create_bucket(endpoint, bucket)
        uri = f"gs://{bucket}/ns/job/adapters"
        server = LoadServer()
        watcher = AdapterWatcher(
            AdapterStore(uri), LoraEndpoint(server.start()), work / "local", "job", poll_s=args.poll_s
        )
        _, stop = watcher.start()
        config = {"peft_type": "LORA", "r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": []}
        tensors = lora_tensors(args.rank, args.dtype, 0)
        size_mb = sum(t.nbytes for t in tensors.values()) / 1e6
        ctx = {
            "adapter_mb": round(size_mb, 1),
            "rank": args.rank,
            "dtype": args.dtype,
            "model": "qwen3-8b shapes",
            "storage": "fake-gcs-server (local)",
            "poll_s": args.poll_s,
        }
        latest_at: dict[int, float] = {}

        def timed_publish(u: str, v: int, t: dict[str, np.ndarray], c: dict[str, Any]) -> str:
            out = publish_adapter(u, v, t, c)
            latest_at[v] = time.monotonic()
            return out

        publisher = AdapterPublisher(uri, config, publish=timed_publish)
        swaps, exports, totals, blocked = [], [], [], []
        for v in range(args.versions):
            t0 = time.monotonic()
            publisher.submit(v, tensors)
            blocked.append(time.monotonic() - t0)
            publisher.flush()
            t1 = latest_at[v]
            while watcher.served_version != v:
                if time.monotonic() - t1 > 300:
                    raise RuntimeError(f"v{v} not served after 300 s")
                time.sleep(0.01)
            t2 = time.monotonic()
            rec = watcher.served
            assert rec is not None
            swaps.append(t2 - t1)
            exports.append(t1 - t0)
            totals.append(t2 - t0)
            emit(
                "export_to_serving_s",
                round(t2 - t1, 3),
                version=v,
                export_s=round(t1 - t0, 3),
                export_start_to_serving_s=round(t2 - t0, 3),
                download_s=round(rec.download_s, 3),
                load_s=round(rec.load_s, 3),
                unload_s=round(rec.unload_s, 3),
                **ctx,
            )
        med, med_export, med_total = (statistics.median(x) for x in (swaps, exports, totals))
        emit("export_to_serving_s_median", round(med, 3), goal_s=5.0, meets_goal=med <= 5.0, **ctx)
        emit(
            "export_start_to_serving_s_median",
            round(med_total, 3),
            goal_s=5.0,
            meets_goal=med_total <= 5.0,
            **ctx,
        )
        # The runtime hands v{N} to the background publisher: only submit blocks the trainer; the upload
        # and the sampler side (poll, download, load, unload) overlap the next train step.
        emit(
            "trainer_blocked_by_export_s_median",
            round(statistics.median(blocked), 4),
            loop_waits=False,
            upload_s_median=round(med_export, 3),
            why="runtime.run submits v{N} to a background publisher (one upload in flight)",
            **ctx,
        )
        emit(
            "sampler_side_swap_s_median",
            round(med, 3),
            loop_waits_if_train_step_s_below=round(med_total, 3),
            why="step s+2 is sampled with >= v{s+1} while step s+1 trains (upload + swap overlap it)",
            **ctx,
        )
        publisher.close()
        stop.set()
    finally:
        gcs.terminate()
        gcs.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
