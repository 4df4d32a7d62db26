"""The loop's sampler fan-out: one step's completions from N replicas at once against one replica.

``--replicas`` stand-in samplers (rljob.sampler.standin: local HTTP servers, no model, every completion
request takes ``--delay-s`` as a replica's batch under its --max-num-seqs does) serve the loop's client
(rljob.trainer.sampler_client.SamplerClient, as the trainer runs it: requests of at most ``--max-num-seqs``
sequences, one in flight per replica). One step is ``--prompts`` prompts x ``--n`` completions. For each N
the median over ``--repeats`` steps is compared with one replica's; the client fans out well when
``ratio`` (N replicas' step time / one replica's) is close to ``ideal`` (1/N).

JSON lines: ``step_s`` per N, then ``ratio`` and ``ideal`` (with replicas, prompts, n, delay_s,
requests per step).

Run: ``.venv/bin/python bench/sampler_fanout.py [--replicas 2,4,8] [--delay-s 0.2] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import ExitStack

BENCH = "sampler_fanout"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", default="2,4,8")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--delay-s", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from rljob.sampler.standin import StandinReplica
    from rljob.trainer.data import Prompt
    from rljob.trainer.sampler_client import SamplerClient

    prompts = [Prompt(tokens=[i % 250, 1 + i % 250], text=None, answer="") for i in range(args.prompts)]

    def step_s(n_replicas: int) -> tuple[float, int]:
        with ExitStack() as stack:
            reps = [stack.enter_context(StandinReplica("bench", args.delay_s)) for _ in range(n_replicas)]
            client = SamplerClient([r.url for r in reps], "bench", max_seqs=args.max_num_seqs)
            client.complete(prompts[:1], 1, 1, 1.0, 0)  # warm-up: connections, threads
            before = sum(r.requests for r in reps)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                comps = client.complete(prompts, args.n, 4, 1.0, 0)
                times.append(time.perf_counter() - t0)
                assert len(comps) == args.prompts * args.n
            return statistics.median(times), (sum(r.requests for r in reps) - before) // args.repeats

    ctx = {"bench": BENCH, "prompts": args.prompts, "n": args.n, "delay_s": args.delay_s}
    one, one_requests = step_s(1)
    print(
        json.dumps(
            {**ctx, "replicas": 1, "metric": "step_s", "value": round(one, 4), "requests": one_requests}
        )
    )
    for n in (int(x) for x in args.replicas.split(",")):
        t, requests = step_s(n)
        row = {**ctx, "replicas": n, "requests": requests}
        print(json.dumps({**row, "metric": "step_s", "value": round(t, 4)}), flush=True)
        print(json.dumps({**row, "metric": "ratio", "value": round(t / one, 4)}), flush=True)
        print(json.dumps({**row, "metric": "ideal", "value": round(1 / n, 4)}), flush=True)


if __name__ == "__main__":
    main()
