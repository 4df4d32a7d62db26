"""Property and table tests of rljob.trainer.packing (numpy only, no JAX)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rljob.trainer.packing import (
    PackConfig,
    PackedBatch,
    PackingError,
    Rollout,
    pack_rollouts,
    padding_fraction,
    rank_tiles,
    start_shift,
)

FIELDS = ("old_logprobs", "ref_logprobs")


@st.composite
def rollout_sets(draw: st.DrawFn) -> tuple[list[Rollout], PackConfig, PackConfig]:
    seg_align = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    n = draw(st.integers(0, 12))
    lens = [(draw(st.integers(0, 12)), draw(st.integers(0, 20))) for _ in range(n)]
    longest = max([p + c for p, c in lens], default=1)
    budget = draw(st.integers(max(longest, 1), max(longest, 1) + 40))
    rows = draw(st.integers(1, 3))
    max_seg = draw(st.one_of(st.none(), st.integers(1, 4)))
    k_max = (budget - 1) // seg_align
    pad_align = seg_align * draw(st.integers(1, max(k_max, 1)))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    rollouts = [
        Rollout(
            prompt_ids=rng.integers(1, 1000, p),
            completion_ids=rng.integers(1, 1000, c),
            advantage=float(rng.normal()),
            completion_mask=(rng.random(c) < 0.8).astype(np.float32),
            per_token={f: rng.normal(size=c).astype(np.float32) for f in FIELDS},
        )
        for p, c in lens
    ]
    end = PackConfig(budget=budget, rows=rows, segment_align=seg_align, max_segments=max_seg, pad_id=0)
    if pad_align >= budget:
        return rollouts, end, end
    start = PackConfig(
        budget=budget,
        rows=rows,
        segment_align=seg_align,
        max_segments=max_seg,
        pad_position="start",
        pad_align=pad_align,
    )
    return rollouts, end, start


def expected(r: Rollout) -> dict[str, np.ndarray]:
    p, c = np.asarray(r.prompt_ids), np.asarray(r.completion_ids)
    z = np.zeros(p.size, np.float32)
    out = {
        "tokens": np.concatenate([p, c]).astype(np.int32),
        "positions": np.arange(p.size + c.size, dtype=np.int32),
        "prompt_mask": np.concatenate([np.ones(p.size, np.float32), np.zeros(c.size, np.float32)]),
        "loss_mask": np.concatenate(
            [z, np.ones(c.size, np.float32) if r.completion_mask is None else np.asarray(r.completion_mask)]
        ),
        "advantages": np.concatenate([z, np.full(c.size, r.advantage, np.float32)]),
    }
    for f, v in r.per_token.items():
        out[f] = np.concatenate([z, np.asarray(v, np.float32)])
    return out


def check_invariants(rollouts: list[Rollout], cfg: PackConfig, batches: list[PackedBatch]) -> None:
    """Everything a packing must satisfy; raises AssertionError naming what broke."""
    seen: dict[int, int] = {}
    for b in batches:
        assert b.shape == (cfg.rows, cfg.budget)
        arrays = b.per_token_arrays()
        pad = b.segment_ids == 0
        assert (b.rollout_index[pad] == -1).all() and (b.rollout_index[~pad] >= 0).all()
        assert (b.tokens[pad] == cfg.pad_id).all() and (b.positions[pad] == 0).all()
        for name, a in arrays.items():
            if name not in ("tokens", "rollout_index", "segment_ids"):
                assert (a[pad] == 0).all(), f"padding carries {name}"
        assert (b.num_segments <= cfg.max_segments_per_row).all()
        for row in range(cfg.rows):
            ids = np.unique(b.rollout_index[row][b.rollout_index[row] >= 0])
            assert len(ids) == b.num_segments[row]
            for i in ids:
                where = np.flatnonzero(b.rollout_index[row] == i)
                start = int(where[0])
                assert (np.diff(where) == 1).all(), "segment not contiguous"
                assert start % cfg.segment_align == 0, "segment start not aligned"
                assert len(set(b.segment_ids[row, where])) == 1
                seen[int(i)] = seen.get(int(i), 0) + 1
                want = expected(rollouts[int(i)])
                for name, v in want.items():
                    np.testing.assert_array_equal(arrays[name][row, where], v, err_msg=name)
            segs = b.segment_ids[row][b.segment_ids[row] > 0]
            assert (np.diff(segs) >= 0).all(), "segment ids not increasing along the row"
            assert set(segs.tolist()) == set(range(1, int(b.num_segments[row]) + 1)), "segment ids not 1..n"
    want_ids = {i for i, r in enumerate(rollouts) if r.num_tokens > 0}
    assert set(seen) == want_ids, "a rollout was lost"
    assert all(v == 1 for v in seen.values()), "a rollout was split or duplicated"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rollout_sets())
def test_pack_invariants_and_pad_first_is_rotation(
    case: tuple[list[Rollout], PackConfig, PackConfig],
) -> None:
    rollouts, end_cfg, start_cfg = case
    end = pack_rollouts(rollouts, end_cfg)
    check_invariants(rollouts, end_cfg, end)
    if start_cfg is end_cfg:
        return
    start = pack_rollouts(rollouts, start_cfg)
    check_invariants(rollouts, start_cfg, start)
    assert len(start) == len(end)
    for be, bs in zip(end, start, strict=True):
        ae, as_ = be.per_token_arrays(), bs.per_token_arrays()
        assert ae.keys() == as_.keys()
        for row in range(end_cfg.rows):
            real = np.flatnonzero(be.segment_ids[row] > 0)
            last_end = int(real[-1]) + 1 if real.size else 0
            shift = start_shift(last_end, end_cfg.budget, start_cfg.pad_align)
            assert shift % start_cfg.pad_align == 0
            assert last_end == 0 or end_cfg.budget - last_end - shift < start_cfg.pad_align
            for name in ae:
                np.testing.assert_array_equal(as_[name][row], np.roll(ae[name][row], shift), err_msg=name)
                assert as_[name].dtype == ae[name].dtype
        np.testing.assert_array_equal(bs.num_segments, be.num_segments)


def _spans(b: PackedBatch) -> tuple[np.ndarray, np.ndarray]:
    """[rows, max segments] starts and ends of a packed batch's segments, in position order."""
    k = max(int(b.num_segments.max()), 1)
    starts, ends = np.zeros((b.shape[0], k), np.int64), np.zeros((b.shape[0], k), np.int64)
    for r in range(b.shape[0]):
        for s in range(1, int(b.num_segments[r]) + 1):
            where = np.flatnonzero(b.segment_ids[r] == s)
            starts[r, s - 1], ends[r, s - 1] = where[0], where[-1] + 1
    return starts, ends


