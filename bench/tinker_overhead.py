"""The Tinker API's cost: forward_backward + optim_step through the official SDK against the same step
in-process, on the same batch, side by side in one run.

One process builds the tiny CPU model with byte tokens (what `make tinker-cpu` serves) and serves the
Tinker API on it in a thread (rljob.trainer.tinker, no automatic checkpoints: ``checkpointEvery`` 0, so
both sides run the same compiled work). Two training clients of the same rank and seed: one driven
in-process (Engine.forward(backward=True) + Engine.optim_step), one through ``tinker.ServiceClient``
(protobuf request, seq_id ordering, futures, HTTP on loopback). Per batch size (``--datums``, each datum
``--tokens`` long), after a warm-up step each, ``--repeats`` steps alternate between the two and the
medians are compared. JSON lines: ``in_process_step_s``, ``sdk_step_s``, ``ratio`` (sdk / in-process),
``overhead_ms``, with datums, tokens, packed rows.

Run: ``.venv/bin/python bench/tinker_overhead.py [--datums 8,64] [--tokens 200] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH = "tinker_overhead"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datums", default="8,64")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import tinker
    from rljob.local.tinker_cpu import local_service_config
    from rljob.trainer.model import Policy
    from rljob.trainer.tinker.engine import AdamHP, DatumIn, LossSpec
    from rljob.trainer.tinker.main import build, serve
    from rljob.trainer.tinypolicy import cpu_model_spec, cpu_shape
    from tinker import types

    work = Path(tempfile.mkdtemp(prefix="tinker-bench-"))
    rc = local_service_config("gs://bench", 1, work / "progress.json", service={"checkpointEvery": 0})
    # Local storage (no emulator): the registry and named checkpoints only.
    storage = rc.storage.model_copy(
        update={"checkpoints": str(work / "ckpt"), "adapters": str(work / "adapters")}
    )
    rc = rc.model_copy(update={"storage": storage})
    vocab, max_len = cpu_shape(rc)
    lora = rc.spec.lora
    policy = Policy(cpu_model_spec(lora.rank, lora.alpha, vocab_size=vocab, max_len=max_len))
    service, _ = build(rc, "tiny", policy=policy, api_keys="tml-bench")
    engine = service.engine

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
    client = tinker.ServiceClient(base_url=url["u"], api_key="tml-bench")
    base = service.cfg.base_model
    sdk_tc = client.create_lora_training_client(base_model=base, rank=lora.rank, seed=0).result()
    local = engine.create("bench:in-process", base_model=base, rank=lora.rank, seed=0)
    adam = types.AdamParams(learning_rate=1e-4)
    hp = AdamHP(learning_rate=1e-4)
    loss = LossSpec("importance_sampling")
    rng = np.random.default_rng(0)
    common = {"bench": BENCH, "cpus": os.cpu_count(), "load1": round(os.getloadavg()[0], 2)}

    for n in [int(x) for x in args.datums.split(",")]:
        seqs = [rng.integers(0, vocab, args.tokens + 1) for _ in range(n)]
        adv = rng.standard_normal(n).astype(np.float32)
        old = [(-np.log(vocab) + 0.1 * rng.standard_normal(args.tokens)).astype(np.float32) for _ in range(n)]
        data_in = [
            DatumIn(tokens=s[:-1], targets=s[1:], advantages=np.full(args.tokens, a, np.float32), logprobs=o)
            for s, a, o in zip(seqs, adv, old, strict=True)
        ]
        data_sdk = [
            types.Datum(
                model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": s[1:].tolist(),
                    # the SDK types these as TensorData and converts lists (types.Datum.__post_init__)
                    "advantages": [float(a)] * args.tokens,  # type: ignore[dict-item]
                    "logprobs": o.tolist(),
                },
            )
            for s, a, o in zip(seqs, adv, old, strict=True)
        ]

        def in_process(data_in: list[Any] = data_in) -> float:
            t0 = time.perf_counter()
            engine.forward(local.model_id, data_in, loss, backward=True)
            engine.optim_step(local.model_id, hp)
            return time.perf_counter() - t0

        def via_sdk(data_sdk: list[Any] = data_sdk) -> float:
            t0 = time.perf_counter()
            fb = sdk_tc.forward_backward(data_sdk, "importance_sampling")
            opt = sdk_tc.optim_step(adam)
            fb.result()
            opt.result()
            return time.perf_counter() - t0

        # The in-process steps run on the service's worker thread, where every JAX call of the service runs.
        def on_worker(fn: Any) -> float:
            return float(service.worker.submit("bench", fn).result())

        on_worker(in_process)
        via_sdk()  # warm-up: compiles, connections
        local_s, sdk_s = [], []
        for _ in range(args.repeats):
            local_s.append(on_worker(in_process))
            sdk_s.append(via_sdk())
        a, b = statistics.median(local_s), statistics.median(sdk_s)
        packed, _ = engine._pack(data_in, loss)
        ctx = {**common, "datums": n, "tokens": n * args.tokens, "rows": len(packed) * engine.cfg.rows}
        for metric, value in (
            ("in_process_step_s", round(a, 4)),
            ("sdk_step_s", round(b, 4)),
            ("ratio", round(b / a, 3)),
            ("overhead_ms", round((b - a) * 1000, 1)),
        ):
            print(json.dumps({**ctx, "metric": metric, "value": value}), flush=True)

    client.close("success").result(timeout=60)  # before the service stops: no heartbeats to a dead service
    loop.call_soon_threadsafe(stop.set)
    done.result(60)


if __name__ == "__main__":
    main()
