"""Fused log-prob head: per-token log p(target) = z[target] - logsumexp(z), z = hidden @ w / temp.

Never materializes a log-softmax, nor the [T, V] logits. :func:`token_logprobs` is a
``jax.custom_vjp`` over token tiles AND vocabulary chunks: the forward runs an online logsumexp
(running max, rescaled exp-sum, one-hot select-sum of the target logit) over vocabulary chunks, so
only one ``[token_tile, vocab_chunk]`` block of logits is alive at a time; its residuals are the
inputs themselves (hidden, w, targets, mask) plus the per-token logsumexp (4 bytes a token). The
backward recomputes one block at a time: ``dz = g * (onehot - exp(z - lse)) / temp``, then
``dh += dz @ w_chunk.T`` and ``dw[:, chunk] += h.T @ dz``.

Tiles and chunks that do not divide T or V are handled without padding copies: the last tile/chunk
is slid back to end at T/V (a clamped ``dynamic_slice``) and the rows/columns already covered are
masked. Masked rows (``mask`` False) give log-prob 0 and zero gradient; their hidden states are
replaced by 0 inside each tile, so non-finite values there never reach a result or a gradient.
Targets must lie in ``[0, V)`` on unmasked rows (not checked inside jit).

Public API:
  token_logprobs(hidden[T,H], w[H,V], targets[T], mask[T]|None, *, token_tile, vocab_chunk,
                 temperature, grad_w) -> [T] float32
  next_token_logprobs(hidden[B,T,H], w, tokens[B,T], segment_ids[B,T], ...) -> [B,T] float32
      log-prob of tokens[b, i] given the segment's prefix, aligned with the token (0 on a segment's
      first token and on padding) -- the layout of trainer.packing.
  sharded_token_logprobs(mesh, token_axes, ...) -> the same function under shard_map, tokens
      split over ``token_axes`` and w replicated (its gradient is summed over those axes).
  vocab_sharded_token_logprobs(mesh, vocab_axis, token_axes=None, ...) -> w split by vocabulary
      columns over ``vocab_axis``; shards combine per token tile with pmax/psum of [tile] vectors.
  naive_token_logprobs(...): log_softmax then take -- the reference for tests and benchmarks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

__all__ = [
    "DEFAULT_VOCAB_CHUNK",
    "naive_token_logprobs",
    "next_token_logprobs",
    "next_token_targets",
    "sharded_token_logprobs",
    "token_logprobs",
    "vocab_sharded_token_logprobs",
]

_F32 = jnp.float32
# Vocabulary chunk of the fused head (bench/logprob_head_memory.py measured 8192 best).
DEFAULT_VOCAB_CHUNK = 8192


def _tile_start(i: jax.Array, tile: int, n: int) -> jax.Array:
    """Start of tile i, clamped so the tile ends at n at most (the last tile slides back)."""
    return jnp.minimum(i * tile, n - tile)


def _chunk_logits(
    h: jax.Array, w: jax.Array, j: jax.Array, chunk: int, temperature: float, vocab_axis: str | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logits of one [tile, chunk] block, the chunk's column ids, and which columns are new."""
    v = w.shape[1]
    c0 = _tile_start(j, chunk, v)
    wc = lax.dynamic_slice_in_dim(w, c0, chunk, axis=1)
    z = jnp.dot(h, wc, preferred_element_type=_F32)
    if temperature != 1.0:
        z = z / temperature
    local = c0 + jnp.arange(chunk)
    offset = 0 if vocab_axis is None else lax.axis_index(vocab_axis) * v
    return z, local + offset, local >= j * chunk


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


