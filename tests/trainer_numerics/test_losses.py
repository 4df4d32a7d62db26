"""GRPO advantages, policy losses, KL, NaN containment and the non-finite update guard."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rljob.trainer.losses import (
    NAN_SENTINEL,
    LossConfig,
    all_finite,
    group_advantages,
    guard_update,
    k3_kl,
    policy_loss,
    rollout_loss_weights,
    sanitize_logprobs,
    token_weights,
)

pytestmark = pytest.mark.jax


def test_group_advantages_table() -> None:
    rewards = jnp.asarray([1.0, 0.0, 1.0, 0.0, 3.0, 3.0, 3.0, 3.0, 0.0, 0.0, 0.0, 2.0])
    out = group_advantages(rewards, 4, normalization="std", eps=0.0)
    np.testing.assert_allclose(
        np.asarray(out.advantages),
        [1, -1, 1, -1, 0, 0, 0, 0, -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), math.sqrt(3)],
        rtol=1e-6,
    )
    assert np.asarray(out.valid).tolist() == [True] * 4 + [False] * 4 + [True] * 4
    assert int(out.groups_skipped) == 1
    # the default is r - mean (spec.algorithm.advantageNormalization: mean)
    for raw in (group_advantages(rewards, 4), group_advantages(rewards, 4, normalization="mean")):
        np.testing.assert_allclose(
            np.asarray(raw.advantages), [0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0, -0.5, -0.5, -0.5, 1.5]
        )
        assert np.asarray(raw.valid).tolist() == np.asarray(out.valid).tolist()
    with pytest.raises(ValueError, match=r"algorithm\.advantageNormalization"):
        group_advantages(rewards, 4, normalization="rank")  # type: ignore[arg-type]


@pytest.mark.parametrize(("n", "g"), [(6, 4), (4, 0)])
def test_group_advantages_refuses_bad_group_size(n: int, g: int) -> None:
    with pytest.raises(ValueError, match=r"algorithm\.groupSize"):
        group_advantages(jnp.zeros(n), g)


def test_sanitize_table() -> None:
    lp = jnp.asarray([-1.0, jnp.nan, -jnp.inf, jnp.inf, NAN_SENTINEL, -9999.0, -8999.0])
    vals, w = sanitize_logprobs(lp, jnp.ones(7))
    assert np.asarray(vals).tolist() == [-1.0, 0, 0, 0, 0, 0, -8999.0]
    assert np.asarray(w).tolist() == [1, 0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize(
    ("kind", "lp", "old", "adv", "loss", "dloss"),
    [
        # importance sampling: -ratio * A, d/dlp = -ratio * A
        ("importance_sampling", 0.0, 0.0, 2.0, -2.0, -2.0),
        ("importance_sampling", math.log(2), 0.0, 1.0, -2.0, -2.0),
        # PPO: ratio 2 > 1.2 with A > 0 -> clipped, no gradient
        ("ppo", math.log(2), 0.0, 1.0, -1.2, 0.0),
        # ratio 2 with A < 0: the unclipped term is the min -> gradient flows
        ("ppo", math.log(2), 0.0, -1.0, 2.0, 2.0),
        # ratio 0.5 < 0.8 with A < 0 -> clipped at 0.8, no gradient
        ("ppo", math.log(0.5), 0.0, -1.0, 0.8, 0.0),
        # inside the trust region: same as importance sampling
        ("ppo", math.log(1.1), 0.0, 1.0, -1.1, -1.1),
    ],
)
def test_policy_loss_table(kind: str, lp: float, old: float, adv: float, loss: float, dloss: float) -> None:
    cfg = LossConfig(kind=kind)  # type: ignore[arg-type]

    def f(x: jax.Array) -> jax.Array:
        return policy_loss(x, jnp.asarray([old]), jnp.asarray([adv]), jnp.ones(1), cfg)[0]

    val, grad = jax.value_and_grad(f)(jnp.asarray([lp]))
    assert float(val) == pytest.approx(loss, rel=1e-6)
    assert float(grad[0]) == pytest.approx(dloss, rel=1e-6, abs=1e-7)


def test_k3_kl_values_and_penalty() -> None:
    lp = jnp.asarray([-1.0, -2.0, -0.5])
    ref = jnp.asarray([-1.0, -1.0, -1.5])
    kl = np.asarray(k3_kl(lp, ref))
    np.testing.assert_allclose(kl, [0.0, math.e - 1 - 1, math.exp(-1) + 1 - 1], rtol=1e-6)
    cfg = LossConfig(kl_coef=0.5)
    zero_adv = jnp.zeros(3)
    w = jnp.full(3, 1 / 3)
    loss, metrics = policy_loss(lp, lp, zero_adv, w, cfg, ref_logprobs=ref)
    assert float(loss) == pytest.approx(0.5 * kl.mean(), rel=1e-6)
    assert float(metrics["kl"]) == pytest.approx(kl.mean(), rel=1e-6)
    # the KL pulls toward the reference: d/dlp k3 = 1 - exp(ref - lp)
    g = jax.grad(lambda x: policy_loss(x, lp, zero_adv, w, cfg, ref_logprobs=ref)[0])(lp)
    np.testing.assert_allclose(np.asarray(g), 0.5 / 3 * (1 - np.exp(np.asarray(ref - lp))), rtol=1e-5)


def test_nan_sentinels_never_reach_the_gradient() -> None:
    rng = np.random.default_rng(0)
    n = 16
    lp = jnp.asarray(rng.normal(size=n) - 2, jnp.float32)
    old = np.asarray(rng.normal(size=n) - 2, np.float32)
    old[[1, 5, 9]] = [np.nan, -np.inf, -9999.0]
    ref = np.asarray(rng.normal(size=n) - 2, np.float32)
    ref[[3]] = np.nan
    mask = np.ones(n, np.float32)
    mask[12] = 0.0
    new_lp = lp.at[12].set(jnp.nan)  # a masked position whose log-prob is garbage
    adv = jnp.asarray(rng.normal(size=n), jnp.float32)
    for kind in ("importance_sampling", "ppo"):
        cfg = LossConfig(kind=kind, kl_coef=0.1)
        loss, g = jax.value_and_grad(
            lambda x, c=cfg: policy_loss(
                x, jnp.asarray(old), adv, jnp.asarray(mask) / n, c, jnp.asarray(ref)
            )[0]
        )(new_lp)
        g_np = np.asarray(g)
        assert np.isfinite(float(loss)) and np.isfinite(g_np).all()
        assert (g_np[[1, 3, 5, 9, 12]] == 0).all()
        _, metrics = policy_loss(new_lp, jnp.asarray(old), adv, jnp.asarray(mask), cfg, jnp.asarray(ref))
        assert int(metrics["tokens"]) == n - 5


def test_token_weights_modes() -> None:
    mask = jnp.asarray([[1, 1, 0, 1], [1, 0, 0, 0]], jnp.float32)
    idx = jnp.asarray([[0, 0, -1, 1], [2, 3, -1, -1]], jnp.int32)
    tok = np.asarray(token_weights(mask, idx, 4, "token"))
    np.testing.assert_allclose(tok, np.asarray(mask) / 4)
    seq = np.asarray(token_weights(mask, idx, 4, "sequence"))
    # rollouts 0, 1, 2 have tokens (3 sequences); rollout 0 has 2 tokens
    np.testing.assert_allclose(seq, [[1 / 6, 1 / 6, 0, 1 / 3], [1 / 3, 0, 0, 0]], rtol=1e-6)
    host = rollout_loss_weights([[1, 1], [1], [1], [0]], "sequence")
    np.testing.assert_allclose(np.concatenate(host), [1 / 6, 1 / 6, 1 / 3, 1 / 3, 0], rtol=1e-6)
    with pytest.raises(ValueError, match=r"^loss weights mode: 'token' or 'sequence', got 'bogus'$"):
        token_weights(mask, idx, 4, "bogus")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "grpo"}, "algorithm.loss"),
        ({"kl_coef": -1.0}, "klPenaltyCoef"),
        ({"clip_low": -0.1}, r"^LossConfig clip_low, clip_high: must be >= 0, got -0.1, 0.2$"),
    ],
)
def test_loss_config_refuses(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LossConfig(**kwargs)  # type: ignore[arg-type]


def test_guard_skips_non_finite_updates() -> None:
    old = {"a": jnp.ones(3), "b": {"c": jnp.zeros((2, 2))}}
    good = jax.tree.map(lambda x: x + 1, old)
    bad = {"a": jnp.asarray([1.0, jnp.nan, 2.0]), "b": {"c": jnp.zeros((2, 2))}}
    assert bool(all_finite(good)) and not bool(all_finite(bad))
    assert not bool(all_finite({"x": jnp.asarray(jnp.inf)}))
    assert bool(all_finite({}))

    @jax.jit
    def step(params, update, skipped):  # type: ignore[no-untyped-def]
        ok = all_finite(update)
        new = jax.tree.map(jnp.add, params, update)
        return guard_update(ok, new, params), skipped + (~ok).astype(jnp.int32)

    p1, s1 = step(old, good, jnp.int32(0))
    p2, s2 = step(p1, bad, s1)
    assert int(s1) == 0 and int(s2) == 1
    np.testing.assert_array_equal(np.asarray(p2["a"]), np.asarray(p1["a"]))
    assert bool(all_finite(p2))
