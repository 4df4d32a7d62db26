"""Attention tiles per context rank: padding at the end vs first (seed 002), then segment placement.

Counting rule (seed 002): Splash computes a [q block, kv block] tile unless it is entirely above the
causal diagonal or the query block's segment-id range [min, max] does not overlap the key block's;
context parallelism over ``cp`` = 4 ranks with dual chunk swap (rank r holds sequence chunks r and
2cp-1-r of 2cp as queries; keys are the whole row); forward blocks 1,024 x 4,096, dkv blocks
2,048 x 2,048. Padding has segment id 0.

1. The seed's row: 60,948 real tokens (one segment) in 65,536, ``pad_position`` end and start
   (pad_align 4,096): metrics fwd_tiles_per_rank and dkv_tiles_per_rank (lists per rank).
2. Beyond the seed: rows packed by rljob.trainer.packing (budget 65,536, segment_align 64) from the
   rollout mix of bench/packing_padding.py (prompts 256..1,024, completions log-uniform
   256..19,456). Per row, a placement search (segment order and where each aligned gap of padding
   goes; the row keeps its tokens, segments stay contiguous and 64-aligned) minimizes the busiest
   rank's fwd + dkv tiles (both tile shapes have 4 Mi entries). Metrics: busiest_rank_ratio
   (sum over rows of the busiest rank's tiles, placed over pad-first, for fwd, dkv and fwd+dkv)
   and the same for pad-end over pad-first for reference.

Run: ``.venv/bin/python bench/pad_first_tiles.py [--seed 0] [--samples 256]``.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from rljob.trainer.packing import PackConfig, Rollout, align_up, pack_rollouts, start_shift

ROW, CP, PAD_ALIGN, SEG_ALIGN = 65_536, 4, 4096, 64
FWD, DKV = (1024, 4096), (2048, 2048)


def tiles_per_rank(seg: np.ndarray, blocks: tuple[int, int], cp: int = CP) -> np.ndarray:
    """[cp] tiles each context rank computes for one row of segment ids (0 = padding)."""
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
    return per_chunk[:cp] + per_chunk[::-1][:cp]


def layout(lengths: list[int], gaps: list[int], row: int = ROW) -> np.ndarray:
    """Segment ids of a row: gap[i] padding tokens, then segment i (starts aligned to SEG_ALIGN)."""
    seg = np.zeros(row, np.int32)
    cursor = 0
    for i, (n, g) in enumerate(zip(lengths, gaps, strict=True), start=1):
        cursor = align_up(cursor, SEG_ALIGN) + g
        seg[cursor : cursor + n] = i
        cursor += n
    assert cursor <= row
    return seg


def cost(seg: np.ndarray) -> tuple[int, int, int]:
    f, d = tiles_per_rank(seg, FWD), tiles_per_rank(seg, DKV)
    return int((f + d).max()), int(f.max()), int(d.max())


def place(
    lengths: list[int], rng: np.random.Generator, samples: int
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Best placement found: candidate orders x random splits of the free padding into aligned gaps."""
    k = len(lengths)
    used = sum(align_up(n, SEG_ALIGN) for n in lengths[:-1]) + lengths[-1]
    free_units = (ROW - used) // SEG_ALIGN
    orders = [list(range(k)), list(range(k))[::-1], sorted(range(k), key=lambda i: lengths[i])]
    best: tuple[np.ndarray, tuple[int, int, int]] | None = None
    for s in range(samples):
        order = orders[s] if s < len(orders) else list(rng.permutation(k))
        split = rng.multinomial(free_units, rng.dirichlet(np.ones(k + 1)))
        for gaps_units in (split[:k], np.eye(1, k, 0, int)[0] * free_units, np.zeros(k, int)):
            seg = layout([lengths[i] for i in order], [int(u) * SEG_ALIGN for u in gaps_units])
            c = cost(seg)
            if best is None or c < best[1]:
                best = (seg, c)
    assert best is not None
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=256)
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
    }
    rows = {k: np.concatenate([b.segment_ids for b in pack_rollouts(rollouts, c)]) for k, c in cfgs.items()}
    totals = {k: np.zeros(3, np.int64) for k in ("end", "start", "placed")}
    for r in range(rows["end"].shape[0]):
        seg_end, seg_start = rows["end"][r], rows["start"][r]
        ids, counts = np.unique(seg_end[seg_end > 0], return_counts=True)
        lengths = counts[np.argsort(ids)].tolist()
        placed, c_placed = place(lengths, rng, a.samples)
        c_start = cost(seg_start)
        if c_start < c_placed:  # the search space holds pad-first only approximately; never do worse
            placed, c_placed = seg_start, c_start
        assert sorted(np.unique(placed[placed > 0], return_counts=True)[1].tolist()) == sorted(lengths)
        totals["end"] += cost(seg_end)
        totals["start"] += c_start
        totals["placed"] += c_placed
    n_rows = int(rows["end"].shape[0])
    moved = int(sum((rows["start"][r] != rows["end"][r]).any() for r in range(n_rows)))
    emit("rows_moved_by_pad_first", moved, rows=n_rows, rollouts=a.rollouts, seed=a.seed)
    for i, kernel in enumerate(("fwd+dkv", "fwd", "dkv")):
        ctx = {"kernel": kernel, "rows": n_rows, "rollouts": a.rollouts, "seed": a.seed, "samples": a.samples}
        emit("busiest_rank_tiles", int(totals["start"][i]), layout="start", **ctx)
        emit("busiest_rank_tiles", int(totals["placed"][i]), layout="placed", **ctx)
        emit(
            "busiest_rank_ratio",
            round(float(totals["placed"][i] / totals["start"][i]), 4),
            layout="placed_over_start",
            **ctx,
        )
        emit(
            "busiest_rank_ratio",
            round(float(totals["end"][i] / totals["start"][i]), 4),
            layout="end_over_start",
            **ctx,
        )


if __name__ == "__main__":
    main()
