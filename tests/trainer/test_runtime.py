"""The run loop in-process on the tiny model: graded rollouts are cached before the gradient step, so
a run that dies in the middle of a step resumes without sampling that step again."""

from __future__ import annotations

import io
import json
from typing import Any

import jax
import numpy as np
import pytest
from rljob.trainer.export import latest_version, read_adapter
from rljob.trainer.progress import Reporter, StepLog
from rljob.trainer.runtime import RunPaths, RunSettings, run, synthetic_rollouts
from rljob.trainer.storage import open_store
from rljob.trainer.train_step import StepConfig, Trainer

pytestmark = pytest.mark.jax


class _Died(Exception):
    pass


def test_restart_mid_step_skips_sampling(tiny_policy: Any, gcs_bucket: str) -> None:
    root = f"{gcs_bucket}/team/job"
    paths = RunPaths(f"{root}/checkpoints", f"{root}/adapters", f"{root}/rollouts")
    trainer = Trainer(
        tiny_policy,
        StepConfig(budget=64, rows=2, micro_batches=4, learning_rate=1e-2, token_tile=32, vocab_chunk=128),
    )
    sampled: list[int] = []

    def source(step: int, lora: Any) -> tuple[list[Any], dict[str, float]]:
        sampled.append(step)
        return synthetic_rollouts(
            step,
            seed=11,
            vocab_size=tiny_policy.vocab_size,
            groups=2,
            group_size=2,
            max_prompt=8,
            max_completion=16,
        )

    real = trainer.train_on_batch
    calls = {"n": 0}

    def dies_on_third(state: Any, rollouts: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Died("preempted in the middle of step 2")
        return real(state, rollouts)

    trainer.train_on_batch = dies_on_third  # type: ignore[method-assign]
    out1 = io.StringIO()
    with pytest.raises(_Died):
        run(
            trainer,
            paths,
            RunSettings(steps=4),
            source,
            steplog=StepLog(stream=out1),
            reporter=Reporter(None),
            to_peft=tiny_policy.to_peft,
            peft_config=tiny_policy.peft_config(),
        )
    assert sampled == [0, 1, 2]
    assert open_store(paths.rollouts).list() == [f"step-{s:08d}.npz" for s in range(3)]
    assert latest_version(paths.adapters) == 2
    trainer.train_on_batch = real  # type: ignore[method-assign]
    out2 = io.StringIO()
    run(
        trainer,
        paths,
        RunSettings(steps=4),
        source,
        steplog=StepLog(stream=out2),
        reporter=Reporter(None),
        to_peft=tiny_policy.to_peft,
        peft_config=tiny_policy.peft_config(),
    )
    assert sampled == [0, 1, 2, 3]  # step 2 came from the cache
    events = [json.loads(x) for x in out2.getvalue().splitlines()]
    assert (events[0]["event"], events[0]["step"]) == ("resume", 2)
    steps = {e["step"]: e for e in events if e["event"] == "step"}
    assert steps[3]["rollouts_from_cache"] == 1.0 and steps[4]["rollouts_from_cache"] == 0.0
    # Same parameters as an uninterrupted run.
    straight_root = f"{gcs_bucket}/team/straight"
    sp = RunPaths(f"{straight_root}/checkpoints", f"{straight_root}/adapters", f"{straight_root}/rollouts")
    final = run(
        trainer,
        sp,
        RunSettings(steps=4),
        source,
        steplog=StepLog(stream=io.StringIO()),
        reporter=Reporter(None),
        to_peft=tiny_policy.to_peft,
        peft_config=tiny_policy.peft_config(),
    )
    a, _ = read_adapter(paths.adapters, 4)
    b = tiny_policy.to_peft(final.lora)
    for k in b:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert int(final.step) == 4 and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(final.lora))
