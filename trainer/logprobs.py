"""Fused log-prob head: per-token log p(target) = z[target] - logsumexp(z), z = f(hidden @ w).

``f`` is the model's logit transform (:class:`LogitTransform`), exactly as MaxText applies it after the
output projection (``NNXDecoder.apply_output_head``): ``z = raw / divisor`` (``normalize_embedding_logits``
of tied embedding logits divides by sqrt(emb_dim)), then ``z = tanh(z / cap) * cap``
(``final_logits_soft_cap``), then ``z / temperature`` (the sampler's temperature, last, as vLLM applies it).

Never materializes a log-softmax, nor the [T, V] logits. The head is a ``jax.custom_vjp`` over token
tiles AND vocabulary chunks: the forward runs an online logsumexp (running max, rescaled exp-sum, one-hot
select-sum of the target logit) over vocabulary chunks, so only one ``[token_tile, vocab_chunk]`` block
of logits is alive at a time; its residuals are the inputs themselves (hidden, w, targets, mask) plus the
per-token logsumexp (4 bytes a token). The backward recomputes one block at a time:
``dz = g * (onehot - exp(z - lse)) * f'(raw)``, then ``dh += dz @ w_chunk.T`` and
``dw[:, chunk] += h.T @ dz``.

Tiles and chunks that do not divide T or V are handled without padding copies: the last tile/chunk
is slid back to end at T/V (a clamped ``dynamic_slice``) and the rows/columns already covered are
masked. Masked rows (``mask`` False) give log-prob 0 and zero gradient; their hidden states are
replaced by 0 inside each tile, so non-finite values there never reach a result or a gradient.
Targets must lie in ``[0, V)`` on unmasked rows (not checked inside jit).

On a mesh (:func:`sharded_token_logprobs`) no device holds the whole ``[H, V]`` head and no device
scores another's tokens: the tokens are split over the axes that split the batch (rows and sequence:
the *ring* axes), the head's vocabulary columns over every axis (``vocab_axes`` major, the ring axes
minor), so each device owns one ``[H, V / devices]`` block. Within a vocabulary group the blocks travel
around the ring axes (``ppermute``, one block in flight): every device scores its own tokens against each
block in turn, merging the online logsumexp; the vocabulary groups then combine ``[tokens]``-sized
partial results (pmax/psum). The backward makes the same trip (the w gradient block travelling with its
w block, home after a full turn). Communication per call: each device receives ``(ring - 1)/ring`` of its
group's columns, what an all-gather would move, but never more than two blocks are alive at once. The
custom VJP wraps the ``shard_map`` calls (the forward and the backward are each an explicit
``shard_map``), so no collective is ever differentiated by JAX.

Public API:
  LogitTransform(divisor, soft_cap, temperature): the elementwise map from raw logits to the model's
  token_logprobs(hidden[T,H], w[H,V], targets[T], mask[T]|None, *, token_tile, vocab_chunk,
                 temperature, soft_cap, divisor, grad_w) -> [T] float32
  next_token_logprobs(hidden[B,T,H], w, tokens[B,T], segment_ids[B,T], ...) -> [B,T] float32
      log-prob of tokens[b, i] given the segment's prefix, aligned with the token (0 on a segment's
      first token and on padding) -- the layout of trainer.packing.
  sharded_token_logprobs(mesh, token_spec, vocab_axes, vocab_size, ...) -> the head on a mesh (above).
  naive_token_logprobs(...): log_softmax(f(hidden @ w)) then take -- the reference for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

__all__ = [
    "DEFAULT_TOKEN_TILE",
    "DEFAULT_VOCAB_CHUNK",
    "LogitTransform",
    "head_spec",
    "naive_token_logprobs",
    "next_token_logprobs",
    "next_token_targets",
    "padded_vocab",
    "sharded_token_logprobs",
    "shift_to_tokens",
    "token_logprobs",
]

_F32 = jnp.float32
# Token tile and vocabulary chunk of the fused head when the spec does not set them
# (spec.trainer.logprobs; bench/logprob_head_memory.py measured vocabulary chunks of 8192 best).
DEFAULT_TOKEN_TILE = 2048
DEFAULT_VOCAB_CHUNK = 8192

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """The elementwise map from raw logits ``hidden @ w`` to the logits the model samples from, in
    MaxText's order: ``raw / divisor``, then ``tanh(z / soft_cap) * soft_cap`` when ``soft_cap`` > 0,
    then ``z / temperature``. The identity by default."""

    divisor: float = 1.0
    soft_cap: float = 0.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.divisor > 0 or self.soft_cap < 0 or not self.temperature > 0:
            raise ValueError(
                f"logit transform: divisor {self.divisor} and temperature {self.temperature} must be > 0, "
                f"soft_cap {self.soft_cap} >= 0"
            )

    def __call__(self, raw: jax.Array) -> jax.Array:
        z = raw if self.divisor == 1.0 else raw / self.divisor
        if self.soft_cap:
            z = jnp.tanh(z / self.soft_cap) * self.soft_cap
        return z if self.temperature == 1.0 else z / self.temperature

    def grad(self, raw: jax.Array) -> jax.Array | None:
        """dz/draw elementwise, or None where it is the constant ``1 / (divisor * temperature)``."""
        if not self.soft_cap:
            return None
        u = jnp.tanh((raw if self.divisor == 1.0 else raw / self.divisor) / self.soft_cap)
        return (1.0 - u * u) / (self.divisor * self.temperature)

    @property
    def slope(self) -> float:
        return 1.0 / (self.divisor * self.temperature)


def _tile_start(i: jax.Array, tile: int, n: int) -> jax.Array:
    """Start of tile i, clamped so the tile ends at n at most (the last tile slides back)."""
    return jnp.minimum(i * tile, n - tile)


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static shape of one device's share: tile and chunk sizes, the true vocabulary, and the mesh axes
    (empty on one device)."""

    tile: int
    chunk: int
    vocab_size: int
    tf: LogitTransform
    ring_axes: Axes = ()
    ring: int = 1
    vocab_axes: Axes = ()
    # ppermute takes its axes in the mesh's order (another order is refused: JAX would pair the wrong
    # devices); the ring's one-step shift, renumbered in that order (see _ring_shift).
    mesh_ring_axes: Axes = ()
    mesh_ring_perm: tuple[tuple[int, int], ...] = ()

    def block_id(self, step: jax.Array | int) -> jax.Array:
        """Global id of the w block a device holds after ``step`` ring shifts (own block at step 0)."""
        b = lax.axis_index(self.ring_axes) if self.ring_axes else 0
        a = lax.axis_index(self.vocab_axes) if self.vocab_axes else 0
        return jnp.asarray(a * self.ring + (b - step) % self.ring, jnp.int32)

    def shift(self, x: jax.Array) -> jax.Array:
        """Pass a block one step around the ring (device i receives device i-1's)."""
        if self.mesh_ring_perm:
            out: jax.Array = lax.ppermute(x, self.mesh_ring_axes, list(self.mesh_ring_perm))  # type: ignore[no-untyped-call]
            return out
        perm = [(i, (i + 1) % self.ring) for i in range(self.ring)]
        out = lax.ppermute(x, self.ring_axes, perm)  # type: ignore[no-untyped-call]
        return out


