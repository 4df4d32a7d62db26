"""The tile counter of bench/pad_first_tiles.py reproduces the pad-first figures; the packer's agrees."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from rljob.trainer.packing import rank_tiles


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


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_packer_tile_model_matches_the_bench_counter(data: st.DataObject) -> None:
    """rljob.trainer.packing.rank_tiles (block level, the balanced layout's objective) equals the bench's
    token-level counter on random rows of aligned segments and gaps, for both chunk assignments."""
    b = _bench()
    cp = data.draw(st.sampled_from([1, 2, 4]))
    blocks = data.draw(st.sampled_from([((4, 8), (8, 8)), ((2, 4), (4, 2)), ((8, 16), (16, 16))]))
    row = 2 * cp * 16 * data.draw(st.integers(1, 3))
    pieces = data.draw(st.lists(st.tuples(st.integers(0, row // 4), st.integers(1, row // 3)), max_size=8))
    starts, ends, seg, cursor = [], [], np.zeros(row, np.int32), 0
    for gap, n in pieces:
        if cursor + gap + n > row:
            break
        cursor += gap
        starts.append(cursor)
        ends.append(cursor + n)
        seg[cursor : cursor + n] = len(starts)
        cursor += n
    dcs = data.draw(st.booleans())
    got = rank_tiles([starts or [0]], [ends or [0]], row, blocks, cp, dcs)[0]
    for i, blk in enumerate(blocks):
        assert got[i].tolist() == b.tiles_per_rank(seg, blk, cp, dcs).tolist()


def test_a_segment_blind_counter_is_caught() -> None:
    """A counter that ignores segment ids (plain causal) disagrees with the packer's on a packed row."""
    b = _bench()
    seg = np.zeros(64, np.int32)
    seg[0:20], seg[24:50] = 1, 2
    blind = b.tiles_per_rank(np.where(seg > 0, 1, 1), (4, 8), 2)
    got = rank_tiles([[0, 24]], [[20, 50]], 64, ((4, 8),), 2)[0, 0]
    assert got.tolist() == b.tiles_per_rank(seg, (4, 8), 2).tolist()
    assert got.tolist() != blind.tolist()