def _forward(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    tile: int,
    chunk: int,
    temperature: float,
    vocab_axis: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    t, v = hidden.shape[0], w.shape[1]
    n_tiles, n_chunks = -(-t // tile), -(-v // chunk)

    def tile_body(i: jax.Array, acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        out, lse_out = acc
        s, h, tg, m = _tile_inputs(hidden, targets, mask, i, tile)

        def chunk_body(
            j: jax.Array, c: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            mx, se, tl = c
            z, col, new = _chunk_logits(h, w, j, chunk, temperature, vocab_axis)
            z = jnp.where(new[None, :], z, -jnp.inf)
            mx2 = jnp.maximum(mx, z.max(axis=1))
            se = se * jnp.exp(mx - mx2) + jnp.exp(z - mx2[:, None]).sum(axis=1)
            hit = (col[None, :] == tg[:, None]) & new[None, :]
            tl = tl + jnp.where(hit, z, 0.0).sum(axis=1)
            return mx2, se, tl

        init = (jnp.full((tile,), -jnp.inf, _F32), jnp.zeros((tile,), _F32), jnp.zeros((tile,), _F32))
        mx, se, tl = lax.fori_loop(0, n_chunks, chunk_body, init)
        if vocab_axis is not None:  # combine the vocabulary shards: [tile]-sized collectives only
            gmx = lax.pmax(mx, vocab_axis)  # type: ignore[no-untyped-call]
            se = lax.psum(se * jnp.exp(mx - gmx), vocab_axis)  # type: ignore[no-untyped-call]
            tl = lax.psum(tl, vocab_axis)  # type: ignore[no-untyped-call]
            mx = gmx
        log_se = jnp.log(se)
        lse = mx + log_se
        # (target - max) - log(sum): the association log_softmax uses, so float32 results agree.
        lp = jnp.where(m, (tl - mx) - log_se, 0.0)
        keep = (s + jnp.arange(tile)) >= i * tile
        out = lax.dynamic_update_slice_in_dim(
            out, jnp.where(keep, lp, lax.dynamic_slice_in_dim(out, s, tile)), s, 0
        )
        lse_out = lax.dynamic_update_slice_in_dim(
            lse_out, jnp.where(keep, lse, lax.dynamic_slice_in_dim(lse_out, s, tile)), s, 0
        )
        return out, lse_out

    zeros = jnp.zeros((t,), _F32)
    lp, lse = lax.fori_loop(0, n_tiles, tile_body, (zeros, zeros))
    return lp, lse


def _backward(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    lse: jax.Array,
    g: jax.Array,
    tile: int,
    chunk: int,
    temperature: float,
    grad_w: bool,
    vocab_axis: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    t, v = hidden.shape[0], w.shape[1]
    n_tiles, n_chunks = -(-t // tile), -(-v // chunk)
    g = g.astype(_F32)
    if vocab_axis is not None:
        # shard_map (check_vma=False) hands each vocabulary shard 1/n of the cotangent of its
        # replicated output and psums the partial dh it returns; the shards' partial products are
        # not replicas, so each needs the whole cotangent. (A test pins this against the unsharded head.)
        g = lax.psum(g, vocab_axis)  # type: ignore[no-untyped-call]

    def tile_body(i: jax.Array, acc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        dh_all, dw = acc
        s, h, tg, m = _tile_inputs(hidden, targets, mask, i, tile)
        gm = jnp.where(m, lax.dynamic_slice_in_dim(g, s, tile), 0.0)
        ls = lax.dynamic_slice_in_dim(lse, s, tile)

        def chunk_body(j: jax.Array, c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            dh, dw = c
            z, col, new = _chunk_logits(h, w, j, chunk, temperature, vocab_axis)
            p = jnp.where(new[None, :], jnp.exp(z - ls[:, None]), 0.0)
            hit = (col[None, :] == tg[:, None]) & new[None, :]
            dz = gm[:, None] * (hit.astype(_F32) - p)
            if temperature != 1.0:
                dz = dz / temperature
            c0 = _tile_start(j, chunk, v)
            wc = lax.dynamic_slice_in_dim(w, c0, chunk, axis=1)
            dh = dh + jnp.dot(dz.astype(w.dtype), wc.T, preferred_element_type=_F32)
            if grad_w:
                upd = jnp.dot(h.T, dz.astype(h.dtype), preferred_element_type=_F32)
                dw = lax.dynamic_update_slice_in_dim(
                    dw, lax.dynamic_slice_in_dim(dw, c0, chunk, axis=1) + upd, c0, 1
                )
            return dh, dw

        dh, dw = lax.fori_loop(0, n_chunks, chunk_body, (jnp.zeros((tile, hidden.shape[1]), _F32), dw))
        keep = ((s + jnp.arange(tile)) >= i * tile)[:, None]
        old = lax.dynamic_slice_in_dim(dh_all, s, tile, axis=0)
        dh_all = lax.dynamic_update_slice_in_dim(dh_all, jnp.where(keep, dh, old), s, 0)
        return dh_all, dw

    dw0 = jnp.zeros(w.shape, _F32) if grad_w else jnp.zeros((w.shape[0], 0), _F32)
    dh_all, dw = lax.fori_loop(0, n_tiles, tile_body, (jnp.zeros(hidden.shape, _F32), dw0))
    return dh_all.astype(hidden.dtype), (dw.astype(w.dtype) if grad_w else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _fused(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    tile: int,
    chunk: int,
    temperature: float,
    grad_w: bool,
    vocab_axis: str | None,
) -> jax.Array:
    return _forward(hidden, w, targets, mask, tile, chunk, temperature, vocab_axis)[0]


def _fused_fwd(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    tile: int,
    chunk: int,
    temperature: float,
    grad_w: bool,
    vocab_axis: str | None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    lp, lse = _forward(hidden, w, targets, mask, tile, chunk, temperature, vocab_axis)
    return lp, (hidden, w, targets, mask, lse)


def _fused_bwd(
    tile: int,
    chunk: int,
    temperature: float,
    grad_w: bool,
    vocab_axis: str | None,
    res: tuple[jax.Array, ...],
    g: jax.Array,
) -> tuple[jax.Array | None, ...]:
    hidden, w, targets, mask, lse = res
    dh, dw = _backward(hidden, w, targets, mask, lse, g, tile, chunk, temperature, grad_w, vocab_axis)
    return dh, dw, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def token_logprobs(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    *,
    token_tile: int = 2048,
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
    temperature: float = 1.0,
    grad_w: bool = True,
    vocab_axis: str | None = None,
) -> jax.Array:
    """Log-probs [T] (float32) of ``targets`` under ``softmax(hidden @ w / temperature)``.

    hidden [T, H], w [H, V] (any float dtype; logits accumulate in float32), targets [T] int,
    mask [T] bool (False rows give 0 and no gradient; default all True). ``token_tile`` and
    ``vocab_chunk`` set the block size (clamped to T and V). ``grad_w=False`` skips the [H, V]
    gradient (a frozen head): its cotangent is zero. ``vocab_axis``: only inside ``shard_map`` with
    w split by columns over that mesh axis (see :func:`vocab_sharded_token_logprobs`).
    """
    if hidden.ndim != 2 or w.ndim != 2 or hidden.shape[1] != w.shape[0]:
        raise ValueError(f"token_logprobs: hidden {hidden.shape} and w {w.shape} must be [T,H] and [H,V]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"token_logprobs: targets {targets.shape} must be [{hidden.shape[0]}]")
    if token_tile <= 0 or vocab_chunk <= 0:
        raise ValueError(f"token_logprobs: token_tile {token_tile} and vocab_chunk {vocab_chunk} must be > 0")
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    t, v = hidden.shape[0], w.shape[1]
    if t == 0:
        return jnp.zeros((0,), _F32)
    m = jnp.ones((t,), bool) if mask is None else mask.astype(bool)
    tg = targets.astype(jnp.int32)
    if vocab_axis is None:  # with a sharded vocabulary the targets are global ids
        tg = jnp.clip(tg, 0, v - 1)
    chunk = min(vocab_chunk, v)
    return _fused(hidden, w, tg, m, min(token_tile, t), chunk, float(temperature), grad_w, vocab_axis)


def naive_token_logprobs(
    hidden: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    mask: jax.Array | None = None,
    *,
    temperature: float = 1.0,
) -> jax.Array:
    """Reference: ``log_softmax(hidden @ w / temperature)`` then take the target (materializes [T, V])."""
    z = jnp.dot(hidden, w, preferred_element_type=_F32) / temperature
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


def next_token_logprobs(
    hidden: jax.Array,
    w: jax.Array,
    tokens: jax.Array,
    segment_ids: jax.Array,
    **kwargs: object,
) -> jax.Array:
    """[B, T] log-probs aligned with ``tokens``: entry i scores tokens[i] from hidden[i - 1].

    0 on each segment's first token and on padding (segment id 0). ``kwargs`` go to
    :func:`token_logprobs` (token_tile, vocab_chunk, temperature, grad_w).
    """
    b, t, h = hidden.shape
    tg, valid = next_token_targets(tokens, segment_ids)
    lp = token_logprobs(hidden.reshape(b * t, h), w, tg.reshape(-1), valid.reshape(-1), **kwargs)  # type: ignore[arg-type]
    lp = lp.reshape(b, t)
    return jnp.concatenate([jnp.zeros((b, 1), lp.dtype), lp[:, :-1]], axis=1)


def sharded_token_logprobs(
    mesh: Mesh, token_axes: str | tuple[str, ...], **kwargs: object
) -> Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]:
    """:func:`token_logprobs` under ``shard_map``: hidden/targets/mask split over ``token_axes``
    (T must divide by their size), w replicated; the w gradient is summed over ``token_axes``."""
    spec, rows, whole = P(token_axes), P(token_axes, None), P()  # type: ignore[no-untyped-call]

    def local(h: jax.Array, w: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
        return token_logprobs(h, w, t, m, **kwargs)  # type: ignore[arg-type]

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, whole, spec, spec),
        out_specs=spec,
        check_vma=False,  # the tile loops' carries start replicated; every output is per-device
    )


def vocab_sharded_token_logprobs(
    mesh: Mesh, vocab_axis: str, token_axes: str | tuple[str, ...] | None = None, **kwargs: object
) -> Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]:
    """:func:`token_logprobs` with w split by vocabulary columns over ``vocab_axis`` (V must divide by
    its size) and tokens optionally split over ``token_axes``. Each device runs the online logsumexp
    on its columns; the shards are combined with [tile]-sized pmax/psum collectives (max, rescaled
    exp-sum, target logit), so no device ever holds more than one [tile, chunk] block of logits."""
    rows, toks = P(token_axes, None), P(token_axes)  # type: ignore[no-untyped-call]
    cols = P(None, vocab_axis)  # type: ignore[no-untyped-call]

    def local(h: jax.Array, w: jax.Array, t: jax.Array, m: jax.Array) -> jax.Array:
        return token_logprobs(h, w, t, m, vocab_axis=vocab_axis, **kwargs)  # type: ignore[arg-type]

    return jax.shard_map(local, mesh=mesh, in_specs=(rows, cols, toks, toks), out_specs=toks, check_vma=False)
