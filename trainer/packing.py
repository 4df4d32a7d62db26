"""Token-budget sequence packing into one compiled shape (host side, numpy).

Rollouts (prompt + completion, with per-token arrays over the completion) are packed first-fit
decreasing into rows of ``budget`` tokens; rows are grouped into micro-batches of ``rows`` rows, so
every micro-batch of a run has the same shape ``[rows, budget]`` and the train step compiles once.

Layout of a row (as tunix ``pack_bin`` lays it out): segments are written from position 0, each
segment after the first starts at a multiple of ``segment_align``; padding (including alignment
gaps) has segment id 0, position 0, token ``pad_id`` and every per-token value 0. Segment ids are
1-based per row, positions restart at 0 per segment. With ``pad_position="start"`` a row is laid out
exactly as with ``"end"`` and then rotated right by its trailing padding (counted from its last
token) rounded down to a multiple of ``pad_align`` (a positive multiple of ``segment_align``), so
segment starts keep their place relative to the attention kernel's tiles. A row with no tokens or
less trailing padding than ``pad_align`` does not move. Every per-token array moves with its token.

With ``pad_position="balanced"`` each row keeps its first-fit-decreasing rollouts, but where they go
is chosen to minimise the busiest context-parallel rank's attention tiles (:func:`rank_tiles`, the
tile model of bench/pad_first_tiles.py) for ``context_ranks`` ranks and the kernel blocks
``kernel_blocks``. Candidates per row: the pad-first layout above, the end layout, its reverse, and
``BALANCED_PERMUTATIONS`` orders drawn from a fixed seed (segments back to back from position 0,
starts aligned, padding at the end; the draws depend only on the row's index). A compiled loop
(numba, compiled once per process on first use) scores every candidate in O(blocks) and each row takes
the one with the fewest busiest-rank tiles summed over the kernels (the first in that order on a
tie), so the same input always gives the same layout and a row never has more tiles than pad-first
gives it. Segment ids stay 1..n in position order.

Per-token arrays of a :class:`PackedBatch` (all ``[rows, budget]``):
  tokens, segment_ids, positions (int32); prompt_mask, loss_mask, advantages (float32);
  rollout_index (int32, -1 on padding: which input rollout a token came from);
  fields[name] (float32) for every per-token field the rollouts carry (e.g. old_logprobs,
  ref_logprobs, loss_weight). Values are written on the completion span; prompt tokens carry 0.

Typical use::

    cfg = PackConfig(budget=20480, rows=8)
    batches = pack_rollouts(rollouts, cfg)      # list[PackedBatch], all [8, 20480]
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_PAD_ALIGN",
    "DEFAULT_SEGMENT_ALIGN",
    "PackConfig",
    "PackedBatch",
    "PackingError",
    "Rollout",
    "align_up",
    "balanced_starts",
    "first_fit_decreasing",
    "pack_rollouts",
    "padding_fraction",
    "rank_tiles",
    "start_shift",
]

DEFAULT_SEGMENT_ALIGN = 64
DEFAULT_PAD_ALIGN = 4096
# MaxText's default Splash blocks: (sa_block_q, sa_block_kv) and (sa_block_q_dkv, sa_block_kv_dkv).
DEFAULT_KERNEL_BLOCKS: tuple[tuple[int, int], ...] = ((512, 512), (512, 512))
# Orders drawn per row for pad_position "balanced", besides pad-first, end and reversed.
BALANCED_PERMUTATIONS = 32
_BALANCED_SEED = 20_480

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]
PadPosition = Literal["end", "start", "balanced"]


class PackingError(ValueError):
    """A packing setting or a rollout that cannot be packed; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One sampled sequence: prompt tokens, completion tokens and per-completion-token arrays.

    ``completion_mask`` (1 = trained on) defaults to all ones; ``advantage`` is broadcast to every
    completion token; ``per_token`` maps a field name to an array of the completion's length.
    """

    prompt_ids: npt.ArrayLike
    completion_ids: npt.ArrayLike
    advantage: float = 0.0
    completion_mask: npt.ArrayLike | None = None
    per_token: Mapping[str, npt.ArrayLike] = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(np.size(self.prompt_ids)) + int(np.size(self.completion_ids))


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """Packing settings. ``rows`` rows of ``budget`` tokens make one compiled micro-batch shape."""

    budget: int
    rows: int = 1
    segment_align: int = DEFAULT_SEGMENT_ALIGN
    pad_position: PadPosition = "end"
    pad_align: int = DEFAULT_PAD_ALIGN
    max_segments: int | None = None
    pad_id: int = 0
    context_ranks: int = 1
    kernel_blocks: tuple[tuple[int, int], ...] = DEFAULT_KERNEL_BLOCKS
    dual_chunk_swap: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget <= 0:
            raise PackingError(f"packing.tokenBudget: must be a positive integer, got {self.budget!r}")
        if not isinstance(self.rows, int) or self.rows <= 0:
            raise PackingError(f"PackConfig rows: must be a positive integer, got {self.rows!r}")
        if not isinstance(self.segment_align, int) or self.segment_align <= 0:
            raise PackingError(
                f"packing.segmentAlign: must be a positive integer, got {self.segment_align!r}"
            )
        if self.pad_position not in ("end", "start", "balanced"):
            raise PackingError(
                f"packing.padPosition: must be 'end', 'start' or 'balanced', got {self.pad_position!r}"
            )
        if self.max_segments is not None and (
            not isinstance(self.max_segments, int) or self.max_segments <= 0
        ):
            raise PackingError(
                f"packing.maxSegmentsPerRow: must be a positive integer, got {self.max_segments!r}"
            )
        if self.pad_position == "balanced":
            self._check_tile_model()
        if self.pad_position in ("start", "balanced"):
            if (
                not isinstance(self.pad_align, int)
                or self.pad_align <= 0
                or self.pad_align % self.segment_align
            ):
                raise PackingError(
                    f"packing.padAlign: with padPosition {self.pad_position!r} it must be a positive "
                    f"multiple of segmentAlign ({self.segment_align}), got {self.pad_align!r}"
                )
            if self.pad_align >= self.budget:
                raise PackingError(
                    f"packing.padAlign: {self.pad_align} is not below the row budget {self.budget}, "
                    f"so padPosition {self.pad_position!r} would never move a row"
                )
        elif self.pad_align != DEFAULT_PAD_ALIGN:
            raise PackingError(
                f"packing.padAlign: only read with padPosition 'start' or 'balanced'; got {self.pad_align!r} "
                "with 'end'"
            )

    def _check_tile_model(self) -> None:
        cp = self.context_ranks
        if not isinstance(cp, int) or cp <= 0:
            raise PackingError(f"PackConfig context_ranks: must be a positive integer, got {cp!r}")
        if not self.kernel_blocks:
            raise PackingError("PackConfig kernel_blocks: at least one (query, key) block pair is needed")
        for bq, bk in self.kernel_blocks:
            if not (isinstance(bq, int) and isinstance(bk, int) and bq > 0 and bk > 0):
                raise PackingError(
                    f"PackConfig kernel_blocks: blocks must be positive integers, got {(bq, bk)}"
                )
            if self.budget % (2 * cp * bq) or self.budget % bk:
                raise PackingError(
                    f"packing.tokenBudget: {self.budget} must be a multiple of 2 x {cp} context ranks x "
                    f"query block {bq} and of key block {bk} for padPosition 'balanced'"
                )

    @property
    def max_segments_per_row(self) -> int:
        """Static bound on real segments per row (segment ids run 1..this; 0 is padding)."""
        return self.max_segments if self.max_segments is not None else self.budget


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One micro-batch ``[rows, budget]``; see the module docstring for the arrays."""

    tokens: IntArray
    segment_ids: IntArray
    positions: IntArray
    prompt_mask: FloatArray
    loss_mask: FloatArray
    advantages: FloatArray
    rollout_index: IntArray
    fields: dict[str, FloatArray]
    num_segments: IntArray  # [rows] real segments per row

    def per_token_arrays(self) -> dict[str, np.ndarray]:
        """Every per-token array by name (fixed fields plus ``fields``)."""
        out: dict[str, np.ndarray] = {
            "tokens": self.tokens,
            "segment_ids": self.segment_ids,
            "positions": self.positions,
            "prompt_mask": self.prompt_mask,
            "loss_mask": self.loss_mask,
            "advantages": self.advantages,
            "rollout_index": self.rollout_index,
        }
        out.update(self.fields)
        return out

    @property
    def shape(self) -> tuple[int, int]:
        r, t = self.tokens.shape
        return int(r), int(t)

    def rollout_slice(self, index: int, name: str) -> np.ndarray:
        """The values of per-token array ``name`` on rollout ``index``'s tokens, in token order."""
        out: np.ndarray = self.per_token_arrays()[name][self.rollout_index == index]
        return out


