"""The tile counter of bench/pad_first_tiles.py reproduces the pad-first layout's published figures; placements keep tokens."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "pad_first_tiles.py"
    spec = importlib.util.spec_from_file_location("pad_first_tiles", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seed_002_tile_counts() -> None:
    b = _bench()
    end = np.zeros(65_536, np.int32)
    end[:60_948] = 1
    start = np.roll(end, 4096)
    assert b.tiles_per_rank(end, b.FWD).tolist() == [80, 136, 136, 136]
    assert b.tiles_per_rank(start, b.FWD).tolist() == [125, 120, 120, 120]
    assert b.tiles_per_rank(end, b.DKV).tolist() == [74, 132, 132, 132]
    assert b.tiles_per_rank(start, b.DKV).tolist() == [122, 116, 116, 116]
    # no segment skipping at all: plain causal dual-chunk-swap is balanced
    full = np.ones(65_536, np.int32)
    assert len(set(b.tiles_per_rank(full, b.FWD).tolist())) == 1


def test_placement_keeps_segments_whole_and_aligned() -> None:
    b = _bench()
    lengths = [20_000, 15_001, 9_000, 7_777, 3_000]
    seg, cost = b.place(lengths, np.random.default_rng(0), 8)
    assert sorted(np.unique(seg[seg > 0], return_counts=True)[1].tolist()) == sorted(lengths)
    for s in np.unique(seg[seg > 0]):
        where = np.flatnonzero(seg == s)
        assert where[0] % 64 == 0 and (np.diff(where) == 1).all()
    assert cost == b.cost(seg)
