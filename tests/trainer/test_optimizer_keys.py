"""What the trainer does with the keys it honours (rljob.recipes.maxtext_policy TRAINER_KEYS) and with
spec.algorithm's schedule, on the real tiny model: the learning rate per step, AdamW's hyper-parameters,
gradient accumulation equal to one big batch, checkpoints every checkpoint_period steps with an exact
resume, and a profile trace on storage."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fixtures.trainer_run import local_run_config
from rljob.common.storage import open_store
from rljob.trainer.checkpoint import Checkpointer
from rljob.trainer.export import read_adapter
from rljob.trainer.profiling import ProfileSettings
from rljob.trainer.progress import Reporter, StepLog
from rljob.trainer.runtime import RunPaths, RunSettings, run, synthetic_rollouts
from rljob.trainer.train_step import StepConfig, Trainer, learning_rate_at

TESTED_MODULES = ("rljob.trainer.profiling",)

pytestmark = pytest.mark.jax

BASE = {"budget": 64, "rows": 1, "micro_batches": 2, "token_tile": 32, "vocab_chunk": 128}
LR = 1e-2


def _cfg(**kw: Any) -> StepConfig:
    return StepConfig(**{**BASE, "learning_rate": LR, **kw})


def _rates(cfg: StepConfig, n: int) -> list[float]:
    return [float(learning_rate_at(cfg, s)) for s in range(n)]


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, [LR] * 5),
        ({"warmup_steps": 3, "total_steps": 6}, [LR / 4, LR / 2, 3 * LR / 4, LR, LR, LR]),
        # linear: from LR at step 3 towards 0 after the last step (5): 3 steps of decay
        (
            {"warmup_steps": 3, "lr_schedule": "linear", "total_steps": 6},
            [LR / 4, LR / 2, 3 * LR / 4, LR, 2 * LR / 3, LR / 3],
        ),
        ({"lr_schedule": "linear", "total_steps": 4}, [LR, 3 * LR / 4, LR / 2, LR / 4]),
        (
            {"lr_schedule": "cosine", "total_steps": 4},
            [LR * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)],
        ),
        # a warm-up as long as the run: no decay left
        ({"warmup_steps": 4, "lr_schedule": "cosine", "total_steps": 4}, [LR * s / 5 for s in range(1, 5)]),
    ],
)
def test_learning_rate_per_step(kw: dict[str, Any], expected: list[float]) -> None:
    got = _rates(_cfg(**kw), len(expected))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert min(got) > 0  # no step trains at rate 0


def _rollouts(policy: Any, step: int, seed: int = 5) -> list[Any]:
    while True:
        out, _ = synthetic_rollouts(
            step,
            seed=seed,
            vocab_size=policy.vocab_size,
            groups=2,
            group_size=4,
            max_prompt=10,
            max_completion=20,
        )
        if out:
            return out
        seed += 1000


def test_the_step_trains_at_the_scheduled_rate(tiny_policy: Any) -> None:
    """The train state's step count drives the rate: the metrics of four steps of a warm-up of 2 then a
    linear decay, and the update of step 0 is the warm-up's share of a full-rate update."""
    cfg = _cfg(warmup_steps=2, lr_schedule="linear", total_steps=4)
    trainer = Trainer(tiny_policy, cfg)
    state = trainer.init_state()
    lrs = []
    for s in range(4):
        state, m = trainer.train_on_batch(state, _rollouts(tiny_policy, s))
        lrs.append(m["learning_rate"])
    np.testing.assert_allclose(lrs, [LR / 3, 2 * LR / 3, LR, LR / 2], rtol=1e-6)
    # Step 0 at LR/3 moves the parameters a third as far as a constant-rate step (Adam's first update is
    # the same direction whatever the rate).
    flat = Trainer(tiny_policy, _cfg())
    lora0 = jax.tree.map(np.asarray, tiny_policy.lora0)
    warm, _ = trainer.train_on_batch(trainer.init_state(), _rollouts(tiny_policy, 0))
    full, _ = flat.train_on_batch(flat.init_state(), _rollouts(tiny_policy, 0))
    for w, f, p in zip(
        jax.tree.leaves(warm.lora), jax.tree.leaves(full.lora), jax.tree.leaves(lora0), strict=True
    ):
        np.testing.assert_allclose(np.asarray(w) - p, (np.asarray(f) - p) / 3, atol=1e-7)