@st.composite
def balanced_sets(draw: st.DrawFn) -> tuple[list[Rollout], PackConfig]:
    """Rollouts and a balanced config whose row splits into whole blocks of 2 x cp chunks."""
    cp = draw(st.sampled_from([1, 2, 4]))
    bq = draw(st.sampled_from([1, 2, 4, 8]))
    bk = draw(st.sampled_from([2, 4, 8, 16]))
    budget = draw(st.integers(1, 4)) * int(np.lcm(2 * cp * bq, bk))
    seg_align = draw(st.sampled_from([1, 2, 4]))
    budget = int(np.lcm(budget, 2 * seg_align))
    n = draw(st.integers(0, 14))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    lens = [
        (int(rng.integers(0, min(4, budget // 2 + 1))), int(rng.integers(0, max(2, budget // 3))))
        for _ in range(n)
    ]
    rollouts = [
        Rollout(
            prompt_ids=rng.integers(1, 1000, p),
            completion_ids=rng.integers(1, 1000, c),
            advantage=float(rng.normal()),
            per_token={f: rng.normal(size=c).astype(np.float32) for f in FIELDS},
        )
        for p, c in lens
    ]
    cfg = PackConfig(
        budget=budget,
        rows=draw(st.integers(1, 3)),
        segment_align=seg_align,
        max_segments=draw(st.one_of(st.none(), st.integers(1, 4))),
        pad_position="balanced",
        pad_align=seg_align * draw(st.integers(1, max(1, (budget - 1) // seg_align))),
        context_ranks=cp,
        kernel_blocks=((bq, bk), (bk if (budget % (2 * cp * bk) == 0) else bq, bq)),
        dual_chunk_swap=draw(st.booleans()),
    )
    return rollouts, cfg


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(balanced_sets())
def test_balanced_keeps_invariants_is_deterministic_and_never_busier_than_pad_first(
    case: tuple[list[Rollout], PackConfig],
) -> None:
    rollouts, cfg = case
    balanced = pack_rollouts(rollouts, cfg)
    check_invariants(rollouts, cfg, balanced)
    again = pack_rollouts(rollouts, cfg)
    for b1, b2 in zip(balanced, again, strict=True):
        for name, a in b1.per_token_arrays().items():
            np.testing.assert_array_equal(a, b2.per_token_arrays()[name], err_msg=name)
    start_cfg = PackConfig(
        budget=cfg.budget,
        rows=cfg.rows,
        segment_align=cfg.segment_align,
        max_segments=cfg.max_segments,
        pad_position="start",
        pad_align=cfg.pad_align,
    )
    start = pack_rollouts(rollouts, start_cfg)
    assert len(start) == len(balanced)
    for bb, bs in zip(balanced, start, strict=True):
        assert sorted(bb.rollout_index[bb.rollout_index >= 0].tolist()) == sorted(
            bs.rollout_index[bs.rollout_index >= 0].tolist()
        ), "balanced moved a rollout to another micro-batch"
        tiles = [
            rank_tiles(*_spans(b), cfg.budget, cfg.kernel_blocks, cfg.context_ranks, cfg.dual_chunk_swap)
            .max(2)
            .sum(1)
            for b in (bb, bs)
        ]
        assert (tiles[0] <= tiles[1]).all(), "a balanced row has more busiest-rank tiles than pad-first"


def test_balanced_wins_on_a_hand_written_row() -> None:
    """Rollouts of 5, 2 and 2 tokens in 16 with cp 2, dual chunk swap and 2 x 2 blocks: pad-first's
    busiest rank computes 14 tiles, the balanced row (longest rollout last, padding at the end) 10."""
    rs = [Rollout([1], [2] * n) for n in (1, 4, 1)]
    common: dict[str, object] = {"budget": 16, "segment_align": 1, "pad_align": 4}
    (start,) = pack_rollouts(rs, PackConfig(**common, pad_position="start"))  # type: ignore[arg-type]
    (bal,) = pack_rollouts(
        rs,
        PackConfig(**common, pad_position="balanced", context_ranks=2, kernel_blocks=((2, 2),)),  # type: ignore[arg-type]
    )
    assert start.segment_ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 0, 0, 0]
    assert bal.segment_ids[0].tolist() == [1, 1, 2, 2, 3, 3, 3, 3, 3, 0, 0, 0, 0, 0, 0, 0]
    assert bal.rollout_index[0, :9].tolist() == [2, 2, 0, 0, 1, 1, 1, 1, 1]
    cost = [int(rank_tiles(*_spans(b), 16, ((2, 2),), 2).max()) for b in (start, bal)]
    assert cost == [14, 10]


def _hand_rollouts() -> list[Rollout]:
    return [
        Rollout([1, 2], [3, 4, 5], advantage=0.5, per_token={"old_logprobs": [-1.0, -2.0, -3.0]}),
        Rollout([6], [7, 8], advantage=-1.0, per_token={"old_logprobs": [-4.0, -5.0]}),
    ]


def test_hand_written_end_and_start_rows() -> None:
    # budget 20, segment_align 4: FFD puts the 5-token rollout first (0..4), the 3-token one at 8..10.
    end = pack_rollouts(_hand_rollouts(), PackConfig(budget=20, segment_align=4))[0]
    assert end.tokens[0].tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8] + [0] * 9
    assert end.segment_ids[0].tolist() == [1] * 5 + [0] * 3 + [2] * 3 + [0] * 9
    assert end.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 0, 0, 1, 2] + [0] * 9
    assert end.advantages[0, :11].tolist() == [0, 0, 0.5, 0.5, 0.5, 0, 0, 0, 0, -1, -1]
    assert end.fields["old_logprobs"][0, :11].tolist() == [0, 0, -1, -2, -3, 0, 0, 0, 0, -4, -5]
    assert end.rollout_slice(1, "old_logprobs").tolist() == [0, -4, -5]
    assert end.rollout_slice(0, "tokens").tolist() == [1, 2, 3, 4, 5]
    # 9 tokens of trailing padding: pad_align 8 moves the row by 8 (rounded down, not 9, not 12)
    start = pack_rollouts(
        _hand_rollouts(), PackConfig(budget=20, segment_align=4, pad_position="start", pad_align=8)
    )[0]
    assert start.tokens[0].tolist() == [0] * 8 + [1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 0]
    assert start.segment_ids[0].tolist() == [0] * 8 + [1] * 5 + [0] * 3 + [2] * 3 + [0]
    # pad_align 12 > 9 trailing: the row does not move
    same = pack_rollouts(
        _hand_rollouts(), PackConfig(budget=20, segment_align=4, pad_position="start", pad_align=12)
    )[0]
    np.testing.assert_array_equal(same.tokens, end.tokens)


def test_seed_002_row_shift() -> None:
    # The pad-first benchmark row: 60,948 tokens in 65,536 moves by 4,096 at the default pad_align.
    assert start_shift(60_948, 65_536, 4096) == 4096
    assert start_shift(0, 65_536, 4096) == 0
    assert start_shift(65_000, 65_536, 4096) == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"budget": 0}, "packing.tokenBudget: must be a positive integer, got 0"),
        ({"budget": 64, "rows": 0}, "PackConfig rows: must be a positive integer, got 0"),
        ({"budget": 64, "segment_align": 0}, "packing.segmentAlign"),
        ({"budget": 64, "pad_position": "middle"}, "packing.padPosition"),
        ({"budget": 64, "pad_position": "start", "pad_align": 12, "segment_align": 8}, "packing.padAlign"),
        ({"budget": 64, "pad_position": "start", "pad_align": 0}, "packing.padAlign"),
        ({"budget": 64, "pad_position": "start", "pad_align": 64}, "packing.padAlign"),
        ({"budget": 64, "pad_align": 128}, "packing.padAlign"),
        ({"budget": 64, "max_segments": 0}, "packing.maxSegmentsPerRow: must be a positive integer, got 0"),
        (
            {"budget": 64, "pad_position": "balanced", "pad_align": 64, "kernel_blocks": ((8, 8),)},
            "packing.padAlign",
        ),
        ({"budget": 64, "pad_position": "balanced", "pad_align": 8}, "packing.tokenBudget"),
        (
            {"budget": 64, "pad_position": "balanced", "pad_align": 8, "context_ranks": 0},
            "PackConfig context_ranks: must be a positive integer, got 0",
        ),
        (
            {"budget": 64, "pad_position": "balanced", "pad_align": 8, "kernel_blocks": ()},
            "PackConfig kernel_blocks: at least one (query, key) block pair is needed",
        ),
        (
            {"budget": 64, "pad_position": "balanced", "pad_align": 8, "kernel_blocks": ((0, 8),)},
            "PackConfig kernel_blocks: blocks must be positive integers, got (0, 8)",
        ),
        (
            {
                "budget": 96,
                "pad_position": "balanced",
                "pad_align": 8,
                "context_ranks": 2,
                "kernel_blocks": ((16, 32),),
            },
            "packing.tokenBudget",
        ),
    ],
)
def test_bad_settings_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(PackingError, match="^" + re.escape(field)):
        PackConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("rollouts", "message"),
    [
        ([Rollout([1] * 5, [2] * 4), Rollout([1] * 6, [2] * 5)], r"rollouts\[1\]: 11 tokens .* budget 10"),
        ([Rollout([1], [2, 3], completion_mask=[1.0])], r"rollouts\[0\]\.completionMask"),
        ([Rollout([1], [2], per_token={"a": [1.0]}), Rollout([1], [2])], r"rollouts\[1\]\.perToken"),
        ([Rollout([1], [2, 3], per_token={"a": [1.0]})], r"rollouts\[0\]\.perToken\.a"),
        ([Rollout([[1]], [2])], r"rollouts\[0\]\.promptIds"),
    ],
)
def test_bad_rollouts_raise_clear_errors(rollouts: list[Rollout], message: str) -> None:
    with pytest.raises(PackingError, match=message):
        pack_rollouts(rollouts, PackConfig(budget=10))


