"""The fused log-prob head against log_softmax-then-take, in float32 over generated shapes, with MaxText's
logit transforms (tied-embedding scaling, Gemma's final-logit soft cap) and on a four-device mesh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rljob.trainer.logprobs as lp_mod
from hypothesis import example, given, settings
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


def _compare(
    t: int,
    h: int,
    v: int,
    tile: int,
    chunk: int,
    temperature: float,
    seed: int,
    soft_cap: float = 0.0,
    divisor: float = 1.0,
) -> None:
    hidden, w, targets, mask, g = _case(seed, t, h, v)
    if soft_cap:  # logits well past the cap, where tanh bends: the cap's gradient matters
        w = w * 4.0
    clean = jnp.where(mask[:, None], hidden, 0.0)
    safe_t = jnp.where(mask, targets, 0)
    tf = {"temperature": temperature, "soft_cap": soft_cap, "divisor": divisor}

    def fused(hh: jax.Array, ww: jax.Array) -> jax.Array:
        return token_logprobs(hh, ww, targets, mask, token_tile=tile, vocab_chunk=chunk, **tf)

    def naive(hh: jax.Array, ww: jax.Array) -> jax.Array:
        # the reference written out: log_softmax(cap * tanh(logits / divisor / cap) / temperature)
        z = jnp.dot(hh, ww, preferred_element_type=jnp.float32) / divisor
        if soft_cap:
            z = soft_cap * jnp.tanh(z / soft_cap)
        logp = jax.nn.log_softmax(z / temperature, axis=-1)
        return jnp.where(mask, jnp.take_along_axis(logp, safe_t[:, None], axis=-1)[:, 0], 0.0)

    @jax.jit
    def both(hh: jax.Array, cl: jax.Array, ww: jax.Array, gg: jax.Array):  # type: ignore[no-untyped-def]
        lp, vjp = jax.vjp(fused, hh, ww)
        ref, ref_vjp = jax.vjp(naive, cl, ww)
        return lp, ref, vjp(gg), ref_vjp(gg)

    lp, ref, grads, ref_grads = both(hidden, clean, w, g)
    lp_np, ref_np = np.asarray(lp), np.asarray(ref)
    # log p = z_target - logsumexp(z): float32 gets it to a few ulp of the larger of |log p| and the row's
    # |z| (logits near a cap of 30 leave ~2e-6 of rounding in a log-probability near 0): 1e-6 of that, >= 1e-6
    z = np.asarray(clean, dtype=np.float64) @ np.asarray(w, dtype=np.float64) / divisor
    if soft_cap:
        z = soft_cap * np.tanh(z / soft_cap)
    zmax = np.abs(z / temperature).max(axis=1)
    fwd_bound = 1e-6 * np.maximum(np.maximum(1.0, np.abs(ref_np)), zmax)
    assert np.all(np.abs(lp_np - ref_np) <= fwd_bound), (np.abs(lp_np - ref_np) / fwd_bound).max()
    assert (lp_np[~np.asarray(mask)] == 0).all()
    # Each gradient entry is a sum of terms (one per token for dw, one per vocabulary entry for dhidden)
    # whose size is at most |h| |g| (resp. |g| |w|) / (temperature * divisor), since |d log p / d z| <= 1
    # and the cap's derivative is <= 1. Where the terms cancel (a near-certain target), float32 is only
    # good to a few ulp of the terms, not of the small sum: 1e-5 of the largest gradient + ~2 ulp of terms.
    absg = np.abs(np.asarray(g, dtype=np.float64)) * np.asarray(mask) / (temperature * divisor)
    terms = {
        "hidden": absg[:, None] * np.abs(np.asarray(w, dtype=np.float64)).max(axis=1)[None, :] * 2,
        "w": np.abs(np.asarray(clean, dtype=np.float64)).T @ absg[:, None] * np.ones((1, w.shape[1])),
    }
    for got, want, name in zip(grads, ref_grads, ("hidden", "w"), strict=True):
        got_np, want_np = np.asarray(got), np.asarray(want)
        assert np.isfinite(got_np).all(), f"non-finite d{name}"
        scale = np.abs(want_np).max()
        err = np.abs(got_np.astype(np.float64) - want_np)
        bound = 1e-5 * scale + 2.4e-7 * terms[name]
        assert (err <= bound).all(), (name, (err / bound).max())
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


@pytest.mark.parametrize(
    ("soft_cap", "divisor", "temperature"),
    [
        (30.0, 1.0, 1.0),  # Gemma's final_logits_soft_cap
        (2.0, 1.0, 1.0),  # a cap the logits exceed by far (tanh saturated)
        (3.0, 8.0, 1.0),  # tied embeddings: / sqrt(emb_dim), then the cap
        (1.5, 2.0, 0.7),  # and the sampler's temperature after the cap
        (0.0, 8.0, 1.0),  # the scale alone
    ],
)
def test_soft_cap_and_scale_match_the_naive_reference(
    soft_cap: float, divisor: float, temperature: float
) -> None:
    """Forward and backward (hidden and w) of cap * tanh(logits / cap), as MaxText applies it to Gemma's
    tied embedding logits, against the reference written out."""
    _compare(37, 12, 101, 8, 24, temperature, seed=11, soft_cap=soft_cap, divisor=divisor)
    _compare(64, 16, 256, 16, 64, temperature, seed=12, soft_cap=soft_cap, divisor=divisor)


@settings(max_examples=20, deadline=None)
# a near-certain target over two classes: dw is a small sum of cancelling terms
@example(t=9, h=1, v=2, tile=1, chunk=1, temperature=1.0, soft_cap=0.0, seed=0)
# logits near the cap of 30: a log-probability near 0 carries ~2 ulp of 30 of rounding
@example(t=53, h=21, v=128, tile=2, chunk=1, temperature=1.0, soft_cap=30.0, seed=1)
@given(
    t=st.integers(1, 70),
    h=st.integers(1, 24),
    v=st.integers(2, 600),
    tile=st.integers(1, 48),
    chunk=st.integers(1, 700),
    temperature=st.sampled_from([1.0, 0.7]),
    soft_cap=st.sampled_from([0.0, 2.5, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_fused_matches_naive_generated(
    t: int, h: int, v: int, tile: int, chunk: int, temperature: float, soft_cap: float, seed: int
) -> None:
    _compare(t, h, v, tile, max(chunk, 2) if v > 2 else chunk, temperature, seed, soft_cap=soft_cap)


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
    from jax.sharding import Mesh, NamedSharding
    from rljob.trainer.logprobs import (
        LogitTransform, head_spec, padded_vocab, sharded_token_logprobs, token_logprobs,
    )
    assert jax.device_count() == 4
    rng = np.random.default_rng(0)
    B, T, H, V = 4, 18, 8, 37  # 37 columns: padded to 40 on four devices
    hid = jnp.asarray(rng.normal(size=(B, T, H)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(H, V)) * 2, jnp.float32)
    tg = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    m = jnp.asarray(rng.random((B, T)) > 0.2)
    bad = np.argwhere(~np.asarray(m))[0]
    hid = hid.at[tuple(bad)].set(jnp.nan)  # a masked row's non-finite hidden state never leaks
    g = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
    tf = LogitTransform(divisor=2.0, soft_cap=3.0, temperature=0.8)
    kw = dict(token_tile=5, vocab_chunk=3)

    def one(a, b):
        return token_logprobs(
            a.reshape(-1, H), b, tg.reshape(-1), m.reshape(-1),
            temperature=0.8, soft_cap=3.0, divisor=2.0, **kw,
        ).reshape(B, T)

    lp0 = one(hid, w)
    l0, (dh0, dw0) = jax.value_and_grad(lambda a, b: (one(a, b) * g).sum(), (0, 1))(hid, w)
    results = {}
    # (mesh axes, shape, token spec of [B, T], vocab axes): rows over two axes; rows x sequence (a ring
    # over two axes); sequence over context with the vocabulary over tensor; rows over fsdp with the
    # vocabulary over tensor; no token split (vocabulary over every device).
    cases = [
        (("data", "fsdp"), (("data", "fsdp"), None), None),
        (("fsdp", "context"), ("fsdp", "context"), None),
        (("context", "tensor"), (None, "context"), "tensor"),
        (("fsdp", "tensor"), ("fsdp", None), "tensor"),
        (("data", "fsdp"), (None, None), ("data", "fsdp")),
    ]
    for names, spec, vax in cases:
        mesh = Mesh(np.array(jax.devices()).reshape(2, 2), names)
        ring = tuple(a for e in spec for a in ((e,) if isinstance(e, str) else (e or ())))
        vaxes = (vax,) if isinstance(vax, str) else tuple(vax or ())
        wp = jnp.pad(w, ((0, 0), (0, padded_vocab(V, 4) - V)))
        wp = jax.device_put(wp, NamedSharding(mesh, head_spec(vaxes + ring)))
        assert wp.addressable_shards[0].data.shape == (H, 10)  # a quarter of the head on each device
        f = sharded_token_logprobs(mesh, spec, vax, V, transform=tf, grad_w=True, **kw)
        lp = f(hid, wp, tg, m)
        l, (dh, dw) = jax.jit(jax.value_and_grad(lambda a, b: (f(a, b, tg, m) * g).sum(), (0, 1)))(hid, wp)
        name = "/".join(names) + ":" + repr(spec) + ":" + repr(vax)
        results[name] = {
            "lp": float(jnp.abs(lp - lp0).max()),
            "masked_zero": bool((np.asarray(lp)[~np.asarray(m)] == 0).all()),
            "loss": float(abs(l - l0) / abs(l0)),
            "dh": float(jnp.abs(dh - dh0).max() / jnp.abs(dh0).max()),
            "dw": float(jnp.abs(dw[:, :V] - dw0).max() / jnp.abs(dw0).max()),
            "dw_pad": float(jnp.abs(dw[:, V:]).max()),
            "finite": bool(jnp.isfinite(dh).all()),
        }
    import json
    print("RESULTS " + json.dumps(results))
    """
)