def test_adam_keys_give_optax_adamws_update(tiny_policy: Any) -> None:
    """adam_b1/b2/eps/weight_decay, no clipping (gradient_clipping_threshold 0): two steps equal optax.adamw
    with those hyper-parameters applied to the same accumulated gradients."""
    hp = {"adam_b1": 0.5, "adam_b2": 0.95, "adam_eps": 1e-6, "weight_decay": 0.1}
    trainer = Trainer(tiny_policy, _cfg(max_grad_norm=0.0, **hp))
    ref = optax.adamw(LR, b1=0.5, b2=0.95, eps=1e-6, weight_decay=0.1)
    state = trainer.init_state()
    params = jax.tree.map(jnp.array, tiny_policy.lora0)
    ref_state = ref.init(params)
    for s in range(2):
        packed_calls = trainer.cfg.pack_config()
        from rljob.trainer.packing import pack_rollouts
        from rljob.trainer.train_step import stack_micro_batches

        acc = trainer.zero_acc(state.lora)
        for call in stack_micro_batches(pack_rollouts(_rollouts(tiny_policy, s), packed_calls), 2):
            acc = trainer.accumulate(acc, state.lora, tiny_policy.base, trainer.device_batch(call))
        grads = jax.tree.map(np.asarray, acc[0])
        state, _ = trainer.apply(state, acc)
        upd, ref_state = ref.update(grads, ref_state, params)
        params = optax.apply_updates(params, upd)
        for a, b in zip(jax.tree.leaves(state.lora), jax.tree.leaves(params), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_equals_one_big_batch(tiny_policy: Any) -> None:
    """The same rollouts as one micro-batch of all rows, or accumulated over one-row micro-batches,
    gradient_accumulation_steps 1 or 3 per compiled call: the same loss and the same update."""
    rollouts = _rollouts(tiny_policy, 1)
    big = Trainer(tiny_policy, _cfg(rows=len(rollouts), micro_batches=1, max_segments=1))
    s_big, m_big = big.train_on_batch(big.init_state(), rollouts)
    assert m_big["micro_batches"] == 1
    for ga in (1, 3):
        small = Trainer(tiny_policy, _cfg(rows=1, micro_batches=ga, max_segments=1))
        s, m = small.train_on_batch(small.init_state(), rollouts)
        assert m["micro_batches"] == len(rollouts) and m["accumulate_calls"] == math.ceil(len(rollouts) / ga)
        assert m["loss"] == pytest.approx(m_big["loss"], abs=1e-6)
        assert m["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-4)
        for a, b in zip(jax.tree.leaves(s.lora), jax.tree.leaves(s_big.lora), strict=True):
            # rtol: AdamW divides by sqrt(v), so a float32 gradient summed in another order (another CPU's
            # codegen: 4.2e-6 on an update of 0.0098 seen) moves an update by 1e-4 of itself; a wrong
            # accumulation moves it by its whole size.
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=2e-6)


def test_grad_dtype_sets_the_gradient_buffer(tiny_policy: Any) -> None:
    trainer = Trainer(tiny_policy, _cfg(grad_dtype="bfloat16", mu_dtype="bfloat16"))
    state = trainer.init_state()
    grads, _ = trainer.zero_acc(state.lora)
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype("bfloat16")}
    mu = state.opt_state[1].mu
    assert {x.dtype for x in jax.tree.leaves(mu)} == {jnp.dtype("bfloat16")}
    state, m = trainer.train_on_batch(state, _rollouts(tiny_policy, 0))
    assert m["update_skipped"] == 0 and all(
        np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.lora)
    )


def _run(trainer: Trainer, root: str, settings: RunSettings, policy: Any, die_at: int | None = None) -> Any:
    paths = RunPaths(f"{root}/checkpoints", f"{root}/adapters", f"{root}/rollouts")
    real = trainer.train_on_batch
    calls = {"n": 0}

    def maybe_die(state: Any, rollouts: Any) -> Any:
        if calls["n"] == die_at:
            raise RuntimeError("preempted")
        calls["n"] += 1
        return real(state, rollouts)

    trainer.train_on_batch = maybe_die  # type: ignore[method-assign]
    try:
        return run(
            trainer,
            paths,
            settings,
            lambda s, lora: synthetic_rollouts(
                s, seed=7, vocab_size=policy.vocab_size, groups=2, group_size=2
            ),
            steplog=StepLog(stream=io.StringIO()),
            reporter=Reporter(None),
            to_peft=policy.peft.to_peft,
            peft_config=policy.peft.config(),
        )
    finally:
        trainer.train_on_batch = real  # type: ignore[method-assign]


