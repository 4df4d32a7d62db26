"""Packed and unpacked rollouts give the same loss and gradients.

A tiny model with segment-aware causal attention (the stand-in for MaxText's segment-id masking)
scores tokens through the fused head; the GRPO loss with per-token weights packed as a field is
then layout-invariant: the same with one rollout per row (``max_segments=1``), packed end-first,
packed start-first, packed balanced (also over generated rollouts) and over several
micro-batches. The trainer's real-model test can reuse ``_loss_on`` with its own ``forward``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rljob.trainer.logprobs import next_token_logprobs
from rljob.trainer.losses import LossConfig, group_advantages, policy_loss, rollout_loss_weights
from rljob.trainer.packing import PackConfig, PackedBatch, Rollout, pack_rollouts

pytestmark = pytest.mark.jax

VOCAB, HID, MAXPOS = 50, 8, 64
Params = dict[str, jax.Array]


def _params(seed: int = 0) -> Params:
    k = jax.random.split(jax.random.key(seed), 5)
    return {
        "embed": jax.random.normal(k[0], (VOCAB, HID)),
        "pos": jax.random.normal(k[1], (MAXPOS, HID)) * 0.3,
        "wq": jax.random.normal(k[2], (HID, HID)) / np.sqrt(HID),
        "wk": jax.random.normal(k[3], (HID, HID)) / np.sqrt(HID),
        "head": jax.random.normal(k[4], (HID, VOCAB)) / np.sqrt(HID),
    }


def forward(p: Params, tokens: jax.Array, seg: jax.Array, pos: jax.Array) -> jax.Array:
    """[B, T] -> hidden [B, T, H]: embedding + in-segment position + one segment-masked causal
    attention layer (keys only from the same segment and not later; padding attends nowhere)."""
    x = p["embed"][tokens] + p["pos"][pos]
    s = jnp.einsum("bqh,bkh->bqk", x @ p["wq"], x @ p["wk"])
    t = tokens.shape[1]
    allowed = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0) & jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(allowed, s, -1e30)
    a = jnp.where(allowed, jax.nn.softmax(s, axis=-1), 0.0)
    return x + a @ x


def _loss_on(
    fwd: Callable[[Params, jax.Array, jax.Array, jax.Array], jax.Array], cfg: LossConfig
) -> Callable[[Params, PackedBatch], jax.Array]:
    """Loss of one micro-batch; the jitted part sees only ``batch.per_token_arrays()``."""

    @jax.jit
    def loss(p: Params, b: dict[str, jax.Array]) -> jax.Array:
        seg, tokens = b["segment_ids"], b["tokens"]
        hidden = fwd(p, tokens, seg, b["positions"])
        lp = next_token_logprobs(hidden, p["head"], tokens, seg, token_tile=7, vocab_chunk=16)
        return policy_loss(
            lp, b["old_logprobs"], b["advantages"], b["loss_weight"], cfg, ref_logprobs=b["ref_logprobs"]
        )[0]

    return lambda p, batch: loss(p, batch.per_token_arrays())


def _rollouts(seed: int, n_groups: int = 2, group_size: int = 4) -> list[Rollout]:
    rng = np.random.default_rng(seed)
    n = n_groups * group_size
    lens = [(int(rng.integers(1, 6)), int(rng.integers(1, 14))) for _ in range(n)]
    rewards = rng.integers(0, 2, n).astype(np.float32)
    rewards[group_size : 2 * group_size] = 1.0  # one group with no signal
    adv = np.asarray(group_advantages(jnp.asarray(rewards), group_size).advantages)
    masks = [(rng.random(c) < 0.85).astype(np.float32) for _, c in lens]
    weights = rollout_loss_weights(masks, "sequence")  # type: ignore[arg-type]
    out = []
    for i, (p, c) in enumerate(lens):
        old = (rng.normal(size=c) * 0.3 - 3.5).astype(np.float32)
        if i == 0:
            old[0] = np.nan  # sampler sentinel: zero weight, no NaN in the gradient
        out.append(
            Rollout(
                rng.integers(1, VOCAB, p),
                rng.integers(1, VOCAB, c),
                advantage=float(adv[i]) + 0.1 * i,
                completion_mask=masks[i],
                per_token={
                    "old_logprobs": old,
                    "ref_logprobs": (rng.normal(size=c) * 0.3 - 3.5).astype(np.float32),
                    "loss_weight": weights[i],
                },
            )
        )
    return out


# The balanced layout at a size the tiny model runs: 2 context ranks, fwd 4 x 8 and dkv 8 x 4 blocks.
BALANCED = PackConfig(
    budget=32,
    rows=2,
    segment_align=4,
    pad_position="balanced",
    pad_align=8,
    context_ranks=2,
    kernel_blocks=((4, 8), (8, 4)),
)


@functools.cache
def _grad_fn(kind: str) -> Callable[[Params, PackedBatch], tuple[jax.Array, Params]]:
    cfg = LossConfig(kind=kind, kl_coef=0.05, clip_low=0.3, clip_high=0.3)  # type: ignore[arg-type]
    out: Callable[[Params, PackedBatch], tuple[jax.Array, Params]] = jax.value_and_grad(
        _loss_on(forward, cfg)
    )
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    n_groups=st.integers(1, 3),
    kind=st.sampled_from(["ppo", "importance_sampling"]),
)
def test_balanced_packed_equals_unpacked_over_generated_rollouts(seed: int, n_groups: int, kind: str) -> None:
    """The balanced layout reorders segments within rows; loss and gradients stay those of one rollout
    per row."""
    params = _params()
    rollouts = _rollouts(seed, n_groups=n_groups)
    grad_fn = _grad_fn(kind)

    def total(batches: list[PackedBatch]) -> tuple[float, Params]:
        loss, grads = 0.0, jax.tree.map(jnp.zeros_like, params)
        for b in batches:
            l_b, g_b = grad_fn(params, b)
            loss, grads = loss + float(l_b), jax.tree.map(jnp.add, grads, g_b)
        return loss, grads

    # unpacked: one rollout per [1, 32] micro-batch (one compiled shape for every example)
    ref_loss, ref_grads = total(pack_rollouts(rollouts, PackConfig(budget=32, max_segments=1)))
    loss, grads = total(pack_rollouts(rollouts, BALANCED))
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    for k in params:
        assert float(jnp.abs(grads[k] - ref_grads[k]).max()) <= 1e-5 * max(scale, 1e-12), k


@pytest.mark.parametrize("kind", ["ppo", "importance_sampling"])
def test_packed_equals_unpacked(kind: str) -> None:
    params = _params()
    rollouts = _rollouts(1)
    cfg = LossConfig(kind=kind, kl_coef=0.05, clip_low=0.3, clip_high=0.3)  # type: ignore[arg-type]
    grad_fn = jax.value_and_grad(_loss_on(forward, cfg))

    def total(batches: list[PackedBatch]) -> tuple[float, Params]:
        loss, grads = 0.0, jax.tree.map(jnp.zeros_like, params)
        for b in batches:  # gradient accumulation over micro-batches is a plain sum
            l_b, g_b = grad_fn(params, b)
            loss, grads = loss + float(l_b), jax.tree.map(jnp.add, grads, g_b)
        return loss, grads

    # unpacked: one rollout per row, padded at the end (the seed's uniform layout), one compile
    longest = max(r.num_tokens for r in rollouts)
    alone = pack_rollouts(rollouts, PackConfig(budget=longest, rows=len(rollouts), max_segments=1))
    assert len(alone) == 1 and (alone[0].num_segments == 1).all()
    ref_loss, ref_grads = total(alone)
    layouts = {
        "end": PackConfig(budget=32, rows=2, segment_align=4),
        "start": PackConfig(budget=32, rows=2, segment_align=4, pad_position="start", pad_align=8),
        "one row per batch": PackConfig(budget=32, rows=1, segment_align=1),
        "balanced": BALANCED,
    }
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref_grads))
    assert scale > 0 and np.isfinite(ref_loss)
    for name, pc in layouts.items():
        batches = pack_rollouts(rollouts, pc)
        assert sum(int(b.num_segments.sum()) for b in batches) == len(rollouts)
        loss, grads = total(batches)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), name
        for k in params:
            err = float(jnp.abs(grads[k] - ref_grads[k]).max())
            assert err <= 1e-5 * scale, (name, k, err / scale)
            assert bool(jnp.isfinite(grads[k]).all())


def test_segment_blind_attention_is_caught() -> None:
    """A deliberately broken model (attention ignores segment ids) makes packed != unpacked."""

    def leaky(p: Params, tokens: jax.Array, seg: jax.Array, pos: jax.Array) -> jax.Array:
        return forward(p, tokens, jnp.where(seg > 0, 1, 0), pos)

    params, rollouts, cfg = _params(), _rollouts(2), LossConfig(kind="importance_sampling")
    loss = _loss_on(leaky, cfg)
    # each rollout alone, without any padding
    ref = sum(
        float(loss(params, pack_rollouts([r], PackConfig(budget=32, segment_align=1))[0])) for r in rollouts
    )
    batches = pack_rollouts(rollouts, PackConfig(budget=32, segment_align=1))
    assert max(int(b.num_segments.max()) for b in batches) > 1
    packed = sum(float(loss(params, b)) for b in batches)
    assert abs(packed - ref) > 1e-4 * abs(ref)
