"""The compiled step on the real tiny model: NaN containment, skip counting, layout invariance."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from rljob.trainer.losses import NAN_SENTINEL
from rljob.trainer.packing import Rollout
from rljob.trainer.runtime import synthetic_rollouts
from rljob.trainer.train_step import StepConfig, Trainer

pytestmark = pytest.mark.jax


def _finite(tree: Any) -> bool:
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.array(x), tree)


@pytest.fixture(scope="module")
def trainer(tiny_policy: Any) -> Trainer:
    return Trainer(
        tiny_policy,
        StepConfig(budget=64, rows=2, micro_batches=2, learning_rate=1e-2, token_tile=32, vocab_chunk=128),
    )


def _small_batch(trainer: Trainer) -> list[Rollout]:
    rollouts, _ = synthetic_rollouts(
        0,
        seed=3,
        vocab_size=trainer.policy.vocab_size,
        groups=2,
        group_size=2,
        max_prompt=8,
        max_completion=12,
    )
    return rollouts


def test_nan_injection_leaves_parameters_finite(trainer: Trainer) -> None:
    rollouts = _small_batch(trainer)
    state = trainer.init_state()
    # 1. sampler sentinels and NaN/inf old log-probs are masked: the update is applied and finite.
    poisoned = []
    for i, r in enumerate(rollouts):
        old = np.array(r.per_token["old_logprobs"])
        old[i % old.size] = [np.nan, -np.inf, NAN_SENTINEL - 1, np.inf][i % 4]
        poisoned.append(Rollout(r.prompt_ids, r.completion_ids, r.advantage, per_token={"old_logprobs": old}))
    before = _copy(state.lora)
    state, m = trainer.train_on_batch(state, poisoned)
    assert m["update_skipped"] == 0 and int(state.skipped) == 0 and int(state.step) == 1
    assert _finite(state.lora) and _finite(state.opt_state)
    assert any(
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.lora), strict=True)
    )
    # 2. a non-finite advantage makes the gradient non-finite: the update is skipped and counted,
    #    parameters and optimizer state stay exactly as they were.
    bad = [
        Rollout(
            r.prompt_ids, r.completion_ids, float("nan") if i == 1 else r.advantage, per_token=r.per_token
        )
        for i, r in enumerate(rollouts)
    ]
    before, opt_before = _copy(state.lora), _copy(state.opt_state)
    state, m = trainer.train_on_batch(state, bad)
    assert m["update_skipped"] == 1 and int(state.skipped) == 1 and int(state.step) == 2
    assert _finite(state.lora) and _finite(state.opt_state)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.lora), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    for a, b in zip(jax.tree.leaves(opt_before), jax.tree.leaves(state.opt_state), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    # 3. training continues normally afterwards.
    state, m = trainer.train_on_batch(state, rollouts)
    assert m["update_skipped"] == 0 and int(state.skipped) == 1 and _finite(state.lora)


def test_accumulation_calls_do_not_change_the_update(tiny_policy: Any, trainer: Trainer) -> None:
    """The same rollouts through 1 accumulate call of 4 micro-batches or 4 calls of 1: same update."""
    rollouts, _ = synthetic_rollouts(
        1, seed=5, vocab_size=tiny_policy.vocab_size, groups=2, group_size=4, max_prompt=10, max_completion=20
    )
    one = Trainer(
        tiny_policy,
        StepConfig(budget=64, rows=1, micro_batches=8, learning_rate=1e-2, token_tile=32, vocab_chunk=128),
    )
    many = Trainer(
        tiny_policy,
        StepConfig(budget=64, rows=1, micro_batches=1, learning_rate=1e-2, token_tile=32, vocab_chunk=128),
    )
    s1, m1 = one.train_on_batch(one.init_state(), rollouts)
    s2, m2 = many.train_on_batch(many.init_state(), rollouts)
    assert m1["accumulate_calls"] == 1 and m2["accumulate_calls"] == m2["micro_batches"] > 1
    assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
    for a, b in zip(jax.tree.leaves(s1.lora), jax.tree.leaves(s2.lora), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_step_without_signal_makes_no_update_and_says_so(trainer: Trainer) -> None:
    """Every group of a step had equal rewards, so the loop hands over no rollouts: the step counts (a
    resumed run continues after it), parameters and optimizer state stay, and the metrics say why."""
    state = trainer.init_state()
    before, opt_before = _copy(state.lora), _copy(state.opt_state)
    state, m = trainer.train_on_batch(state, [])
    assert m["no_signal"] == 1 and m["update_skipped"] == 0 and m["tokens"] == 0
    assert m["micro_batches"] == 0 and m["accumulate_calls"] == 0
    assert int(state.step) == 1 and int(state.skipped) == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.lora), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    for a, b in zip(jax.tree.leaves(opt_before), jax.tree.leaves(state.opt_state), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    rollouts = _small_batch(trainer)
    assert rollouts
    state, m = trainer.train_on_batch(state, rollouts)
    assert m["no_signal"] == 0 and int(state.step) == 2
    assert any(
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.lora), strict=True)
    )


KL_COEF = 0.5


def _kl_against_naive(policy: Any) -> dict[str, float]:
    """The KL penalty of the compiled step's micro-batch loss (the loss and gradient with kl_coef minus
    without) against the k3 penalty written out from full log-softmax log-probs of the policy and of the
    base policy (every LoRA factor 0); returns the relative errors and the KL."""
    import jax.numpy as jnp
    from rljob.trainer.logprobs import next_token_targets, shift_to_tokens
    from rljob.trainer.losses import LossConfig
    from rljob.trainer.packing import pack_rollouts
    from rljob.trainer.train_step import stack_micro_batches

    shape = {"budget": 64, "rows": 2, "micro_batches": 1, "token_tile": 16, "vocab_chunk": 96}
    with_kl = Trainer(policy, StepConfig(**shape, loss=LossConfig(kl_coef=KL_COEF)))  # type: ignore[arg-type]
    without = Trainer(policy, StepConfig(**shape))  # type: ignore[arg-type]
    rollouts, _ = synthetic_rollouts(
        2, seed=7, vocab_size=policy.vocab_size, groups=3, group_size=4, max_prompt=10, max_completion=16
    )
    assert rollouts
    call = stack_micro_batches(pack_rollouts(rollouts, with_kl.cfg.pack_config())[:1], 1)[0]
    mb = {k: jnp.asarray(v[0]) for k, v in call.items()}
    rng = np.random.default_rng(4)  # an adapter far enough from 0 for a KL well above rounding
    lora = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), jnp.float32), policy.lora0)

    def step_loss(t: Trainer) -> tuple[Any, Any]:
        return jax.value_and_grad(t.micro_loss, has_aux=True)(lora, mb)

    (l1, m1), g1 = step_loss(with_kl)
    (l0, _), g0 = step_loss(without)

    def logprobs(lo: Any) -> jax.Array:
        logp = jax.nn.log_softmax(policy.logits(lo, mb["tokens"], mb["positions"], mb["segment_ids"]), -1)
        tg, valid = next_token_targets(mb["tokens"], mb["segment_ids"])
        return shift_to_tokens(jnp.where(valid, jnp.take_along_axis(logp, tg[..., None], -1)[..., 0], 0.0))

    def naive_kl(lo: Any) -> jax.Array:
        lp = logprobs(lo)
        ref = jax.lax.stop_gradient(logprobs(jax.tree.map(jnp.zeros_like, lo)))
        old = mb["old_logprobs"]
        w = jnp.where(jnp.isfinite(old) & (old > -9000.0), mb["weights"], 0.0)  # sentinel tokens: no weight
        d = ref - lp
        return (w * (jnp.exp(d) - d - 1.0)).sum()

    kl, gkl = jax.value_and_grad(naive_kl)(lora)
    err = {"kl": float(kl), "metric": abs(float(m1["kl"]) - float(kl)) / float(kl)}
    err["loss"] = abs(float(l1 - l0) - KL_COEF * float(kl)) / (KL_COEF * float(kl))
    scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(gkl)) * KL_COEF
    err["grad"] = max(
        float(jnp.abs((a - b) - KL_COEF * c).max()) / scale
        for a, b, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), jax.tree.leaves(gkl), strict=True)
    )
    return err


def test_kl_penalty_value_and_gradient_match_a_naive_reference(tiny_policy: Any) -> None:
    """spec.algorithm.klPenaltyCoef > 0: the trainer computes the base policy's log-probs (the adapter off)
    of the same packed rows and adds kl_coef x k3 KL per token; its value (metric and loss) and its
    gradient equal the penalty written out from full log-softmax log-probs."""
    err = _kl_against_naive(tiny_policy)
    print("kl penalty vs naive", err)
    assert err["kl"] > 1e-3, err  # the adapter moved the policy: a penalty worth checking
    assert err["metric"] <= 1e-5 and err["loss"] <= 1e-4 and err["grad"] <= 1e-5, err


def test_kl_against_the_policy_itself_is_caught(tiny_policy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken variant: the reference log-probs taken with the adapter on (the policy itself) give a zero
    penalty, which the comparison with the naive reference refuses."""
    monkeypatch.setattr(tiny_policy, "zero_lora", lambda lora: lora)
    err = _kl_against_naive(tiny_policy)
    assert err["metric"] > 0.5 and err["grad"] > 0.1, err


