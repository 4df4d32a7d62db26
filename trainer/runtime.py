"""The trainer's run loop around the compiled step: resume, rollout cache, train, checkpoint, export.

Step ``s`` (0-based; the policy after ``s`` updates is adapter version ``v{s}``):

1. rollouts of step ``s``: read from the rollout cache ``{storage.rollouts}/step-{s:08d}.npz`` if a
   previous attempt already graded them, else obtained from ``source(s, lora)`` (the sampler loop or
   fixed synthetic rollouts) and written to the cache BEFORE the gradient step, so a restart in the
   middle of the step never samples again;
2. one optimizer step (rljob.trainer.train_step);
3. a checkpoint (state + meta) every ``checkpoint_every`` steps (MaxText ``checkpoint_period``) and at
   the end; a restart resumes from the last one and trains the steps after it again on their cached
   rollouts, so the result is the same;
4. adapter ``v{s+1}`` handed to the background publisher (PEFT layout, LATEST last; the next step does
   not wait for the upload, the run waits for the last one before returning);
5. a JSON log line, TensorBoard scalars and the ProgressReport;
6. with ``profiler: xplane``, a JAX profiler trace of the chosen steps (rljob.trainer.profiling).

On start the newest committed checkpoint is restored (train state, optimizer state, step), so a run
killed at any point continues at exactly the step after its last checkpoint and computes the same
parameters as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from rljob.common.storage import open_store
from rljob.trainer import evaluation
from rljob.trainer.checkpoint import Checkpointer
from rljob.trainer.export import AdapterPublisher
from rljob.trainer.losses import NAN_SENTINEL, AdvantageNormalization, group_advantages
from rljob.trainer.packing import Rollout
from rljob.trainer.profiling import ProfileSettings, StepProfiler
from rljob.trainer.progress import Reporter, StepLog
from rljob.trainer.train_step import Trainer, TrainState

__all__ = [
    "Diverged",
    "RolloutSource",
    "RunPaths",
    "RunSettings",
    "decode_rollouts",
    "encode_rollouts",
    "run",
    "share_from_first",
    "synthetic_rollouts",
]

log = logging.getLogger("rljob.trainer.runtime")

# source(step, lora) -> (rollouts with advantages and per_token["old_logprobs"], step metrics)
RolloutSource = Callable[[int, Any], tuple[list[Rollout], dict[str, float]]]


@dataclasses.dataclass(frozen=True)
class RunPaths:
    checkpoints: str
    adapters: str
    rollouts: str


@dataclasses.dataclass(frozen=True)
class RunSettings:
    steps: int
    checkpoint_every: int = 1
    export_adapters: bool = True
    # spec.failurePolicy.maxNonFiniteSteps: consecutive skipped (non-finite) updates before Diverged.
    max_non_finite_steps: int = 10
    # MaxText profiler keys (rljob.trainer.profiling): the steps traced and where; None: no trace.
    profile: ProfileSettings | None = None


class Diverged(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss, gradient or update. Each such update is
    skipped (the parameters stay), but a run that only skips trains nothing: it stops with exit 2 (contract
    3: not restarted, since a restart resumes the same state and the same cached rollouts and would skip
    again). The message is one `field: message` line."""


# --------------------------------------------------------------------------- rollout cache


def encode_rollouts(rollouts: list[Rollout], metrics: dict[str, float]) -> bytes:
    """A step's graded rollouts as one .npz (no pickles)."""
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {"n": len(rollouts), "metrics": metrics, "fields": []}
    for i, r in enumerate(rollouts):
        arrays[f"{i}.prompt_ids"] = np.asarray(r.prompt_ids, np.int32)
        arrays[f"{i}.completion_ids"] = np.asarray(r.completion_ids, np.int32)
        arrays[f"{i}.advantage"] = np.asarray(r.advantage, np.float32)
        if r.completion_mask is not None:
            arrays[f"{i}.completion_mask"] = np.asarray(r.completion_mask, np.float32)
        for k, v in r.per_token.items():
            arrays[f"{i}.pt.{k}"] = np.asarray(v, np.float32)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def decode_rollouts(data: bytes) -> tuple[list[Rollout], dict[str, float]]:
    z = np.load(io.BytesIO(data), allow_pickle=False)
    meta = json.loads(bytes(z["meta"]).decode())
    out = []
    for i in range(int(meta["n"])):
        pt = {k.split(".pt.", 1)[1]: z[k] for k in z.files if k.startswith(f"{i}.pt.")}
        out.append(
            Rollout(
                prompt_ids=z[f"{i}.prompt_ids"],
                completion_ids=z[f"{i}.completion_ids"],
                advantage=float(z[f"{i}.advantage"]),
                completion_mask=z[f"{i}.completion_mask"] if f"{i}.completion_mask" in z.files else None,
                per_token=pt,
            )
        )
    return out, dict(meta["metrics"])


