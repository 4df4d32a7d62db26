"""The run loop in-process on the tiny model: graded rollouts are cached before the gradient step, so
a run that dies in the middle of a step resumes without sampling that step again."""

from __future__ import annotations

import io
import json
from typing import Any

import jax
import numpy as np
import pytest
from rljob.common.storage import open_store
from rljob.trainer.export import latest_version, read_adapter
from rljob.trainer.progress import Reporter, StepLog
from rljob.trainer.runtime import RunPaths, RunSettings, run, synthetic_rollouts
from rljob.trainer.train_step import StepConfig, Trainer

pytestmark = pytest.mark.jax


class _Died(Exception):
    pass


def _small_rollouts(policy: Any, step: int, seed: int) -> tuple[list[Any], dict[str, float]]:
    return synthetic_rollouts(
        step, seed=seed, vocab_size=policy.vocab_size, groups=2, group_size=2, max_prompt=8, max_completion=16
    )


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
        return _small_rollouts(tiny_policy, step, seed=11)

    real = trainer.train_on_batch
    calls = {"n": 0}

    def dies_on_third(state: Any, rollouts: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Died("preempted in the middle of step 2")
        return real(state, rollouts)

    trainer.train_on_batch = dies_on_third  # type: ignore[method-assign]
    out1 = io.StringIO()
    ran: list[int] = []  # the train_on_batch calls made when programs_ran was called
    with pytest.raises(_Died):
        run(
            trainer,
            paths,
            RunSettings(steps=4),
            source,
            steplog=StepLog(stream=out1),
            reporter=Reporter(None),
            to_peft=tiny_policy.peft.to_peft,
            peft_config=tiny_policy.peft.config(),
            programs_ran=lambda: ran.append(calls["n"]),
        )
    assert ran == [1]  # once, after the first step's programs ran
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
        to_peft=tiny_policy.peft.to_peft,
        peft_config=tiny_policy.peft.config(),
        programs_ran=lambda: ran.append(-1),
    )
    assert ran == [1, -1]  # the resumed attempt's first step (step 2) too
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
        to_peft=tiny_policy.peft.to_peft,
        peft_config=tiny_policy.peft.config(),
    )
    a, _ = read_adapter(paths.adapters, 4)
    b = tiny_policy.peft.to_peft(final.lora)
    for k in b:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert int(final.step) == 4 and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(final.lora))


def _nan_source(tiny_policy: Any, bad_steps: set[int], empty_steps: frozenset[int] = frozenset()) -> Any:
    """Synthetic rollouts with signal at every step; at `bad_steps` every advantage is NaN, so the loss and
    every gradient are NaN and the train step skips the update (the real containment path, not a mock); at
    `empty_steps` no rollouts (a step without signal)."""
    import dataclasses

    def source(step: int, lora: Any) -> tuple[list[Any], dict[str, float]]:
        if step in empty_steps:
            return [], {}
        seed = 3
        rollouts, metrics = _small_rollouts(tiny_policy, step, seed=seed)
        while not rollouts:  # every group of this draw had equal rewards: draw another
            seed += 1000
            rollouts, metrics = _small_rollouts(tiny_policy, step, seed=seed)
        if step in bad_steps:
            rollouts = [dataclasses.replace(r, advantage=float("nan")) for r in rollouts]
        return rollouts, metrics

    return source


def test_consecutive_non_finite_updates_stop_the_run_with_the_field_named(
    tiny_policy: Any, gcs_bucket: str
) -> None:
    from rljob.trainer.runtime import Diverged

    trainer = Trainer(
        tiny_policy,
        StepConfig(budget=64, rows=2, micro_batches=4, learning_rate=1e-2, token_tile=32, vocab_chunk=128),
    )

    def paths(name: str) -> RunPaths:
        root = f"{gcs_bucket}/ns/{name}"
        return RunPaths(f"{root}/checkpoints", f"{root}/adapters", f"{root}/rollouts")

    def go(name: str, steps: int, bad: set[int], empty: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
        out = io.StringIO()
        try:
            run(
                trainer,
                paths(name),
                RunSettings(steps=steps, max_non_finite_steps=3),
                _nan_source(tiny_policy, bad, empty),
                steplog=StepLog(stream=out),
                reporter=Reporter(None),
            )
        finally:
            events = [json.loads(x) for x in out.getvalue().splitlines()]
        return events

    # Skipped updates that are not consecutive enough: the run completes, a finite update resets the
    # streak, a step without signal (no rollouts) leaves it as it is.
    events = go("intermittent", 7, {0, 1, 3, 4}, frozenset({5}))
    steps = [e for e in events if e["event"] == "step"]
    assert [e["update_skipped"] for e in steps] == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert [e["no_signal"] for e in steps] == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert [e["non_finite_streak"] for e in steps] == [1.0, 2.0, 0.0, 1.0, 2.0, 2.0, 0.0]
    # Three in a row: Diverged at the third, naming the field, the step and what to do.
    with pytest.raises(Diverged) as err:
        go("diverged", 10, set(range(10)))
    assert str(err.value).startswith(
        "spec.failurePolicy.maxNonFiniteSteps: 3 consecutive optimizer steps, the last step 2, had a "
    )
    # The streak survives a restart: two skipped steps, a checkpoint, a restart, and one more skip stops it.
    go("resumed", 2, {0, 1})
    with pytest.raises(Diverged, match=r"3 consecutive optimizer steps, the last step 2,"):
        go("resumed", 5, {2, 3, 4})


def test_diverged_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The entrypoint's contract for a diverged run: exit 2 (not restarted), the reason on stderr."""
    from rljob.recipes.failure import EXIT_BAD_CONFIG
    from rljob.trainer import main as trainer_main
    from rljob.trainer.runtime import Diverged

    def diverges(args: Any, extra: Any = ()) -> int:
        raise Diverged(
            "spec.failurePolicy.maxNonFiniteSteps: 10 consecutive optimizer steps (steps 0..9) ..."
        )

    monkeypatch.setattr(trainer_main, "run_main", diverges)
    assert trainer_main.main(["--config", "/nonexistent.json"]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "rljob-trainer: spec.failurePolicy.maxNonFiniteSteps: 10 consecutive optimizer steps (steps 0..9) ..."
    ]
