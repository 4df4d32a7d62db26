"""Padding with one compiled shape on a fixed-seed rollout mix: uniform rows vs token-budget packing.

1,024 rollouts per step; prompts uniform in 256..1,024 tokens, completions log-uniform in
256..19,456 (every sequence fits 20,480). ``uniform``: every rollout padded to 20,480 (the seed's
one-shape choice); ``packed``: rljob.trainer.packing (first-fit decreasing, segment starts aligned
to 64) into rows of 20,480, grouped ``--rows`` rows per micro-batch (the last one completed with
empty rows, which count as padding). JSON lines: padding_fraction per layout,
useful_tokens_ratio (real tokens per compiled token slot, packed over uniform), rows per layout.
Run: ``.venv/bin/python bench/packing_padding.py [--seeds 0,1,2] [--rows 1,8]``.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from rljob.trainer.packing import PackConfig, Rollout, pack_rollouts, padding_fraction

BUDGET = 20_480
N = 1024


def rollout_mix(seed: int) -> list[Rollout]:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(256, 1025, N)
    completions = np.exp(rng.uniform(np.log(256), np.log(19_456), N)).astype(int)
    assert (prompts + completions <= BUDGET).all()
    return [
        Rollout(
            np.ones(p, np.int32), np.ones(c, np.int32), per_token={"old_logprobs": np.zeros(c, np.float32)}
        )
        for p, c in zip(prompts, completions, strict=True)
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--segment-align", type=int, default=64)
    a = ap.parse_args()
    for seed in (int(s) for s in a.seeds.split(",")):
        rollouts = rollout_mix(seed)
        real = sum(r.num_tokens for r in rollouts)
        for rows in (int(r) for r in a.rows.split(",")):
            ctx = {
                "seed": seed,
                "rollouts": N,
                "budget": BUDGET,
                "rows_per_batch": rows,
                "segment_align": a.segment_align,
                "real_tokens": real,
            }

            def emit(metric: str, value: float, c: dict[str, object] = ctx, **kw: object) -> None:
                print(json.dumps({"bench": "packing_padding", "metric": metric, "value": value, **c, **kw}))

            uniform_rows = -(-N // rows) * rows
            uniform_pad = 1 - real / (uniform_rows * BUDGET)
            batches = pack_rollouts(
                rollouts, PackConfig(budget=BUDGET, rows=rows, segment_align=a.segment_align)
            )
            packed_pad = padding_fraction(batches)
            packed_rows = len(batches) * rows
            emit("padding_fraction", round(uniform_pad, 4), layout="uniform", rows=uniform_rows)
            emit(
                "padding_fraction",
                round(packed_pad, 4),
                layout="packed",
                rows=packed_rows,
                lower_bound_rows=-(-real // BUDGET),
            )
            emit("useful_tokens_ratio", round((1 - packed_pad) / (1 - uniform_pad), 3))


if __name__ == "__main__":
    main()
