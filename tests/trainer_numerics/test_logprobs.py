"""The fused log-prob head against log_softmax-then-take, in float32 over generated shapes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rljob.trainer.logprobs as lp_mod
from hypothesis import given, settings
from hypothesis import strategies as st
from rljob.trainer.logprobs import (
    naive_token_logprobs,
    next_token_logprobs,
    token_logprobs,
)

pytestmark = pytest.mark.jax


def _case(seed: int, t: int, h: int, v: int, masked: float = 0.2, poison: bool = True):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(t, h)).astype(np.float32)
    w = (rng.normal(size=(h, v)) / np.sqrt(h) * 2).astype(np.float32)
    targets = rng.integers(0, v, t).astype(np.int32)
    mask = rng.random(t) >= masked
    if poison and (~mask).any():
        bad = np.flatnonzero(~mask)
        hidden[bad[0]] = np.nan
        hidden[bad[-1], 0] = np.inf
        targets[bad[0]] = v + 7  # out of range on a masked row: ignored
    g = rng.normal(size=t).astype(np.float32)
    return jnp.asarray(hidden), jnp.asarray(w), jnp.asarray(targets), jnp.asarray(mask), jnp.asarray(g)


def _compare(t: int, h: int, v: int, tile: int, chunk: int, temperature: float, seed: int) -> None:
    hidden, w, targets, mask, g = _case(seed, t, h, v)
    clean = jnp.where(mask[:, None], hidden, 0.0)
    safe_t = jnp.where(mask, targets, 0)

    def fused(hh: jax.Array, ww: jax.Array) -> jax.Array:
        return token_logprobs(
            hh, ww, targets, mask, token_tile=tile, vocab_chunk=chunk, temperature=temperature
        )

    def naive(hh: jax.Array, ww: jax.Array) -> jax.Array:
        return naive_token_logprobs(hh, ww, safe_t, mask, temperature=temperature)

    @jax.jit
    def both(hh: jax.Array, cl: jax.Array, ww: jax.Array, gg: jax.Array):  # type: ignore[no-untyped-def]
        lp, vjp = jax.vjp(fused, hh, ww)
        ref, ref_vjp = jax.vjp(naive, cl, ww)
        return lp, ref, vjp(gg), ref_vjp(gg)

    lp, ref, grads, ref_grads = both(hidden, clean, w, g)
    lp_np, ref_np = np.asarray(lp), np.asarray(ref)
    # 1e-6 absolute; where |log p| > 1 the float32 result itself is only good to its ulp, so 1e-6 relative
    assert np.all(np.abs(lp_np - ref_np) <= 1e-6 * np.maximum(1.0, np.abs(ref_np))), np.abs(
        lp_np - ref_np
    ).max()
    assert (lp_np[~np.asarray(mask)] == 0).all()
    for got, want, name in zip(grads, ref_grads, ("hidden", "w"), strict=True):
        got_np, want_np = np.asarray(got), np.asarray(want)
        assert np.isfinite(got_np).all(), f"non-finite d{name}"
        scale = np.abs(want_np).max()
        assert np.abs(got_np - want_np).max() <= 1e-5 * scale, (name, np.abs(got_np - want_np).max() / scale)
    dh = np.asarray(grads[0])
    assert (dh[~np.asarray(mask)] == 0).all()


@pytest.mark.parametrize(
    ("t", "h", "v", "tile", "chunk"),
    [
        (64, 16, 256, 16, 64),  # everything divides
        (37, 12, 101, 8, 24),  # neither divides
        (5, 8, 7, 16, 32),  # tile and chunk larger than T and V (clamped)
        (33, 8, 300, 33, 300),  # one tile, one chunk
        (50, 8, 129, 1, 1),  # one token, one column at a time
    ],
)
def test_fused_matches_naive_fixed_shapes(t: int, h: int, v: int, tile: int, chunk: int) -> None:
    _compare(t, h, v, tile, chunk, 1.0, seed=t * 1000 + v)


@settings(max_examples=20, deadline=None)
@given(
    t=st.integers(1, 70),
    h=st.integers(1, 24),
    v=st.integers(2, 600),
    tile=st.integers(1, 48),
    chunk=st.integers(1, 700),
    temperature=st.sampled_from([1.0, 0.7]),
    seed=st.integers(0, 2**16),
)
def test_fused_matches_naive_generated(
    t: int, h: int, v: int, tile: int, chunk: int, temperature: float, seed: int
) -> None:
    _compare(t, h, v, tile, max(chunk, 2) if v > 2 else chunk, temperature, seed)


def test_all_rows_masked_gives_zero_and_finite_gradients() -> None:
    hidden, w, targets, _, g = _case(0, 9, 4, 30, poison=False)
    mask = jnp.zeros(9, bool)
    hidden = hidden.at[:].set(jnp.nan)
    lp, vjp = jax.vjp(
        lambda hh, ww: token_logprobs(hh, ww, targets, mask, token_tile=4, vocab_chunk=8), hidden, w
    )
    dh, dw = vjp(g)
    assert (np.asarray(lp) == 0).all() and (np.asarray(dh) == 0).all() and (np.asarray(dw) == 0).all()


def test_frozen_head_skips_w_gradient() -> None:
    hidden, w, targets, mask, g = _case(1, 20, 8, 50)
    kw = {"token_tile": 8, "vocab_chunk": 16}
    _, vjp_full = jax.vjp(lambda hh, ww: token_logprobs(hh, ww, targets, mask, **kw), hidden, w)
    _, vjp_frozen = jax.vjp(
        lambda hh, ww: token_logprobs(hh, ww, targets, mask, grad_w=False, **kw), hidden, w
    )
    (dh1, dw1), (dh2, dw2) = vjp_full(g), vjp_frozen(g)
    np.testing.assert_array_equal(np.asarray(dh1), np.asarray(dh2))
    assert (np.asarray(dw2) == 0).all() and np.abs(np.asarray(dw1)).max() > 0


def test_bf16_inputs_close_to_float32() -> None:
    hidden, w, targets, _, _ = _case(2, 40, 16, 200, poison=False)
    lp16 = token_logprobs(
        hidden.astype(jnp.bfloat16), w.astype(jnp.bfloat16), targets, token_tile=16, vocab_chunk=64
    )
    ref = naive_token_logprobs(hidden, w, targets)
    assert lp16.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp16), np.asarray(ref), atol=0.1)


def test_next_token_logprobs_follow_segments() -> None:
    rng = np.random.default_rng(3)
    v, h = 40, 8
    tokens = jnp.asarray(rng.integers(1, v, (2, 12)), jnp.int32)
    seg = jnp.asarray([[1, 1, 1, 1, 0, 2, 2, 2, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3]], jnp.int32)
    hidden = jnp.asarray(rng.normal(size=(2, 12, h)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(h, v)), jnp.float32)
    got = np.asarray(next_token_logprobs(hidden, w, tokens, seg, token_tile=5, vocab_chunk=16))
    full = np.asarray(jax.nn.log_softmax(hidden @ w, axis=-1))
    for b in range(2):
        for i in range(12):
            ok = i > 0 and seg[b, i] > 0 and seg[b, i] == seg[b, i - 1]
            want = full[b, i - 1, int(tokens[b, i])] if ok else 0.0
            assert got[b, i] == pytest.approx(want, abs=1e-6), (b, i)


def test_fused_temporaries_are_one_block_not_the_logits() -> None:
    """Compile-only: the fused forward+backward needs far less temporary memory than [T, V] logits."""
    t, h, v = 1024, 64, 16384
    sd = (jax.ShapeDtypeStruct((t, h), jnp.float32), jax.ShapeDtypeStruct((h, v), jnp.float32))
    tg = jax.ShapeDtypeStruct((t,), jnp.int32)

    def temp(f):  # type: ignore[no-untyped-def]
        grad = jax.grad(lambda hh, ww, tt: f(hh, ww, tt).sum())
        return jax.jit(grad).lower(*sd, tg).compile().memory_analysis().temp_size_in_bytes

    fused = temp(
        lambda hh, ww, tt: token_logprobs(hh, ww, tt, token_tile=128, vocab_chunk=1024, grad_w=False)
    )
    naive = temp(naive_token_logprobs)
    logits_bytes = t * v * 4
    assert naive >= logits_bytes
    assert fused < logits_bytes / 8, (fused, naive)


_SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from rljob.trainer.logprobs import sharded_token_logprobs, token_logprobs
    assert jax.device_count() == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
    rng = np.random.default_rng(0)
    t, h, v = 64, 8, 90
    hid = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(h, v)) * 0.5, jnp.float32)
    tg = jnp.asarray(rng.integers(0, v, t), jnp.int32)
    m = jnp.asarray(rng.random(t) > 0.2)
    hid = hid.at[jnp.argmin(m)].set(jnp.nan)
    g = jnp.asarray(rng.normal(size=t), jnp.float32)
    f_sh = sharded_token_logprobs(mesh, ("data", "fsdp"), token_tile=6, vocab_chunk=32)
    f_one = lambda a, b: token_logprobs(a, b, tg, m, token_tile=6, vocab_chunk=32)
    tok = NamedSharding(mesh, P(("data", "fsdp")))
    hid_s = jax.device_put(hid, NamedSharding(mesh, P(("data", "fsdp"), None)))
    loss_sh = jax.jit(lambda a, b: (f_sh(a, b, jax.device_put(tg, tok), jax.device_put(m, tok)) * g).sum())
    (l1, (dh1, dw1)) = jax.value_and_grad(loss_sh, (0, 1))(hid_s, w)
    (l2, (dh2, dw2)) = jax.value_and_grad(lambda a, b: (f_one(a, b) * g).sum(), (0, 1))(hid, w)
    assert dh1.sharding.spec[0] is not None, dh1.sharding
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dh1), np.asarray(dh2), atol=1e-5 * float(jnp.abs(dh2).max()))
    np.testing.assert_allclose(np.asarray(dw1), np.asarray(dw2), atol=1e-5 * float(jnp.abs(dw2).max()))
    # plain jit with token-sharded inputs (GSPMD partitions the loops) computes the same
    l3, dh3 = jax.value_and_grad(lambda a: (f_one(a, w) * g).sum())(hid_s)
    np.testing.assert_allclose(float(l3), float(l2), rtol=1e-6)
    assert np.isfinite(np.asarray(dh3)).all()
    # vocabulary split over "fsdp" (w by columns), tokens over "data"; NaN hidden on a masked row
    from rljob.trainer.logprobs import vocab_sharded_token_logprobs
    for tok_axes in (None, "data"):
        f_v = vocab_sharded_token_logprobs(mesh, "fsdp", tok_axes, token_tile=6, vocab_chunk=16)
        lv = f_v(hid, w, tg, m)
        np.testing.assert_allclose(np.asarray(lv), np.asarray(f_one(hid, w)), atol=1e-6)
        loss_v = jax.jit(jax.value_and_grad(lambda a, b: (f_v(a, b, tg, m) * g).sum(), (0, 1)))
        l4, (dh4, dw4) = loss_v(hid, w)
        np.testing.assert_allclose(float(l4), float(l2), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(dh4), np.asarray(dh2), atol=1e-5 * float(jnp.abs(dh2).max()))
        np.testing.assert_allclose(np.asarray(dw4), np.asarray(dw2), atol=1e-5 * float(jnp.abs(dw2).max()))
    print("OK")
    """
)


