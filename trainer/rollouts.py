"""The RL loop's rollout source (rljob.trainer.runtime's RolloutSource): pipelined sampling with the newest
served adapter, grading by the task, GRPO advantages per group, the step-0 parity gate and evaluation."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rljob.recipes import quantization, startup
from rljob.trainer.data import Prompt, Task
from rljob.trainer.evaluation import EvalOptions, answer_of, scores
from rljob.trainer.losses import (
    AdvantageNormalization,
    Mode,
    group_advantages,
    overlong_penalty,
    rollout_loss_weights,
)
from rljob.trainer.packing import PackConfig, Rollout, align_up, pack_rollouts
from rljob.trainer.sampler_client import (
    Completion,
    LoopConfigError,
    SamplerClient,
    Sampling,
    version_of,
)

log = logging.getLogger("rljob.trainer.rollouts")

PARITY_ALIGN = 128  # row budget rounding of the parity gate when no pack shape is given
# nats, on the same bfloat16 weights; a quantized sampler's default is the wider
# spec.sampler.weights.parityTolerance (rljob.recipes.quantization)
DEFAULT_PARITY_THRESHOLD = quantization.BF16_PARITY_NATS


class ParityError(RuntimeError):
    """Trainer and sampler disagree on the log-probs of the same tokens under the same weights."""


@dataclass
class Batch:
    step: int
    prompts: list[Prompt]
    completions: list[Completion]
    rewards: np.ndarray
    sample_s: float
    versions: set[int] = field(default_factory=set)


LogprobFn = Callable[[Any, np.ndarray, np.ndarray, np.ndarray], Any]


def grpo_rollouts(
    batch: Batch,
    group_size: int,
    normalization: AdvantageNormalization = "mean",
    loss_normalization: Mode = "token",
) -> tuple[list[Rollout], int]:
    """The graded batch's training rollouts and how many groups were skipped: GRPO advantages per group
    (rljob.trainer.losses.group_advantages); a group whose rewards are all equal carries no signal and
    none of its rollouts is returned (never packed, run or counted in the step's token mean).
    ``loss_normalization`` sequence (spec.algorithm.lossNormalization) gives each rollout's tokens a
    packed ``loss_weight`` of 1 / (its tokens x the rollouts); token leaves the step's one token mean
    (rljob.trainer.train_step.stack_micro_batches)."""
    adv = group_advantages(jnp.asarray(batch.rewards), group_size, normalization=normalization)
    kept = [
        (c, float(a))
        for c, a, valid in zip(
            batch.completions, np.asarray(adv.advantages), np.asarray(adv.valid), strict=True
        )
        if valid
    ]
    weights: list[Any] = [None] * len(kept)
    if loss_normalization == "sequence":
        weights = rollout_loss_weights([np.ones(len(c.tokens)) for c, _ in kept], "sequence")
    rollouts = []
    for (c, a), w in zip(kept, weights, strict=True):
        per_token = {"old_logprobs": np.asarray(c.logprobs, np.float32)}
        if w is not None:
            per_token["loss_weight"] = w
        rollouts.append(
            Rollout(
                prompt_ids=np.asarray(c.prompt_ids(batch.prompts[c.prompt_index]), np.int32),
                completion_ids=np.asarray(c.tokens, np.int32),
                advantage=a,
                per_token=per_token,
            )
        )
    return rollouts, int(adv.groups_skipped)


def parity_pack(pack: PackConfig, row_multiple: int) -> PackConfig:
    """The parity gate's packing: the train step's ``[rows, budget]`` with the rows rounded up to a multiple
    of ``row_multiple`` (:meth:`rljob.trainer.model.Policy.row_multiple`: so every batch axis divides them),
    the train step's own shape when they are one already. Not the whole mesh's size: the gate's program
    then holds no more tokens per call than the train step's (on Qwen3.5-397B's tpu7x-256 mesh, 256 rows
    instead of 64 overflowed the SparseCore memory of the MoE's ragged gather in libtpu's compile). The
    compile stage compiles the gate's program for this shape."""
    if pack.rows % row_multiple:
        return dataclasses.replace(pack, rows=align_up(pack.rows, row_multiple))
    return pack