def test_sharded_over_four_cpu_devices() -> None:
    """The head on a 2 x 2 CPU mesh in every layout (tokens split over one or two axes, the vocabulary
    over the rest, a padded vocabulary, the soft cap and the scale) against one device: the log-probs,
    the loss and both gradients."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONSAFEPATH": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "RESULTS " in out.stdout, out.stderr[-3000:]
    results = json.loads(out.stdout.split("RESULTS ", 1)[1])
    assert len(results) == 5
    for name, r in results.items():
        # float32 reassociation only (other tile boundaries, cross-device sums)
        assert r["lp"] <= 1e-5 and r["loss"] <= 1e-5 and r["dh"] <= 1e-5 and r["dw"] <= 1e-5, (name, r)
        assert r["masked_zero"] and r["finite"] and r["dw_pad"] == 0.0, (name, r)


def _unsanitized_tile_inputs(hidden, targets, mask, i, tile):  # type: ignore[no-untyped-def]
    s = lp_mod._tile_start(i, tile, hidden.shape[0])
    m = jax.lax.dynamic_slice_in_dim(mask, s, tile) & ((s + jnp.arange(tile)) >= i * tile)
    return (
        s,
        jax.lax.dynamic_slice_in_dim(hidden, s, tile, axis=0),
        jax.lax.dynamic_slice_in_dim(targets, s, tile),
        m,
    )


def _overlapping_chunk_raw(h, w, j, geo, block):  # type: ignore[no-untyped-def]
    raw, c0, col, ok = _real_chunk_raw(h, w, j, geo, block)
    return raw, c0, col, jnp.ones_like(ok)


def _uncapped_gradient(self, raw):  # type: ignore[no-untyped-def]
    return None  # the backward forgets tanh's derivative: dz * 1 / (divisor * temperature)


_real_chunk_raw = lp_mod._chunk_raw


@pytest.mark.parametrize(
    ("name", "patch", "soft_cap"),
    [
        ("masked hidden states not zeroed", {"_tile_inputs": _unsanitized_tile_inputs}, 0.0),
        ("slid-back last vocabulary chunk counted twice", {"_chunk_raw": _overlapping_chunk_raw}, 0.0),
        ("soft cap without its gradient", {"LogitTransform.grad": _uncapped_gradient}, 3.0),
    ],
)
def test_broken_heads_are_caught(
    name: str, patch: dict[str, object], soft_cap: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    for attr, fn in patch.items():
        owner: object = lp_mod
        if "." in attr:
            cls, attr = attr.split(".")
            owner = getattr(lp_mod, cls)
        monkeypatch.setattr(owner, attr, fn)
    with pytest.raises(AssertionError):
        _compare(37, 12, 101, 8, 24, 1.0, seed=5, soft_cap=soft_cap)