def test_sharded_over_four_cpu_devices() -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONSAFEPATH": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def _unsanitized_tile_inputs(hidden, targets, mask, i, tile):  # type: ignore[no-untyped-def]
    s = lp_mod._tile_start(i, tile, hidden.shape[0])
    m = jax.lax.dynamic_slice_in_dim(mask, s, tile) & ((s + jnp.arange(tile)) >= i * tile)
    return (
        s,
        jax.lax.dynamic_slice_in_dim(hidden, s, tile, axis=0),
        jax.lax.dynamic_slice_in_dim(targets, s, tile),
        m,
    )


def _overlapping_chunk_logits(h, w, j, chunk, temperature, vocab_axis=None):  # type: ignore[no-untyped-def]
    z, col, new = _real_chunk_logits(h, w, j, chunk, temperature, vocab_axis)
    return z, col, jnp.ones_like(new)


_real_chunk_logits = lp_mod._chunk_logits


@pytest.mark.parametrize(
    ("name", "patch"),
    [
        ("masked hidden states not zeroed", {"_tile_inputs": _unsanitized_tile_inputs}),
        ("slid-back last vocabulary chunk counted twice", {"_chunk_logits": _overlapping_chunk_logits}),
    ],
)
def test_broken_heads_are_caught(
    name: str, patch: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    for attr, fn in patch.items():
        monkeypatch.setattr(lp_mod, attr, fn)
    with pytest.raises(AssertionError):
        _compare(37, 12, 101, 8, 24, 1.0, seed=5)
