"""Attention tiles per context rank: padding at the end vs first, then the packer's balanced layout.

Counting rule (Splash attention's block mask): a [q block, kv block] tile is computed unless it is
entirely above the causal diagonal or the query block's segment-id range [min, max] does not overlap the
key block's; context parallelism over ``cp`` = 4 ranks with dual chunk swap (rank r holds sequence
chunks r and 2cp-1-r of 2cp as queries; keys are the whole row); forward blocks 1,024 x 4,096, dkv
blocks 2,048 x 2,048. Padding has segment id 0.

1. The pad-first design's row: 60,948 real tokens (one segment) in 65,536, ``pad_position`` end and start
   (pad_align 4,096): metrics fwd_tiles_per_rank and dkv_tiles_per_rank (lists per rank).
2. Beyond the seed: rows packed by rljob.trainer.packing (budget 65,536, segment_align 64) from the
   rollout mix of bench/packing_padding.py (prompts 256..1,024, completions log-uniform
   256..19,456), laid out pad-first, pad-end and by the trainer's own ``pad_position="balanced"``
   (the packer orders each row's rollouts to minimise the busiest rank's tiles under this tile model:
   cp 4, dual chunk swap, the blocks above). Tiles are counted here on the packed segment ids, apart
   from the packer's own counter. Metrics: busiest_rank_ratio (sum over rows of the busiest rank's
   tiles, balanced over pad-first, for fwd, dkv and fwd+dkv) and the same for pad-end over pad-first
   for reference; balanced_layout_ms: the packer's layout search for the step's rows (median of
   ``--repeats`` calls after one warm-up that compiles it; wall and process CPU time).

Run: ``.venv/bin/python bench/pad_first_tiles.py [--seed 0] [--rollouts 1024] [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from rljob.trainer.packing import (
    BALANCED_PERMUTATIONS,
    PackConfig,
    Rollout,
    balanced_starts,
    first_fit_decreasing,
    pack_rollouts,
    start_shift,
)

ROW, CP, PAD_ALIGN, SEG_ALIGN = 65_536, 4, 4096, 64
FWD, DKV = (1024, 4096), (2048, 2048)


def tiles_per_rank(
    seg: np.ndarray, blocks: tuple[int, int], cp: int = CP, dual_chunk_swap: bool = True
) -> np.ndarray:
    """[cp] tiles each context rank computes for one row of segment ids (0 = padding); without dual
    chunk swap rank r holds chunks 2r and 2r+1."""
    bq, bkv = blocks
    length = seg.size
    chunk = length // (2 * cp)
    kv = seg.reshape(-1, bkv)
    kmin, kmax = kv.min(1), kv.max(1)
    kstart = np.arange(kv.shape[0]) * bkv
    q = seg.reshape(2 * cp, chunk // bq, bq)
    qmin, qmax = q.min(2), q.max(2)
    qend = np.arange(2 * cp)[:, None] * chunk + (np.arange(chunk // bq)[None, :] + 1) * bq - 1
    causal = kstart[None, None, :] <= qend[:, :, None]
    overlap = (qmin[:, :, None] <= kmax[None, None, :]) & (kmin[None, None, :] <= qmax[:, :, None])
    per_chunk = (causal & overlap).sum((1, 2))
    if not dual_chunk_swap:
        out: np.ndarray = per_chunk.reshape(cp, 2).sum(1)
        return out
    return per_chunk[:cp] + per_chunk[::-1][:cp]


def cost(seg: np.ndarray) -> tuple[int, int, int]:
    f, d = tiles_per_rank(seg, FWD), tiles_per_rank(seg, DKV)
    return int((f + d).max()), int(f.max()), int(d.max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rollouts", type=int, default=1024)
    a = ap.parse_args()

    def emit(metric: str, value: object, **kw: object) -> None:
        ctx = {"row": ROW, "cp": CP, "fwd_blocks": list(FWD), "dkv_blocks": list(DKV), "pad_align": PAD_ALIGN}
        print(
            json.dumps({"bench": "pad_first_tiles", "metric": metric, "value": value, **ctx, **kw}),
            flush=True,
        )

    # 1. the seed's single-segment row
    end = np.zeros(ROW, np.int32)
    end[:60_948] = 1
    start = np.roll(end, start_shift(60_948, ROW, PAD_ALIGN))
    for name, seg in (("end", end), ("start", start)):
        emit("fwd_tiles_per_rank", tiles_per_rank(seg, FWD).tolist(), pad_position=name, real_tokens=60_948)
        emit("dkv_tiles_per_rank", tiles_per_rank(seg, DKV).tolist(), pad_position=name, real_tokens=60_948)

    # 2. multi-segment rows from the rollout mix
    rng = np.random.default_rng(a.seed)
    prompts = rng.integers(256, 1025, a.rollouts)
    completions = np.exp(rng.uniform(np.log(256), np.log(19_456), a.rollouts)).astype(int)
    rollouts = [
        Rollout(np.ones(p, np.int32), np.ones(c, np.int32)) for p, c in zip(prompts, completions, strict=True)
    ]
    cfgs = {
        "end": PackConfig(budget=ROW, segment_align=SEG_ALIGN),
        "start": PackConfig(budget=ROW, segment_align=SEG_ALIGN, pad_position="start", pad_align=PAD_ALIGN),
        "balanced": PackConfig(
            budget=ROW,
            segment_align=SEG_ALIGN,
            pad_position="balanced",
            pad_align=PAD_ALIGN,
            context_ranks=CP,
            kernel_blocks=(FWD, DKV),
            dual_chunk_swap=True,
        ),
    }
    rows = {k: np.concatenate([b.segment_ids for b in pack_rollouts(rollouts, c)]) for k, c in cfgs.items()}
    totals = {k: np.zeros(3, np.int64) for k in cfgs}
    for k, segs in rows.items():
        for seg in segs:
            totals[k] += cost(seg)
    n_rows = int(rows["end"].shape[0])
    moved = int(sum((rows["start"][r] != rows["end"][r]).any() for r in range(n_rows)))
    emit("rows_moved_by_pad_first", moved, rows=n_rows, rollouts=a.rollouts, seed=a.seed)
    for i, kernel in enumerate(("fwd+dkv", "fwd", "dkv")):
        ctx = {"kernel": kernel, "rows": n_rows, "rollouts": a.rollouts, "seed": a.seed}
        for k in cfgs:
            emit("busiest_rank_tiles", int(totals[k][i]), layout=k, **ctx)
        for k in ("balanced", "end"):
            ratio = round(float(totals[k][i] / totals["start"][i]), 4)
            emit("busiest_rank_ratio", ratio, layout=f"{k}_over_start", **ctx)

    # 3. the cost of the balanced layout: the search alone, over the step's first-fit-decreasing rows
    lengths = [r.num_tokens for r in rollouts]
    bins = [[lengths[i] for i in items] for items in first_fit_decreasing(lengths, ROW, SEG_ALIGN)]
    balanced_starts(bins, cfgs["balanced"])  # compiles the search (once per process)
    wall, cpu = [], []
    for _ in range(a.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        balanced_starts(bins, cfgs["balanced"])
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    ctx = {"rows": len(bins), "rollouts": a.rollouts, "repeats": a.repeats, "seed": a.seed}
    ctx["permutations"] = BALANCED_PERMUTATIONS
    emit("balanced_layout_ms", round(1e3 * float(np.median(wall)), 3), clock="wall", **ctx)
    emit("balanced_layout_ms", round(1e3 * float(np.median(cpu)), 3), clock="process_cpu", **ctx)


if __name__ == "__main__":
    main()