# --------------------------------------------------------------------------- synthetic source


def synthetic_rollouts(
    step: int,
    *,
    seed: int,
    vocab_size: int,
    groups: int = 4,
    group_size: int = 4,
    max_prompt: int = 12,
    max_completion: int = 20,
    normalization: AdvantageNormalization = "mean",
) -> tuple[list[Rollout], dict[str, float]]:
    """Fixed rollouts for step ``step``: a pure function of (seed, step), so a resumed run sees exactly
    what an uninterrupted one saw. Rewards are random per rollout, advantages as the loop computes them
    (rljob.trainer.losses.group_advantages, ``normalization``), and a group whose rewards are all equal is
    left out as the loop leaves it out; the first rollout's first token carries the sampler's NaN sentinel
    (exercising the containment path)."""
    rng = np.random.default_rng([seed, step])
    rollouts: list[Rollout] = []
    rewards = rng.integers(0, 2, groups * group_size).astype(np.float32)
    adv = group_advantages(jax.numpy.asarray(rewards), group_size, normalization=normalization)
    keep = np.asarray(adv.valid)
    for i in range(groups * group_size):
        p = rng.integers(1, vocab_size, rng.integers(2, max_prompt + 1)).astype(np.int32)
        c = rng.integers(1, vocab_size, rng.integers(2, max_completion + 1)).astype(np.int32)
        old = (-np.log(vocab_size) + 0.1 * rng.standard_normal(c.size)).astype(np.float32)
        if i == 0:
            old[0] = NAN_SENTINEL - 999.0
        if keep[i]:
            a = float(adv.advantages[i])
            rollouts.append(Rollout(p, c, advantage=a, per_token={"old_logprobs": old}))
    return rollouts, {"reward_mean": float(rewards.mean()), "groups_skipped": float(adv.groups_skipped)}


# --------------------------------------------------------------------------- the loop


def _state_tree(state: TrainState) -> dict[str, Any]:
    return {"lora": state.lora, "opt_state": state.opt_state, "step": state.step, "skipped": state.skipped}


def run(
    trainer: Trainer,
    paths: RunPaths,
    settings: RunSettings,
    source: RolloutSource,
    *,
    steplog: StepLog,
    reporter: Reporter,
    to_peft: Callable[[Any], dict[str, np.ndarray]] | None = None,
    peft_config: dict[str, Any] | None = None,
    initial_lora: Any = None,
    programs_ran: Callable[[], None] | None = None,
) -> TrainState:
    """Train until ``settings.steps`` optimizer steps are done (resuming from the newest checkpoint;
    without one, from ``initial_lora``, spec.lora.initFrom's adapter, when given). ``programs_ran``: called
    once the first step's programs ran (rljob.common.caches.CacheSync.loaded)."""
    ckpt = Checkpointer(paths.checkpoints)
    cache = open_store(paths.rollouts)
    state = trainer.init_state(initial_lora)
    template = _state_tree(state)
    restored = ckpt.restore(template)
    resumed_from: int | None = None
    streak = 0
    if restored is not None:
        tree, meta = restored
        state = TrainState(tree["lora"], tree["opt_state"], tree["step"], tree["skipped"])
        resumed_from = int(meta["step"])
        streak = int(meta.get("non_finite_streak", 0))
        steplog.event("resume", step=resumed_from, checkpoints=ckpt.all_steps())
    start = int(state.step)
    reporter.update(step=start, resumed_from_step=resumed_from, last_checkpoint_step=ckpt.latest_step())
    publisher = (
        AdapterPublisher(paths.adapters, peft_config or {})
        if settings.export_adapters and to_peft is not None
        else None
    )
    profiler = StepProfiler(settings.profile)
    try:
        state = _steps(
            trainer,
            settings,
            source,
            state,
            start,
            ckpt,
            cache,
            publisher,
            to_peft,
            steplog,
            reporter,
            streak,
            profiler,
            programs_ran,
        )
    except BaseException:
        try:
            profiler.stop()  # what was traced before the failure
        except Exception as e:
            log.warning("profile upload after failure: %s", e)
        if publisher is not None:  # keep what was exported (a complete version) if it uploads in time
            try:
                publisher.close(timeout=120.0)
            except Exception as e:  # the original failure is the one to report
                log.warning("adapter publish after failure: %s", e)
        raise
    if publisher is not None:
        publisher.close()
        reporter.update(adapter_version=publisher.published)
    ckpt.close()
    jax.effects_barrier()  # type: ignore[no-untyped-call]
    return state