class SamplerSource:
    """The runtime's RolloutSource: pipelined sampling, grading, advantages, parity gate, evaluation."""

    def __init__(
        self,
        client: SamplerClient,
        task: Task,
        *,
        steps: int,
        group_size: int,
        groups_per_batch: int,
        logprobs: LogprobFn,
        sampling: Sampling | None = None,
        evaluation: EvalOptions | None = None,
        parity_threshold: float = DEFAULT_PARITY_THRESHOLD,
        emit: Callable[[dict[str, Any]], None] | None = None,
        advantage_normalization: AdvantageNormalization = "mean",
        loss_normalization: Mode = "token",
        overlong: tuple[int, float] = (0, 1.0),
        pack: PackConfig | None = None,
        parity_rows: int = 1,
        parity_len: int | None = None,
    ) -> None:
        problem = startup.group_size_problem(group_size)  # the plan makes the same check
        if problem:
            raise LoopConfigError(problem)
        self.client, self.task, self.steps = client, task, steps
        self.group_size, self.groups = group_size, groups_per_batch
        self.logprobs = logprobs
        self.evaluation = evaluation or EvalOptions()
        self.sampling = sampling or Sampling()
        self.loss_normalization = loss_normalization
        self.overlong = overlong  # spec.algorithm.overlongBuffer, .overlongPenalty
        self.parity_threshold = parity_threshold
        self.pack = pack  # the train step's micro-batch shape, for the parity gate
        self.parity_shapes: set[tuple[int, int]] = set()
        self.advantage_normalization = advantage_normalization
        self.emit = emit or (lambda rec: print(json.dumps(rec), flush=True))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampling")
        self.pending: dict[int, Future[Batch]] = {}
        self.parity_checked = False
        # The parity batch is scored in one padded [rows, len] shape: rows a multiple of ``parity_rows``
        # (Policy.row_multiple: every batch axis divides it), len ``parity_len`` (the model's).
        self.parity_rows, self.parity_len = max(1, parity_rows), parity_len
        # With several trainer processes only process 0 samples; the gate's inputs wait here for the
        # runtime's collective() call, which every process makes (the scoring is one SPMD program).
        self.parity_due: bytes = b""
        self.lock = threading.Lock()

    def sample(self, step: int, min_version: int) -> Batch:
        t0 = time.monotonic()
        prompts = self.task.train_prompts(step, self.groups)
        comps = self.client.complete(
            prompts,
            self.group_size,
            self.task.max_tokens,
            self.sampling,
            min_version,
        )
        # Graded later, on the caller's thread (see grade()).
        return Batch(
            step,
            prompts,
            comps,
            np.zeros(0, np.float32),
            time.monotonic() - t0,
            {version_of(c.adapter) for c in comps},
        )

    def grade(self, batch: Batch) -> np.ndarray:
        """Rewards of a batch, computed on the loop's (main) thread: graders such as math-verify time
        themselves out with signal.alarm, which only works there."""
        return np.asarray(self.rewards(batch.prompts, batch.completions), np.float32)

    def rewards(self, prompts: list[Prompt], comps: list[Completion]) -> list[float]:
        """The task's rewards of completions, all at once when the task grades many together (a reward
        service, rljob.trainer.remote_reward), else one after another."""
        graded = [(prompts[c.prompt_index], c.tokens, c.text) for c in comps]
        many = getattr(self.task, "rewards", None)
        if many is not None:
            return [float(r) for r in many(graded)]
        return [self.task.reward(p, t, x) for p, t, x in graded]

    def _prefetch(self, step: int, min_version: int) -> None:
        if step < self.steps and step not in self.pending:
            self.pending[step] = self.pool.submit(self.sample, step, min_version)

    def parity_inputs(self, batch: Batch) -> dict[str, np.ndarray]:
        """The batch's rollouts packed in the train step's ``[rows, budget]`` micro-batch shape (``pack``),
        stacked ``[micro-batches, rows, budget]``, with the sampler's log-prob of each sampled token at its
        position and a mask of those positions. One shape: the log-prob function compiles once, for the
        shape the step already runs, not once per distinct rollout length (on a TPU each would be a compile
        of the whole model). Without ``pack`` (tests): rows a multiple of ``parity_rows`` (what the
        batch axes divide), budget ``parity_len`` or the longest rollout aligned up."""
        rollouts = [
            Rollout(
                prompt_ids=np.asarray(c.prompt_ids(batch.prompts[c.prompt_index]), np.int32),
                completion_ids=np.asarray(c.tokens, np.int32),
                per_token={"sampler_logprobs": np.asarray(c.logprobs, np.float32)},
            )
            for c in batch.completions
        ]
        cfg = self.pack
        if cfg is None:
            longest = max(r.num_tokens for r in rollouts)
            budget = max(self.parity_len or 0, align_up(longest, PARITY_ALIGN))
            cfg = PackConfig(budget=budget, rows=self.parity_rows)
        else:
            cfg = parity_pack(cfg, self.parity_rows)
        mbs = pack_rollouts(rollouts, cfg)
        return {
            "tokens": np.stack([mb.tokens for mb in mbs]),
            "positions": np.stack([mb.positions for mb in mbs]),
            "segments": np.stack([mb.segment_ids for mb in mbs]),
            "sampler": np.stack([mb.fields["sampler_logprobs"] for mb in mbs]).astype(np.float32),
            # the completion tokens
            "mask": np.stack([(mb.segment_ids > 0) & (mb.prompt_mask == 0) for mb in mbs]).astype(np.float32),
        }

    def parity_of(self, inputs: dict[str, np.ndarray], lora: Any) -> float:
        """Mean |trainer - sampler| log-prob over the sampled tokens (same weights), one micro-batch at a
        time. With several processes every one must call it (one program over the global mesh)."""
        total, count = 0.0, 0.0
        for i in range(inputs["tokens"].shape[0]):
            toks = inputs["tokens"][i]
            out = self.logprobs(lora, toks, inputs["positions"][i], inputs["segments"][i])
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                out = multihost_utils.process_allgather(out, tiled=True)
            lp = np.asarray(out, np.float32)
            mask = inputs["mask"][i]
            total += float(np.sum(np.abs(lp - inputs["sampler"][i]) * mask))
            count += float(mask.sum())
            self.parity_shapes.add((int(toks.shape[0]), int(toks.shape[1])))
        return total / max(count, 1.0)

    def parity(self, batch: Batch, lora: Any) -> float:
        """Mean |trainer - sampler| log-prob over the batch's sampled tokens (same weights)."""
        return self.parity_of(self.parity_inputs(batch), lora)

    def check_parity(self, step: int, diff: float) -> None:
        self.emit(
            {
                "event": "parity",
                "step": step,
                "mean_abs_logprob_diff": diff,
                "threshold": self.parity_threshold,
                "adapter_version": step,
            }
        )
        if not np.isfinite(diff) or diff > self.parity_threshold:
            raise ParityError(
                f"trainer and sampler log-probs differ by {diff:.3g} nats on the first batch "
                f"(adapter v{step}; threshold {self.parity_threshold:.3g}): refusing to train"
            )
        self.parity_checked = True

    def collective(self, step: int, lora: Any) -> None:
        """Called by the runtime on every process after each step's rollouts are shared: with several
        processes, the parity gate that process 0's call deferred runs here, on all of them."""
        if jax.process_count() == 1 or self.parity_checked:
            return
        from rljob.trainer.runtime import share_from_first

        payload = share_from_first(self.parity_due if jax.process_index() == 0 else None)
        self.parity_due = b""
        if not payload:
            return
        with np.load(io.BytesIO(payload)) as z:
            inputs = {k: z[k] for k in z.files}
        self.check_parity(step, self.parity_of(inputs, lora))

    def evaluate(self, min_version: int) -> dict[str, float]:
        """spec.evaluation's metrics on the held-out prompts (rljob.trainer.evaluation): ``samples``
        completions of each at the evaluation's temperature, with the rollouts' stop strings."""
        ev = self.evaluation
        prompts = self.task.eval_prompts()
        sampling = Sampling(temperature=ev.temperature, stop=self.sampling.stop)
        comps = self.client.complete(prompts, ev.samples, self.task.max_tokens, sampling, min_version)
        rewards = self.rewards(prompts, comps)
        answer = answer_of(self.task)
        per_prompt: list[list[tuple[float, Any]]] = [[] for _ in prompts]
        for c, r in zip(comps, rewards, strict=True):
            per_prompt[c.prompt_index].append((r, answer(prompts[c.prompt_index], c.tokens, c.text)))
        return scores(ev, per_prompt)

    def __call__(self, step: int, lora: Any) -> tuple[list[Rollout], dict[str, float]]:
        # The runtime calls this after publishing v{step}: sample step `step` with >= v{step-1}.
        self._prefetch(step, max(step - 1, 0))
        batch = self.pending.pop(step).result()
        batch.rewards = self.grade(batch)
        if not self.parity_checked and not self.parity_due and min(batch.versions) == step:
            if jax.process_count() > 1:  # scored in collective(), on every process
                buf = io.BytesIO()
                np.savez(buf, **self.parity_inputs(batch))  # type: ignore[arg-type]
                self.parity_due = buf.getvalue()
            else:
                self.check_parity(step, self.parity(batch, lora))
        # Overlap: step+1 samples while this step trains, with v{step} at the oldest (lag <= 1).
        self._prefetch(step + 1, step)
        task_rewards = batch.rewards
        shaping = overlong_penalty(
            [len(c.tokens) for c in batch.completions], self.task.max_tokens, *self.overlong
        )
        batch.rewards = task_rewards + shaping
        rollouts, skipped = grpo_rollouts(
            batch, self.group_size, self.advantage_normalization, self.loss_normalization
        )
        metrics: dict[str, float] = {
            "reward_mean": float(task_rewards.mean()),
            "policy_lag": float(step - min(batch.versions)),
            "sampled_with": float(min(batch.versions)),
            "groups_skipped": float(skipped),
            "sample_s": batch.sample_s,
            "sampler_wait_s": self.client.waited_s,
        }
        if self.overlong[0]:
            metrics["overlong_penalty_mean"] = float(shaping.mean())
        if self.evaluation.every and step % self.evaluation.every == 0:
            metrics.update(self.evaluate(max(step - 1, 0)))
        return rollouts, metrics

    def close(self) -> None:
        """Cancel queued sampling and end the one in flight (the client stops waiting)."""
        self.client.close()
        close = getattr(self.task, "close", None)
        if close is not None:
            close()
        self.pool.shutdown(wait=False, cancel_futures=True)