def _ring_shift(
    mesh_axes: Sequence[str], ring_axes: Axes, sizes: dict[str, int]
) -> tuple[Axes, tuple[tuple[int, int], ...]]:
    """The ring's shift (ring position i to i + 1, positions numbered over ``ring_axes`` in their order,
    as lax.axis_index numbers them) as a permutation over the same axes in the mesh's order; () when the
    orders agree."""
    order = tuple(a for a in mesh_axes if a in ring_axes)
    if order == ring_axes:
        return order, ()
    n = 1
    for a in ring_axes:
        n *= sizes[a]

    def coords(i: int) -> dict[str, int]:
        out = {}
        for a in reversed(ring_axes):
            out[a] = i % sizes[a]
            i //= sizes[a]
        return out

    def index(c: dict[str, int]) -> int:
        i = 0
        for a in order:
            i = i * sizes[a] + c[a]
        return i

    return order, tuple((index(coords(i)), index(coords((i + 1) % n))) for i in range(n))


def _chunk_raw(
    h: jax.Array, w: jax.Array, j: jax.Array, geo: _Geometry, block: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Raw logits of one [tile, chunk] block of w's columns, the chunk's start, its global column ids,
    and which columns count (new in this chunk, inside the true vocabulary)."""
    vl = w.shape[1]
    c0 = _tile_start(j, geo.chunk, vl)
    wc = lax.dynamic_slice_in_dim(w, c0, geo.chunk, axis=1)
    raw = jnp.dot(h, wc, preferred_element_type=_F32)
    local = c0 + jnp.arange(geo.chunk)
    col = block * vl + local
    return raw, c0, col, (local >= j * geo.chunk) & (col < geo.vocab_size)


def _tile_inputs(
    hidden: jax.Array, targets: jax.Array, mask: jax.Array, i: jax.Array, tile: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    t = hidden.shape[0]
    s = _tile_start(i, tile, t)
    rows_new = (s + jnp.arange(tile)) >= i * tile
    m = lax.dynamic_slice_in_dim(mask, s, tile) & rows_new
    h = lax.dynamic_slice_in_dim(hidden, s, tile, axis=0)
    h = jnp.where(m[:, None], h, jnp.zeros((), h.dtype))
    tg = lax.dynamic_slice_in_dim(targets, s, tile)
    return s, h, tg, m


Stats = tuple[jax.Array, jax.Array, jax.Array]  # running max, exp-sum relative to it, target logit


def _sweep_forward(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    block: jax.Array,
    stats: Stats,
    geo: _Geometry,
) -> Stats:
    """Merge the logits of one w block into every token's online logsumexp (tiles x chunks)."""
    t = hidden.shape[0]
    n_tiles, n_chunks = -(-t // geo.tile), -(-w.shape[1] // geo.chunk)

    def tile_body(i: jax.Array, acc: Stats) -> Stats:
        s, h, tg, _ = _tile_inputs(hidden, targets, mask, i, geo.tile)
        here = tuple(lax.dynamic_slice_in_dim(x, s, geo.tile) for x in acc)

        def chunk_body(j: jax.Array, c: Stats) -> Stats:
            mx, se, tl = c
            raw, _, col, ok = _chunk_raw(h, w, j, geo, block)
            z = jnp.where(ok[None, :], geo.tf(raw), -jnp.inf)
            mx2 = jnp.maximum(mx, z.max(axis=1))
            ref = jnp.where(jnp.isfinite(mx2), mx2, 0.0)  # a row with no column yet: nothing to rescale
            se = se * jnp.exp(mx - ref) + jnp.exp(z - ref[:, None]).sum(axis=1)
            hit = (col[None, :] == tg[:, None]) & ok[None, :]
            tl = tl + jnp.where(hit, z, 0.0).sum(axis=1)
            return mx2, se, tl

        new = lax.fori_loop(0, n_chunks, chunk_body, here)
        keep = (s + jnp.arange(geo.tile)) >= i * geo.tile  # rows of a slid-back tile already merged
        return tuple(  # type: ignore[return-value]
            lax.dynamic_update_slice_in_dim(a, jnp.where(keep, n, o), s, 0)
            for a, n, o in zip(acc, new, here, strict=True)
        )

    out: Stats = lax.fori_loop(0, n_tiles, tile_body, stats)
    return out


def _local_forward(
    hidden: jax.Array, w: jax.Array, targets: jax.Array, mask: jax.Array, geo: _Geometry
) -> tuple[jax.Array, jax.Array]:
    """(log-probs [t], logsumexp [t]) of one device's tokens over the whole vocabulary."""
    t = hidden.shape[0]
    stats: Stats = (jnp.full((t,), -jnp.inf, _F32), jnp.zeros((t,), _F32), jnp.zeros((t,), _F32))
    if geo.ring > 1:

        def ring_body(step: jax.Array, carry: tuple[jax.Array, Stats]) -> tuple[jax.Array, Stats]:
            blk, st = carry
            st = _sweep_forward(hidden, blk, targets, mask, geo.block_id(step), st, geo)
            return geo.shift(blk), st

        w, stats = lax.fori_loop(0, geo.ring - 1, ring_body, (w, stats))
    mx, se, tl = _sweep_forward(hidden, w, targets, mask, geo.block_id(geo.ring - 1), stats, geo)
    if geo.vocab_axes:  # combine the vocabulary groups: [t]-sized collectives only
        gmx = lax.pmax(mx, geo.vocab_axes)  # type: ignore[no-untyped-call]
        se = lax.psum(se * jnp.exp(mx - gmx), geo.vocab_axes)  # type: ignore[no-untyped-call]
        tl = lax.psum(tl, geo.vocab_axes)  # type: ignore[no-untyped-call]
        mx = gmx
    log_se = jnp.log(se)
    # (target - max) - log(sum): the association log_softmax uses, so float32 results agree.
    lp = jnp.where(mask, (tl - mx) - log_se, 0.0)
    return lp, mx + log_se


def _sweep_backward(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    lse: jax.Array,
    g: jax.Array,
    block: jax.Array,
    dh_all: jax.Array,
    dw: jax.Array | None,
    geo: _Geometry,
) -> tuple[jax.Array, jax.Array | None]:
    """Add one w block's share of dh (all tokens) and of that block's dw."""
    t = hidden.shape[0]
    n_tiles, n_chunks = -(-t // geo.tile), -(-w.shape[1] // geo.chunk)
    slope = geo.tf.slope
    # The gradient matmuls run in the dtype the forward's promotes to: bfloat16 for a bfloat16 model,
    # float32 when either side is float32 (a float32 model's tied table, which MaxText reads in bfloat16).
    mm = jnp.result_type(hidden.dtype, w.dtype)

    def tile_body(
        i: jax.Array, acc: tuple[jax.Array, jax.Array | None]
    ) -> tuple[jax.Array, jax.Array | None]:
        dh_all, dw = acc
        s, h, tg, m = _tile_inputs(hidden, targets, mask, i, geo.tile)
        gm = jnp.where(m, lax.dynamic_slice_in_dim(g, s, geo.tile), 0.0)  # 0 on rows of an earlier tile
        ls = lax.dynamic_slice_in_dim(lse, s, geo.tile)

        def chunk_body(
            j: jax.Array, c: tuple[jax.Array, jax.Array | None]
        ) -> tuple[jax.Array, jax.Array | None]:
            dh, dw = c
            raw, c0, col, ok = _chunk_raw(h, w, j, geo, block)
            p = jnp.where(ok[None, :], jnp.exp(geo.tf(raw) - ls[:, None]), 0.0)
            hit = (col[None, :] == tg[:, None]) & ok[None, :]
            dz = gm[:, None] * (hit.astype(_F32) - p)
            d = geo.tf.grad(raw)
            draw = dz * d if d is not None else (dz if slope == 1.0 else dz * slope)
            wc = lax.dynamic_slice_in_dim(w, c0, geo.chunk, axis=1)
            dh = dh + jnp.dot(draw.astype(mm), wc.T, preferred_element_type=_F32)
            if dw is not None:
                upd = jnp.dot(h.T, draw.astype(mm), preferred_element_type=_F32)
                dw = lax.dynamic_update_slice_in_dim(
                    dw, lax.dynamic_slice_in_dim(dw, c0, geo.chunk, axis=1) + upd, c0, 1
                )
            return dh, dw

        dh, dw = lax.fori_loop(0, n_chunks, chunk_body, (jnp.zeros((geo.tile, hidden.shape[1]), _F32), dw))
        old = lax.dynamic_slice_in_dim(dh_all, s, geo.tile, axis=0)
        # rows of a slid-back tile that an earlier tile covered have gm = 0, hence dh = 0: adding is exact
        dh_all = lax.dynamic_update_slice_in_dim(dh_all, old + dh, s, 0)
        return dh_all, dw

    out: tuple[jax.Array, jax.Array | None] = lax.fori_loop(0, n_tiles, tile_body, (dh_all, dw))
    return out


def _local_backward(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    lse: jax.Array,
    g: jax.Array,
    geo: _Geometry,
    grad_w: bool,
) -> tuple[jax.Array, jax.Array | None]:
    dh = jnp.zeros(hidden.shape, _F32)
    dw: jax.Array | None = jnp.zeros(w.shape, _F32) if grad_w else None
    g = g.astype(_F32)
    if dw is not None and geo.ring > 1:
        # Every step: this block's share, then the block and its gradient move on; after a full turn the
        # gradient block is back with the block's owner.
        def body(step: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
            blk, dblk, dh = carry
            dh, moved = _sweep_backward(hidden, blk, targets, mask, lse, g, geo.block_id(step), dh, dblk, geo)
            assert moved is not None
            return geo.shift(blk), geo.shift(moved), dh

        _, dw, dh = lax.fori_loop(0, geo.ring, body, (w, dw, dh))
    else:
        if geo.ring > 1:

            def body_nw(step: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
                blk, dh = carry
                dh, _ = _sweep_backward(hidden, blk, targets, mask, lse, g, geo.block_id(step), dh, None, geo)
                return geo.shift(blk), dh

            w, dh = lax.fori_loop(0, geo.ring - 1, body_nw, (w, dh))
        dh, dw = _sweep_backward(hidden, w, targets, mask, lse, g, geo.block_id(geo.ring - 1), dh, dw, geo)
    if geo.vocab_axes:  # each vocabulary group contributed its columns' part of every token's dh
        dh = lax.psum(dh, geo.vocab_axes)  # type: ignore[no-untyped-call]
    return dh, dw


# ------------------------------------------------------------------------------------ one device


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(
    hidden: jax.Array, w: jax.Array, targets: jax.Array, mask: jax.Array, geo: _Geometry, grad_w: bool
) -> jax.Array:
    return _local_forward(hidden, w, targets, mask, geo)[0]


def _fused_fwd(
    hidden: jax.Array, w: jax.Array, targets: jax.Array, mask: jax.Array, geo: _Geometry, grad_w: bool
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    lp, lse = _local_forward(hidden, w, targets, mask, geo)
    return lp, (hidden, w, targets, mask, lse)


def _fused_bwd(
    geo: _Geometry, grad_w: bool, res: tuple[jax.Array, ...], g: jax.Array
) -> tuple[jax.Array | None, ...]:
    hidden, w, targets, mask, lse = res
    dh, dw = _local_backward(hidden, w, targets, mask, lse, g, geo, grad_w)
    return dh.astype(hidden.dtype), (dw.astype(w.dtype) if dw is not None else jnp.zeros_like(w)), None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def _check(token_tile: int, vocab_chunk: int) -> None:
    if token_tile <= 0 or vocab_chunk <= 0:
        raise ValueError(f"token_logprobs: token_tile {token_tile} and vocab_chunk {vocab_chunk} must be > 0")


def token_logprobs(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    *,
    token_tile: int = DEFAULT_TOKEN_TILE,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    temperature: float = 1.0,
    soft_cap: float = 0.0,
    divisor: float = 1.0,
    grad_w: bool = True,
) -> jax.Array:
    """Log-probs [T] (float32) of ``targets`` under ``softmax(f(hidden @ w))``, f =
    ``LogitTransform(divisor, soft_cap, temperature)``.

    hidden [T, H], w [H, V] (any float dtype; logits accumulate in float32), targets [T] int,
    mask [T] bool (False rows give 0 and no gradient; default all True). ``token_tile`` and
    ``vocab_chunk`` set the block size (clamped to T and V). ``grad_w=False`` skips the [H, V]
    gradient (a frozen head): its cotangent is zero.
    """
    if hidden.ndim != 2 or w.ndim != 2 or hidden.shape[1] != w.shape[0]:
        raise ValueError(f"token_logprobs: hidden {hidden.shape} and w {w.shape} must be [T,H] and [H,V]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"token_logprobs: targets {targets.shape} must be [{hidden.shape[0]}]")
    _check(token_tile, vocab_chunk)
    tf = LogitTransform(divisor, soft_cap, temperature)
    t, v = hidden.shape[0], w.shape[1]
    if t == 0:
        return jnp.zeros((0,), _F32)
    m = jnp.ones((t,), bool) if mask is None else mask.astype(bool)
    tg = jnp.clip(targets.astype(jnp.int32), 0, v - 1)
    geo = _Geometry(min(token_tile, t), min(vocab_chunk, v), v, tf)
    return _fused(hidden, w, tg, m, geo, grad_w)


def naive_token_logprobs(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    *,
    temperature: float = 1.0,
    soft_cap: float = 0.0,
    divisor: float = 1.0,
) -> jax.Array:
    """Reference: ``log_softmax(f(hidden @ w))`` then take the target (materializes [T, V])."""
    z = LogitTransform(divisor, soft_cap, temperature)(jnp.dot(hidden, w, preferred_element_type=_F32))
    logp_all = jax.nn.log_softmax(z, axis=-1)
    lp = jnp.take_along_axis(logp_all, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return lp if mask is None else jnp.where(mask, lp, 0.0)


def next_token_targets(tokens: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per position i of [B, T] rows: the next token in the same segment and whether there is one."""
    nxt = jnp.roll(tokens, -1, axis=-1)
    nseg = jnp.roll(segment_ids, -1, axis=-1)
    last = jnp.arange(tokens.shape[-1]) == tokens.shape[-1] - 1
    valid = (segment_ids > 0) & (nseg == segment_ids) & ~last
    return jnp.where(valid, nxt, 0), valid


def shift_to_tokens(lp: jax.Array) -> jax.Array:
    """[B, T] log-probs of each position's next token, moved onto that token (0 in column 0)."""
    return jnp.concatenate([jnp.zeros((*lp.shape[:-1], 1), lp.dtype), lp[..., :-1]], axis=-1)


def next_token_logprobs(
    hidden: jax.Array,
    w: jax.Array,
    tokens: jax.Array,
    segment_ids: jax.Array,
    **kwargs: object,
) -> jax.Array:
    """[B, T] log-probs aligned with ``tokens``: entry i scores tokens[i] from hidden[i - 1].

    0 on each segment's first token and on padding (segment id 0). ``kwargs`` go to
    :func:`token_logprobs` (token_tile, vocab_chunk, temperature, soft_cap, divisor, grad_w).
    """
    b, t, h = hidden.shape
    tg, valid = next_token_targets(tokens, segment_ids)
    lp = token_logprobs(hidden.reshape(b * t, h), w, tg.reshape(-1), valid.reshape(-1), **kwargs)  # type: ignore[arg-type]
    return shift_to_tokens(lp.reshape(b, t))


# ------------------------------------------------------------------------------------ on a mesh


def _axes(entry: str | Sequence[str] | None) -> Axes:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def sharded_token_logprobs(
    mesh: Mesh,
    token_spec: Sequence[str | Sequence[str] | None],
    vocab_axes: str | Sequence[str] | None,
    vocab_size: int,
    *,
    token_tile: int = DEFAULT_TOKEN_TILE,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    transform: LogitTransform = LogitTransform(),
    grad_w: bool = False,
) -> Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]:
    """The head on ``mesh``: ``f(hidden [*lead, H], w [H, Vp], targets [*lead], mask [*lead]) -> [*lead]``.

    ``token_spec``: the mesh axes splitting each leading dimension of ``hidden`` (e.g. ``(rows, tokens)``
    for ``[B, T, H]``); these are the ring axes. ``vocab_axes``: axes over which the tokens are replicated
    and the vocabulary is split instead (e.g. tensor). ``w``'s columns are split over ``vocab_axes +
    ring axes``: Vp (w's column count, the vocabulary padded with zero columns) must divide by the product
    of their sizes; columns at or above ``vocab_size`` are never scored. Targets are global token ids.
    ``w`` is laid out ``P(None, vocab_axes + ring axes)`` (:func:`head_spec`); ``grad_w``: w's gradient
    in that layout (else zeros: a frozen head).
    """
    _check(token_tile, vocab_chunk)
    lead = tuple(_axes(e) for e in token_spec)
    ring_axes = tuple(a for e in lead for a in e)
    vaxes = _axes(vocab_axes)
    if set(ring_axes) & set(vaxes) or len(set(ring_axes)) != len(ring_axes):
        raise ValueError(f"sharded head: token axes {lead} and vocab axes {vaxes} must be distinct")
    ring = 1
    for a in ring_axes:
        ring *= int(mesh.shape[a])
    shards = ring
    for a in vaxes:
        shards *= int(mesh.shape[a])
    mesh_ring_axes, mesh_ring_perm = _ring_shift(
        tuple(mesh.axis_names), ring_axes, {a: int(mesh.shape[a]) for a in ring_axes}
    )
    tok = P(*[e or None for e in lead])  # type: ignore[no-untyped-call]
    hid = P(*[e or None for e in lead], None)  # type: ignore[no-untyped-call]
    cols = head_spec(vaxes + ring_axes)

    def geometry(hidden: jax.Array, w: jax.Array) -> _Geometry:
        if w.shape[1] % shards:
            raise ValueError(f"sharded head: w's {w.shape[1]} columns do not split over {shards} devices")
        local_tokens = 1
        for n, e in zip(hidden.shape[:-1], lead, strict=True):
            k = 1
            for a in e:
                k *= int(mesh.shape[a])
            if n % k:
                raise ValueError(f"sharded head: dimension {n} does not split over {e}")
            local_tokens *= n // k
        vl = w.shape[1] // shards
        return _Geometry(
            max(1, min(token_tile, local_tokens)),
            min(vocab_chunk, vl),
            vocab_size,
            transform,
            ring_axes,
            ring,
            vaxes,
            mesh_ring_axes,
            mesh_ring_perm,
        )

    def forward(hidden: jax.Array, w: jax.Array, tg: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
        geo = geometry(hidden, w)

        def local(h: jax.Array, ww: jax.Array, t: jax.Array, mm: jax.Array) -> tuple[jax.Array, jax.Array]:
            lp, lse = _local_forward(h.reshape(-1, h.shape[-1]), ww, t.reshape(-1), mm.reshape(-1), geo)
            return lp.reshape(t.shape), lse.reshape(t.shape)

        run = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(hid, cols, tok, tok),
            out_specs=(tok, tok),
            check_vma=False,  # the loops' carries start replicated; outputs agree over the vocab axes
        )
        lp, lse = run(hidden, w, tg, m)
        return lp, lse

    def backward(
        hidden: jax.Array, w: jax.Array, tg: jax.Array, m: jax.Array, lse: jax.Array, g: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        geo = geometry(hidden, w)

        def local(
            h: jax.Array, ww: jax.Array, t: jax.Array, mm: jax.Array, ls: jax.Array, gg: jax.Array
        ) -> tuple[jax.Array, jax.Array]:
            flat = (t.reshape(-1), mm.reshape(-1), ls.reshape(-1), gg.reshape(-1))
            dh, dw = _local_backward(h.reshape(-1, h.shape[-1]), ww, *flat, geo, grad_w)
            return dh.reshape(h.shape), (dw if dw is not None else jnp.zeros((), _F32))

        run = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(hid, cols, tok, tok, tok, tok),
            out_specs=(hid, cols if grad_w else P()),  # type: ignore[no-untyped-call]
            check_vma=False,
        )
        dh, dw = run(hidden, w, tg, m, lse, g)
        return dh, (dw.astype(w.dtype) if grad_w else jnp.zeros_like(w))

    @jax.custom_vjp
    def head(hidden: jax.Array, w: jax.Array, tg: jax.Array, m: jax.Array) -> jax.Array:
        return forward(hidden, w, tg, m)[0]

    def head_fwd(
        hidden: jax.Array, w: jax.Array, tg: jax.Array, m: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        lp, lse = forward(hidden, w, tg, m)
        return lp, (hidden, w, tg, m, lse)

    def head_bwd(res: tuple[jax.Array, ...], g: jax.Array) -> tuple[jax.Array | None, ...]:
        hidden, w, tg, m, lse = res
        dh, dw = backward(hidden, w, tg, m, lse, g)
        return dh.astype(hidden.dtype), dw, None, None

    head.defvjp(head_fwd, head_bwd)

    def apply(hidden: jax.Array, w: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
        tg = jnp.clip(targets.astype(jnp.int32), 0, vocab_size - 1)
        out: jax.Array = head(hidden, w, tg, mask.astype(bool))
        return out

    return apply


def head_spec(axes: Sequence[str]) -> P:
    """Layout of the [H, Vp] head on a mesh: columns split over ``axes`` (vocab axes, then ring axes)."""
    return P(None, tuple(axes) or None)  # type: ignore[no-untyped-call]


def padded_vocab(vocab_size: int, shards: int) -> int:
    """The head's column count on ``shards`` devices: ``vocab_size`` rounded up to a multiple."""
    return -(-vocab_size // shards) * shards
