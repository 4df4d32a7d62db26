"""Token-budget sequence packing into one compiled shape (host side, numpy).

Rollouts (prompt + completion, with per-token arrays over the completion) are packed first-fit
decreasing into rows of ``budget`` tokens; rows are grouped into micro-batches of ``rows`` rows, so
every micro-batch of a run has the same shape ``[rows, budget]`` and the train step compiles once.

Layout of a row (seed 002 and tunix ``pack_bin``): segments are written from position 0, each
segment after the first starts at a multiple of ``segment_align``; padding (including alignment
gaps) has segment id 0, position 0, token ``pad_id`` and every per-token value 0. Segment ids are
1-based per row, positions restart at 0 per segment. With ``pad_position="start"`` a row is laid out
exactly as with ``"end"`` and then rotated right by its trailing padding (counted from its last
token) rounded down to a multiple of ``pad_align`` (a positive multiple of ``segment_align``), so
segment starts keep their place relative to the attention kernel's tiles. A row with no tokens or
less trailing padding than ``pad_align`` does not move. Every per-token array moves with its token.

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
from collections.abc import Mapping, Sequence
from typing import Literal

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
    "first_fit_decreasing",
    "pack_rollouts",
    "padding_fraction",
    "start_shift",
]

DEFAULT_SEGMENT_ALIGN = 64
DEFAULT_PAD_ALIGN = 4096

IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]
PadPosition = Literal["end", "start"]


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

    def __post_init__(self) -> None:
        if not isinstance(self.budget, int) or self.budget <= 0:
            raise PackingError(f"packing.budget: must be a positive integer, got {self.budget!r}")
        if not isinstance(self.rows, int) or self.rows <= 0:
            raise PackingError(f"packing.rows: must be a positive integer, got {self.rows!r}")
        if not isinstance(self.segment_align, int) or self.segment_align <= 0:
            raise PackingError(
                f"packing.segmentAlign: must be a positive integer, got {self.segment_align!r}"
            )
        if self.pad_position not in ("end", "start"):
            raise PackingError(f"packing.padPosition: must be 'end' or 'start', got {self.pad_position!r}")
        if self.max_segments is not None and (
            not isinstance(self.max_segments, int) or self.max_segments <= 0
        ):
            raise PackingError(f"packing.maxSegments: must be a positive integer, got {self.max_segments!r}")
        if self.pad_position == "start":
            if (
                not isinstance(self.pad_align, int)
                or self.pad_align <= 0
                or self.pad_align % self.segment_align
            ):
                raise PackingError(
                    f"packing.padAlign: with padPosition 'start' it must be a positive multiple of "
                    f"segmentAlign ({self.segment_align}), got {self.pad_align!r}"
                )
            if self.pad_align >= self.budget:
                raise PackingError(
                    f"packing.padAlign: {self.pad_align} is not below the row budget {self.budget}, "
                    "so padPosition 'start' would never move a row"
                )
        elif self.pad_align != DEFAULT_PAD_ALIGN:
            raise PackingError(
                f"packing.padAlign: only read with padPosition 'start'; got {self.pad_align!r} with 'end'"
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

    Rows are filled first-fit decreasing; the rows are then grouped ``cfg.rows`` at a time in bin
    order, the last micro-batch completed with empty rows. Raises :class:`PackingError` naming the
    rollout when one exceeds the budget or is malformed.
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
    for row, items in enumerate(bins):
        cursor = 0
        for s, i in enumerate(items, start=1):
            p, c, m, *vals = data[i]
            start = align_up(cursor, cfg.segment_align) if s > 1 else 0
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
            cursor = end
        nseg[row] = len(items)
        if cfg.pad_position == "start":
            shift = start_shift(cursor, cfg.budget, cfg.pad_align)
            if shift:
                for a in (tokens, seg, pos, pmask, lmask, adv, ridx, *fields.values()):
                    a[row] = np.roll(a[row], shift)
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
