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


def test_nan_injection_leaves_parameters_finite(trainer: Trainer) -> None:
    rollouts, _ = synthetic_rollouts(
        0,
        seed=3,
        vocab_size=trainer.policy.vocab_size,
        groups=2,
        group_size=2,
        max_prompt=8,
        max_completion=12,
    )
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