def test_checkpoint_period_and_exact_resume(tiny_policy: Any, tmp_path: Path) -> None:
    """checkpoint_period 2 over 5 steps: checkpoints after steps 2, 4 and the last; a run killed in step
    index 3 resumes from checkpoint 2, trains steps 2 and 3 again on their cached rollouts, and ends with
    the parameters of an uninterrupted run."""
    trainer = Trainer(tiny_policy, _cfg(warmup_steps=2, lr_schedule="cosine", total_steps=5))
    settings = RunSettings(steps=5, checkpoint_every=2)
    root = str(tmp_path / "killed")
    with pytest.raises(RuntimeError, match="preempted"):
        _run(trainer, root, settings, tiny_policy, die_at=3)
    assert Checkpointer(f"{root}/checkpoints").all_steps() == [2]
    resumed = _run(trainer, root, settings, tiny_policy)
    assert Checkpointer(f"{root}/checkpoints").all_steps() == [2, 4, 5]
    straight = _run(trainer, str(tmp_path / "straight"), settings, tiny_policy)
    assert Checkpointer(str(tmp_path / "straight" / "checkpoints")).all_steps() == [2, 4, 5]
    assert int(resumed.step) == int(straight.step) == 5
    for a, b in zip(jax.tree.leaves(resumed.lora), jax.tree.leaves(straight.lora), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    a, _ = read_adapter(f"{root}/adapters", 5)
    b, _ = read_adapter(str(tmp_path / "straight" / "adapters"), 5)
    for k in b:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_profiled_steps_leave_an_xplane_trace_on_storage(tiny_policy: Any, gcs_bucket: str) -> None:
    """profiler xplane, skip 1, 2 steps: one trace of steps 1..2 under the TensorBoard directory's
    plugins/profile/<run>/, the layout TensorBoard's profile plugin and XProf read."""
    trainer = Trainer(tiny_policy, _cfg())
    tb = f"{gcs_bucket}/team/prof/tensorboard"
    settings = RunSettings(steps=4, profile=ProfileSettings(first=1, count=2, dest=tb))
    _run(trainer, f"{gcs_bucket}/team/prof", settings, tiny_policy)
    files = open_store(tb).list("plugins/profile/")
    traces = [f for f in files if f.endswith(".xplane.pb")]
    assert len(traces) == 1, files
    run_dir = traces[0].split("/")[2]
    assert (
        traces[0].startswith(f"plugins/profile/{run_dir}/") and len(open_store(tb).read(traces[0]) or b"") > 0
    )


def test_run_config_keys_reach_the_step_and_the_loop(tmp_path: Path) -> None:
    """The MaxText keys and spec.algorithm's schedule of a run config, as rljob-trainer reads them."""
    from rljob.trainer.main import checkpoint_every, optimizer_options, profile

    rc = local_run_config(str(tmp_path), tmp_path)
    keys = {
        **rc.trainer.maxtext,
        "gradient_accumulation_steps": 3,
        "checkpoint_period": 7,
        "profiler": "xplane",
        "profiler_steps": 2,
        "adam_b1": 0.5,
        "gradient_clipping_threshold": 0,
        "grad_dtype": "bfloat16",
    }
    alg = rc.spec.algorithm.model_copy(update={"warmup_steps": 2, "learning_rate_schedule": "cosine"})
    rc = rc.model_copy(
        update={
            "trainer": rc.trainer.model_copy(update={"maxtext": keys}),
            "spec": rc.spec.model_copy(update={"algorithm": alg}),
        }
    )
    opts = optimizer_options(rc, steps=9)
    assert {k: opts[k] for k in ("micro_batches", "adam_b1", "max_grad_norm", "grad_dtype", "mu_dtype")} == {
        "micro_batches": 3,
        "adam_b1": 0.5,
        "max_grad_norm": 0.0,
        "grad_dtype": "bfloat16",
        "mu_dtype": None,
    }
    assert (opts["warmup_steps"], opts["lr_schedule"], opts["total_steps"]) == (2, "cosine", 9)
    assert (opts["learning_rate"], opts["adam_b2"], opts["weight_decay"]) == (0.01, 0.999, 0.0)
    assert checkpoint_every(rc, None) == 7 and checkpoint_every(rc, 2) == 2
    assert profile(rc, None) == ProfileSettings(first=1, count=2, dest=rc.storage.tensorboard)
    assert rc.storage.profile == f"{rc.storage.tensorboard}/plugins/profile"
    plain = local_run_config(str(tmp_path), tmp_path)
    assert optimizer_options(plain, steps=4)["micro_batches"] == 4 and checkpoint_every(plain, None) == 1
    assert profile(plain, None) is None
    assert dataclasses.asdict(StepConfig(budget=8, **optimizer_options(plain, steps=4)))["adam_b1"] == 0.9
    json.dumps(opts)  # plain values