def test_no_rollouts_gives_one_empty_batch() -> None:
    (b,) = pack_rollouts([], PackConfig(budget=8, rows=2))
    assert b.shape == (2, 8) and (b.segment_ids == 0).all() and padding_fraction([b]) == 1.0


def test_rows_are_grouped_into_fixed_shape_micro_batches() -> None:
    rs = [Rollout([1] * 3, [2] * 4) for _ in range(5)]  # 7 tokens each, one per row of 8
    bs = pack_rollouts(rs, PackConfig(budget=8, rows=2))
    assert [b.shape for b in bs] == [(2, 8)] * 3
    assert [b.num_segments.tolist() for b in bs] == [[1, 1], [1, 1], [1, 0]]
    assert padding_fraction(bs) == pytest.approx(1 - 35 / 48)


def _broken_variants(b: PackedBatch) -> list[PackedBatch]:
    """Deliberately wrong packings the invariant checker must reject."""
    rolled = {k: v.copy() for k, v in b.fields.items()}
    k0 = next(iter(rolled))
    rolled[k0][0] = np.roll(rolled[k0][0], 1)  # one field not moved with its token
    abs_pos = b.positions.copy()
    abs_pos[b.segment_ids > 0] = np.flatnonzero((b.segment_ids > 0).reshape(-1)) % b.shape[1]
    adv = b.advantages.copy()
    adv[b.segment_ids == 0] = 1.0  # padding given a value
    return [
        PackedBatch(**{**b.__dict__, "fields": rolled}),
        PackedBatch(**{**b.__dict__, "positions": abs_pos}),
        PackedBatch(**{**b.__dict__, "advantages": adv}),
        PackedBatch(**{**b.__dict__, "segment_ids": np.where(b.segment_ids > 1, 1, b.segment_ids)}),
    ]


def test_invariant_checker_catches_broken_packings() -> None:
    rs = [*_hand_rollouts(), Rollout([9, 9], [9, 9, 9], per_token={"old_logprobs": [1.0, 2.0, 3.0]})]
    cfg = PackConfig(budget=20, segment_align=4)
    (b,) = pack_rollouts(rs, cfg)
    check_invariants(rs, cfg, [b])
    for n, broken in enumerate(_broken_variants(b)):
        with pytest.raises(AssertionError):
            check_invariants(rs, cfg, [broken])
            pytest.fail(f"broken variant {n} not caught")