def share_from_first(blob: bytes | None) -> bytes:
    """Process 0's bytes on every process (one process: ``blob`` itself).

    Only process 0 samples, grades and caches a step's rollouts; every process must then train on the
    same batch (each feeds its shard of one global array: different rollouts per host would silently
    train on an inconsistent batch), so the encoded rollouts are broadcast, length first."""
    if jax.process_count() == 1:
        assert blob is not None
        return blob
    from jax.experimental import multihost_utils

    first = jax.process_index() == 0
    n = int(multihost_utils.broadcast_one_to_all(np.int64(len(blob) if first and blob is not None else 0)))
    buf = np.frombuffer(blob, np.uint8) if first and blob is not None else np.zeros(n, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf)))


def _steps(
    trainer: Trainer,
    settings: RunSettings,
    source: RolloutSource,
    state: TrainState,
    start: int,
    ckpt: Checkpointer,
    cache: Any,
    publisher: AdapterPublisher | None,
    to_peft: Callable[[Any], dict[str, np.ndarray]] | None,
    steplog: StepLog,
    reporter: Reporter,
    streak: int = 0,
    profiler: StepProfiler | None = None,
    programs_ran: Callable[[], None] | None = None,
) -> TrainState:
    """The steps from `start`; `streak`: consecutive non-finite updates before `start` (checkpoint meta)."""
    if start == 0 and publisher is not None and to_peft is not None:
        publisher.submit(0, to_peft(state.lora))
    for s in range(start, settings.steps):
        t0 = time.monotonic()
        if publisher is not None:
            publisher.check()
        blob, from_cache = None, False
        if jax.process_index() == 0:
            key = f"step-{s:08d}.npz"
            blob = cache.read(key)
            from_cache = blob is not None
            if blob is None:
                blob = encode_rollouts(*source(s, state.lora))
                cache.write(key, blob)
        rollouts, src_metrics = decode_rollouts(share_from_first(blob))
        collective = getattr(source, "collective", None)
        if collective is not None:  # a source's work that every process must join (the parity gate)
            collective(s, state.lora)
        if profiler is not None:
            profiler.before(s)
        state, metrics = trainer.train_on_batch(state, rollouts)
        if programs_ran is not None and s == start:
            programs_ran()
        if profiler is not None:
            profiler.after(s, last=s + 1 == settings.steps)
        done = s + 1
        # A step without signal (no token carried a loss weight) makes no update at all: it neither
        # extends nor ends a streak of non-finite ones.
        if metrics.get("update_skipped", 0.0) > 0:
            streak += 1
        elif not metrics.get("no_signal", 0.0):
            streak = 0
        metrics["non_finite_streak"] = float(streak)
        if streak >= settings.max_non_finite_steps:
            steplog.step(done, metrics)
            raise Diverged(
                f"spec.failurePolicy.maxNonFiniteSteps: {streak} consecutive optimizer steps, the last step "
                f"{s}, had a non-finite loss, gradient or update and were skipped; the run stops (lower "
                "spec.algorithm.learningRate, or check the rewards and the sampler's log-probs)"
            )
        saved = done % settings.checkpoint_every == 0 or done == settings.steps
        if saved:
            ckpt.save(done, _state_tree(state), {"adapter_version": done, "non_finite_streak": streak})
        if publisher is not None and to_peft is not None:
            publisher.submit(done, to_peft(state.lora))
            if publisher.publish_seconds is not None:
                metrics["adapter_publish_s"] = publisher.publish_seconds
        metrics.update(src_metrics)
        seconds = time.monotonic() - t0
        metrics.update(
            step_seconds=seconds,
            rollouts=float(len(rollouts)),
            rollouts_from_cache=float(from_cache),
            skipped_total=float(state.skipped),
        )
        if "tokens" in metrics and seconds > 0:  # trained (non-padding) tokens per second of the step
            metrics["tokens_per_s"] = metrics["tokens"] / seconds
        steplog.step(done, metrics)
        reporter.update(
            step=done,
            reward_mean=metrics.get("reward_mean"),
            last_checkpoint_step=done if saved else reporter.report.last_checkpoint_step,
            adapter_version=publisher.published if publisher is not None else None,
            evaluation=evaluation.report(done, metrics) or reporter.report.evaluation,
        )
    return state