def test_the_base_is_put_in_the_layouts_the_compiled_step_chose(tiny_policy: Any) -> None:
    """The step compiles with the base weights' layouts left to the compiler (Layout.AUTO) and then puts the
    policy's base in the layouts it chose, once. Here the base's stacked layer kernels start in a layout
    the CPU compiler does not choose (layer axis minor to major reversed): the first step moves them into
    the compiled step's layouts, keeps every other array as it is, and trains as from the default
    layout."""
    from jax.experimental.layout import Format, Layout

    cfg = StepConfig(budget=64, rows=2, micro_batches=2, learning_rate=1e-2, token_tile=32, vocab_chunk=128)
    rollouts = _small_batch(Trainer(tiny_policy, cfg))
    ref = Trainer(tiny_policy, cfg)
    want, _ = ref.train_on_batch(ref.init_state(), rollouts)

    stash = tiny_policy.base
    flat, treedef = jax.tree.flatten(stash)
    odd = [i for i, x in enumerate(flat) if x.ndim == 3]
    assert odd, "the tiny model has stacked (scanned) layer kernels"

    def reversed_layout(x: Any) -> Any:
        return jax.device_put(x, Format(Layout(major_to_minor=tuple(range(x.ndim))[::-1]), x.sharding))

    moved = [reversed_layout(x) if i in odd else x for i, x in enumerate(flat)]
    try:
        tiny_policy.base = jax.tree.unflatten(treedef, moved)
        assert all(moved[i].format.layout != flat[i].format.layout for i in odd)
        trainer = Trainer(tiny_policy, cfg)
        got, _ = trainer.train_on_batch(trainer.init_state(), rollouts)
        formats = jax.tree.leaves(trainer._accumulate_compiled.input_formats[0][2])
        after = jax.tree.leaves(tiny_policy.base)
        # A second step reads the laid-out base as it is: no array of it is copied again.
        got, _ = trainer.train_on_batch(got, rollouts)
        assert all(x is y for x, y in zip(after, jax.tree.leaves(tiny_policy.base), strict=True))
        for i, (x, f) in enumerate(zip(after, formats, strict=True)):
            assert f.layout is None or x.format.layout == f.layout, i  # None: a PRNG key's, no layout
            assert (x is moved[i]) == (i not in odd), i  # only the arrays that were laid out otherwise moved
            if i in odd:
                np.testing.assert_array_equal(np.asarray(x), np.asarray(flat[i]))
        want, _ = ref.train_on_batch(want, rollouts)
        for a, b in zip(jax.tree.leaves(want.lora), jax.tree.leaves(got.lora), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    finally:
        tiny_policy.base = stash