def align_up(offset: int, multiple: int) -> int:
    """``offset`` rounded up to a multiple of ``multiple`` (> 0)."""
    if multiple <= 0:
        raise PackingError(f"align multiple must be positive, got {multiple}")
    return -(-offset // multiple) * multiple


def start_shift(last_end: int, budget: int, pad_align: int) -> int:
    """Right shift of a row under pad_position 'start': trailing padding rounded down to pad_align."""
    if last_end <= 0:
        return 0
    return ((budget - last_end) // pad_align) * pad_align


def first_fit_decreasing(
    lengths: Sequence[int], budget: int, segment_align: int, max_segments: int | None = None
) -> list[list[int]]:
    """Bins of item indices, first-fit decreasing with aligned segment starts.

    Items are taken longest first (stable); each goes to the first bin where it fits after the
    bin's load is aligned up to ``segment_align``. Empty items (length 0) are not placed.
    """
    for i, n in enumerate(lengths):
        if n > budget:
            raise PackingError(
                f"rollouts[{i}]: {n} tokens (prompt + completion) exceed the row budget {budget}"
            )
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    loads: list[int] = []
    cap = max_segments if max_segments is not None else budget
    for i in order:
        n = lengths[i]
        if n == 0:
            continue
        for b, load in enumerate(loads):
            if len(bins[b]) < cap and align_up(load, segment_align) + n <= budget:
                bins[b].append(i)
                loads[b] = align_up(load, segment_align) + n
                break
        else:
            bins.append([i])
            loads.append(n)
    return bins


def rank_tiles(
    starts: npt.ArrayLike,
    ends: npt.ArrayLike,
    budget: int,
    kernel_blocks: Sequence[tuple[int, int]],
    context_ranks: int = 1,
    dual_chunk_swap: bool = True,
) -> np.ndarray:
    """Attention tiles per context rank ``[N, len(kernel_blocks), context_ranks]`` of N rows.

    ``starts``/``ends`` are ``[N, k]``: segment j of row n covers positions [start, end) and has id
    j + 1; segments are in position order and do not overlap; empty spans (end == start) are ignored.
    Tile model (Splash with segment ids, as bench/pad_first_tiles.py counts it): a [query block, key
    block] tile is computed unless it lies wholly above the causal diagonal or the query block's
    segment-id range [min, max] misses the key block's (padding has id 0). The row is cut in
    2 x ``context_ranks`` chunks; rank r holds chunks r and 2cp-1-r (dual chunk swap) or chunks 2r and
    2r+1 (contiguous), with every key.

    Because ids grow along the row, a query block fully inside segments counts the causal key blocks
    from the one holding its first segment's start; one with padding and tokens counts every causal key
    block; one of padding only counts the causal key blocks that hold padding. So a row costs
    O(blocks), all rows in one vectorized pass.
    """
    s_rows = np.asarray(starts, np.int64)
    e_rows = np.asarray(ends, np.int64)
    n = s_rows.shape[0]
    cp = context_ranks
    unit = int(np.gcd.reduce([b for pair in kernel_blocks for b in pair]))
    off = (np.arange(n, dtype=np.int64) * budget)[:, None]
    keep = (e_rows > s_rows).ravel()
    s_flat = (s_rows + off).ravel()[keep]
    lens = (e_rows - s_rows).ravel()[keep]
    s1 = np.concatenate([[-1], s_flat])
    l1 = np.concatenate([[0], lens])
    before = np.concatenate([[0, 0], np.cumsum(lens)[:-1]])  # tokens of the segments before each
    # tokens before each multiple of ``unit`` and the start of the span (or gap) holding it
    grid = off + np.arange(budget // unit + 1, dtype=np.int64)[None, :] * unit
    j = np.searchsorted(s_flat, grid, "right")  # 1-based: the last segment starting at or before
    cum = before[j] + np.clip(grid - s1[j], 0, l1[j])
    cov_unit = np.diff(cum, axis=1)
    seg_unit = s1[j[:, :-1]] - off
    out = np.zeros((n, len(kernel_blocks), cp), np.int64)
    for i, (bq, bk) in enumerate(kernel_blocks):
        q_cov = cov_unit.reshape(n, -1, bq // unit).sum(2)
        q_seg = seg_unit[:, :: bq // unit]
        k_cov = cov_unit.reshape(n, -1, bk // unit).sum(2)
        nq = budget // bq
        last_k = ((np.arange(nq) + 1) * bq - 1) // bk  # last causal key block of each query block
        k_pad = np.cumsum(k_cov < bk, axis=1)
        count = np.where(
            q_cov == bq,
            last_k[None, :] - q_seg // bk + 1,
            np.where(q_cov == 0, k_pad[:, last_k], last_k[None, :] + 1),
        )
        chunks = count.reshape(n, 2 * cp, -1).sum(2)
        if dual_chunk_swap:
            out[:, i] = chunks[:, :cp] + chunks[:, ::-1][:, :cp]
        else:
            out[:, i] = chunks.reshape(n, cp, 2).sum(2)
    return out


_SEARCH: Any = None


def _search_kernel() -> Any:
    """The compiled per-row search (numba, compiled on first use; maxtext and tunix depend on numba)."""
    global _SEARCH
    if _SEARCH is not None:
        return _SEARCH
    import numba

    @numba.njit(cache=False, nogil=True)
    def busiest(starts, ends, k, budget, unit, blocks, cp, dcs, cov, seg, chunks):  # type: ignore[no-untyped-def]
        """Sum over kernels of the busiest rank's tiles; same model as rank_tiles, one row."""
        g_n = budget // unit
        for g in range(g_n):
            cov[g] = 0
            seg[g] = -1
        for j in range(k):
            s, e = starts[j], ends[j]
            if e <= s:
                continue
            for g in range(s // unit, (e - 1) // unit + 1):
                lo = max(s, g * unit)
                hi = min(e, (g + 1) * unit)
                cov[g] += hi - lo
                if lo == g * unit:
                    seg[g] = s
        total = 0
        for b in range(blocks.shape[0]):
            bq, bk = blocks[b, 0], blocks[b, 1]
            uq, uk = bq // unit, bk // unit
            nq = budget // bq
            per_chunk = nq // (2 * cp)
            for c in range(2 * cp):
                chunks[c] = 0
            k_pad = 0
            k_seen = 0  # key blocks counted into k_pad
            for i in range(nq):
                last_k = ((i + 1) * bq - 1) // bk
                while k_seen <= last_k:
                    kc = 0
                    for g in range(k_seen * uk, (k_seen + 1) * uk):
                        kc += cov[g]
                    if kc < bk:
                        k_pad += 1
                    k_seen += 1
                qc = 0
                for g in range(i * uq, (i + 1) * uq):
                    qc += cov[g]
                if qc == bq:
                    n = last_k - seg[i * uq] // bk + 1
                elif qc == 0:
                    n = k_pad
                else:
                    n = last_k + 1
                chunks[i // per_chunk] += n
            worst = 0
            for r in range(cp):
                t = chunks[r] + chunks[2 * cp - 1 - r] if dcs else chunks[2 * r] + chunks[2 * r + 1]
                worst = max(worst, t)
            total += worst
        return total

    @numba.njit(cache=False, nogil=True)
    def search(  # type: ignore[no-untyped-def]
        lens, row_ptr, budget, align, pad_align, n_perm, seed, unit, blocks, cp, dcs, out_order, out_start
    ):
        n_rows = row_ptr.shape[0] - 1
        k_max = 1
        for r in range(n_rows):
            k_max = max(k_max, row_ptr[r + 1] - row_ptr[r])
        order = np.empty(k_max, np.int64)
        starts = np.empty(k_max, np.int64)
        ends = np.empty(k_max, np.int64)
        cov = np.empty(budget // unit, np.int64)
        seg = np.empty(budget // unit, np.int64)
        chunks = np.empty(2 * cp, np.int64)
        for r in range(n_rows):
            p0, k = row_ptr[r], row_ptr[r + 1] - row_ptr[r]
            if k == 0:
                continue
            state = np.uint64(seed) ^ (np.uint64(r + 1) * np.uint64(0x9E3779B97F4A7C15))
            best = -1
            for c in range(3 + n_perm):
                for j in range(k):
                    order[j] = k - 1 - j if c == 2 else j
                if c >= 3:  # Fisher-Yates with xorshift64*: the same draws for the same row and seed
                    for j in range(k - 1, 0, -1):
                        state ^= state >> np.uint64(12)
                        state ^= state << np.uint64(25)
                        state ^= state >> np.uint64(27)
                        x = (state * np.uint64(0x2545F4914F6CDD1D)) >> np.uint64(33)
                        m = np.int64(x % np.uint64(j + 1))
                        order[j], order[m] = order[m], order[j]
                cursor = 0
                for j in range(k):
                    n = lens[p0 + order[j]]
                    cursor = -(-cursor // align) * align
                    starts[j] = cursor
                    cursor += n
                    ends[j] = cursor
                if cursor > budget:
                    continue
                if c == 0:  # pad-first: trailing padding rounded down to pad_align moved to the front
                    shift = ((budget - cursor) // pad_align) * pad_align
                    for j in range(k):
                        starts[j] += shift
                        ends[j] += shift
                cost = busiest(starts, ends, k, budget, unit, blocks, cp, dcs, cov, seg, chunks)
                if best < 0 or cost < best:
                    best = cost
                    for j in range(k):
                        out_order[p0 + j] = order[j]
                        out_start[p0 + j] = starts[j]

    _SEARCH = search
    return search


def balanced_starts(rows: Sequence[Sequence[int]], cfg: PackConfig) -> list[list[tuple[int, int]]]:
    """Per row, ``(item, start)`` pairs in position order for pad_position "balanced".

    ``rows`` holds each row's item lengths in first-fit-decreasing order; the result refers to items by
    their index in that row. See the module docstring for the candidates and the choice.
    """
    counts = np.asarray([len(r) for r in rows], np.int64)
    row_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    lens = np.asarray([n for r in rows for n in r], np.int64)
    out_order = np.zeros(lens.size, np.int64)
    out_start = np.zeros(lens.size, np.int64)
    blocks = np.asarray(cfg.kernel_blocks, np.int64).reshape(-1, 2)
    unit = int(np.gcd.reduce(blocks.ravel()))
    _search_kernel()(
        lens,
        row_ptr,
        cfg.budget,
        cfg.segment_align,
        cfg.pad_align,
        BALANCED_PERMUTATIONS,
        _BALANCED_SEED,
        unit,
        blocks,
        cfg.context_ranks,
        cfg.dual_chunk_swap,
        out_order,
        out_start,
    )
    return [
        list(zip(out_order[a:b].tolist(), out_start[a:b].tolist(), strict=True))
        for a, b in itertools.pairwise(row_ptr.tolist())
    ]


def _as_1d(x: npt.ArrayLike, name: str, dtype: type) -> np.ndarray:
    a: np.ndarray = np.asarray(x, dtype=dtype)
    if a.ndim != 1:
        raise PackingError(f"{name}: must be one-dimensional, got shape {a.shape}")
    return a


def _validated(rollouts: Sequence[Rollout]) -> tuple[list[tuple[np.ndarray, ...]], list[str]]:
    names: list[str] | None = None
    out: list[tuple[np.ndarray, ...]] = []
    for i, r in enumerate(rollouts):
        p = _as_1d(r.prompt_ids, f"rollouts[{i}].promptIds", np.int32)
        c = _as_1d(r.completion_ids, f"rollouts[{i}].completionIds", np.int32)
        m = (
            np.ones(c.shape, np.float32)
            if r.completion_mask is None
            else _as_1d(r.completion_mask, f"rollouts[{i}].completionMask", np.float32)
        )
        if m.shape != c.shape:
            raise PackingError(f"rollouts[{i}].completionMask: length {m.size}, completion has {c.size}")
        keys = sorted(r.per_token)
        if names is None:
            names = keys
        elif keys != names:
            raise PackingError(f"rollouts[{i}].perToken: fields {keys} differ from rollouts[0]'s {names}")
        vals = []
        for k in keys:
            v = _as_1d(r.per_token[k], f"rollouts[{i}].perToken.{k}", np.float32)
            if v.shape != c.shape:
                raise PackingError(f"rollouts[{i}].perToken.{k}: length {v.size}, completion has {c.size}")
            vals.append(v)
        out.append((p, c, m, *vals))
    return out, names or []


def pack_rollouts(rollouts: Sequence[Rollout], cfg: PackConfig) -> list[PackedBatch]:
    """Pack ``rollouts`` into micro-batches of shape ``[cfg.rows, cfg.budget]``.

    Rows are filled first-fit decreasing and laid out as ``cfg.pad_position`` says; the rows are then
    grouped ``cfg.rows`` at a time in bin order, the last micro-batch completed with empty rows.
    Raises :class:`PackingError` naming the rollout when one exceeds the budget or is malformed.
    """
    data, names = _validated(rollouts)
    lengths = [int(d[0].size + d[1].size) for d in data]
    bins = first_fit_decreasing(lengths, cfg.budget, cfg.segment_align, cfg.max_segments)
    n_batches = max(1, -(-len(bins) // cfg.rows))
    bins += [[] for _ in range(n_batches * cfg.rows - len(bins))]
    shape = (n_batches * cfg.rows, cfg.budget)
    tokens = np.full(shape, cfg.pad_id, np.int32)
    seg = np.zeros(shape, np.int32)
    pos = np.zeros(shape, np.int32)
    pmask = np.zeros(shape, np.float32)
    lmask = np.zeros(shape, np.float32)
    adv = np.zeros(shape, np.float32)
    ridx = np.full(shape, -1, np.int32)
    fields = {k: np.zeros(shape, np.float32) for k in names}
    nseg = np.zeros(shape[0], np.int32)
    if cfg.pad_position == "balanced":
        chosen = balanced_starts([[lengths[i] for i in items] for items in bins], cfg)
        placed = [[(items[j], st) for j, st in row] for items, row in zip(bins, chosen, strict=True)]
    else:
        placed = []
        for items in bins:
            cursor, spans = 0, []
            for s, i in enumerate(items, start=1):
                start = align_up(cursor, cfg.segment_align) if s > 1 else 0
                spans.append((i, start))
                cursor = start + lengths[i]
            if cfg.pad_position == "start":
                shift = start_shift(cursor, cfg.budget, cfg.pad_align)
                spans = [(i, st + shift) for i, st in spans]
            placed.append(spans)
    for row, spans in enumerate(placed):
        for s, (i, start) in enumerate(spans, start=1):
            p, c, m, *vals = data[i]
            mid, end = start + p.size, start + p.size + c.size
            if end > cfg.budget:  # unreachable after first_fit_decreasing; kept as a guard
                raise PackingError(f"rollouts[{i}]: does not fit row {row}")
            tokens[row, start:mid] = p
            tokens[row, mid:end] = c
            seg[row, start:end] = s
            pos[row, start:end] = np.arange(end - start, dtype=np.int32)
            pmask[row, start:mid] = 1.0
            lmask[row, mid:end] = m
            adv[row, mid:end] = np.float32(rollouts[i].advantage)
            ridx[row, start:end] = i
            for k, v in zip(names, vals, strict=True):
                fields[k][row, mid:end] = v
        nseg[row] = len(spans)
    out = []
    for b in range(n_batches):
        sl = slice(b * cfg.rows, (b + 1) * cfg.rows)
        out.append(
            PackedBatch(
                tokens=tokens[sl],
                segment_ids=seg[sl],
                positions=pos[sl],
                prompt_mask=pmask[sl],
                loss_mask=lmask[sl],
                advantages=adv[sl],
                rollout_index=ridx[sl],
                fields={k: v[sl] for k, v in fields.items()},
                num_segments=nseg[sl],
            )
        )
    return out


def padding_fraction(batches: Sequence[PackedBatch]) -> float:
    """Share of token slots that hold padding, over all micro-batches."""
    total = sum(b.tokens.size for b in batches)
    real = sum(int((b.segment_ids > 0).sum()) for b in batches)
    return 1.0 - real / total if total else 0.0
