"""The RL loop driver: the sampler side of each step, plugged into the trainer runtime.

rljob.trainer.runtime.run owns the step (restore, rollout cache, compiled train step, orbax checkpoint,
adapter export `v{N}` + LATEST, progress, JSON step lines); this module is its rollout source. For step
`s` (the policy after `s` updates is adapter version `v{s}`):
1. take step `s`'s rollouts: `groupSize` completions per prompt from the sampler(s) over HTTP
   (`/v1/completions` with a served adapter version, per-token log-probs of the sampled tokens), graded
   by the task's reward, with GRPO advantages per group (rljob.trainer.losses.group_advantages);
2. before returning them, start sampling step `s+1` in the background with the newest served version,
   at least `v{s}`: it overlaps the gradient of step `s`, and the policy lag (trainer step minus sampling
   version) stays at most one; it is recorded in every step line (`policy_lag`, `sampled_with`);
3. every spec.evaluation.every steps (`--eval-every` overrides it), spec.evaluation's samples of each
   held-out prompt, graded: `eval_reward`, `eval_pass_at_k` and, with majK, `eval_maj_at_k`
   (rljob.trainer.evaluation).

Before the first step, a parity gate compares the trainer's log-probs of the first batch's tokens with
the sampler's (adapter v0; the same weights, or a declared quantization of them: rljob.recipes.quantization):
the mean absolute difference is logged and the run is refused (exit 2) above `--parity-threshold`, by default
spec.sampler.weights.parityTolerance. The samplers come from RunConfig.endpoints.samplers (JobSet
DNS names in a cluster, local ports here); an unreachable or restarting sampler is waited for.

`rljob-trainer --config run.json` (the pods' command, rljob.trainer.main, the one entrance; default
`--rollouts sampler`) initializes jax.distributed and calls :func:`run_loop` here; on a laptop:

    rljob-trainer --config run.json --model tiny
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from rljob.common.credentials import run_token
from rljob.recipes.failure import EXIT_BAD_CONFIG, EXIT_OK
from rljob.recipes.runconfig import RunConfig
from rljob.trainer.data import DatasetError, Task
from rljob.trainer.evaluation import EvalOptions
from rljob.trainer.remote_reward import RemoteReward
from rljob.trainer.rollouts import (
    ParityError,
    SamplerSource,
)
from rljob.trainer.sampler_client import LoopConfigError, SamplerClient, SamplerRejected, Sampling
from rljob.trainer.tasks import ChatPrompts, context_of, hf_tokenizer, load_task
from rljob.trainer.warmstart import load_adapter

log = logging.getLogger("rljob.trainer.loop")


def task_of(rc: RunConfig, seed: int = 0) -> Task:
    """The run's prompts and grader: the task spec.dataset.task names in the entry-point group rljob.tasks
    (rljob.trainer.tasks), started once with spec.dataset. An unknown task, a task that fails to start, a
    missing or malformed file: bad configuration (exit 2, never retried)."""
    return load_task(context_of(rc, seed))


def chat_tokenizer(rc: RunConfig, model: str, revision: str | None = None) -> Callable[[], Any] | None:
    """Where a chat prompt's template comes from: the Hugging Face tokenizer of spec.model.name at
    ``revision`` (the run's pinned commit, which the samplers serve: vLLM takes the tokenizer at the model's
    revision; spec.model.revision as written where not given) for the run's own model; none for the tiny and
    miniature CPU models (the CPU sampler's tokenizer is UTF-8 bytes, without a chat template)."""
    if model != "config":
        return None
    return hf_tokenizer(rc.spec.model.name, rc.spec.dataset.task, revision or rc.spec.model.revision)


def cpu_step_config(rc: RunConfig, max_len: int, steps: int | None = None) -> Any:
    """The compiled step of the CPU loop's tiny model (rows of ``max_len`` tokens) with the run config's
    algorithm: its loss, learning rate and schedule over ``steps``, the optimizer keys
    (rljob.trainer.main.optimizer_options), the KL penalty against the base policy, the log-prob head's
    block sizes (spec.trainer.logprobs, clamped by the head to the tiny shapes) and the rollouts per row
    (spec.packing.maxSegmentsPerRow)."""
    from rljob.trainer.main import head_blocks, loss_config, optimizer_options
    from rljob.trainer.train_step import StepConfig

    alg = rc.spec.algorithm
    return StepConfig(
        budget=max_len,
        rows=4,
        segment_align=1,
        max_segments=rc.spec.packing.max_segments_per_row,
        **optimizer_options(rc, steps if steps is not None else alg.steps, micro_batches=8),
        loss=loss_config(rc),
        **head_blocks(rc),
    )


def evaluation_options(rc: RunConfig, every: int | None = None) -> EvalOptions:
    """spec.evaluation as the loop reads it; ``every`` (rljob-trainer's --eval-every) overrides its
    interval."""
    ev = rc.spec.evaluation
    return EvalOptions(
        every=ev.every if every is None else every,
        pass_k=ev.pass_k,
        maj_k=ev.maj_k,
        samples=ev.samples,
        temperature=ev.temperature,
    )


@dataclass(frozen=True)
class LoopOptions:
    """What rljob-trainer's command line sets for the loop (rljob.trainer.main)."""

    model: str = "config"  # config | tiny | miniature (rljob.trainer.main's --model)
    steps: int | None = None  # override spec.algorithm.steps
    seed: int = 0  # seed of the task's prompts (e.g. math sampling)
    checkpoint_every: int | None = None  # None: MaxText checkpoint_period, else every step
    eval_every: int | None = None  # override spec.evaluation.every (0: never)
    # None: spec.sampler.weights.parityTolerance (rollouts.DEFAULT_PARITY_THRESHOLD at bfloat16, wider for a
    # quantized sampler: rljob.recipes.quantization)
    parity_threshold: float | None = None
    tensorboard_dir: str | None = None  # default: storage.root's tensorboard/ (outlives the pod)
    log_jsonl: str | None = None  # also append the JSON lines to this file


def run_loop(rc: RunConfig, args: LoopOptions) -> int:
    """The RL loop of one trainer process (jax.distributed already initialized by rljob.trainer.main)."""
    from rljob.common import caches
    from rljob.trainer.main import (
        BadConfig,
        align,
        checkpoint_every,
        max_non_finite_steps,
        model_setup,
        prepare_base_weights,
        profile,
        resolved_base_weights,
    )
    from rljob.trainer.model import Policy
    from rljob.trainer.progress import Reporter, StepLog, sink_for
    from rljob.trainer.runtime import Diverged, RunPaths, RunSettings, run
    from rljob.trainer.tinypolicy import cpu_model_spec, cpu_shape, miniature_spec
    from rljob.trainer.train_step import Trainer, model_problem

    spec, alg = rc.spec, rc.spec.algorithm
    steps = args.steps if args.steps is not None else alg.steps
    if steps <= 0:
        print(f"--steps: must be > 0, got {steps}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    # JAX's compilation cache, restored from storage.cache before anything compiles.
    jax_cache = caches.jax_compilation_cache(
        caches.JAX_TRAINER,
        rc.storage.cache,
        caches.local_root(),
        jax.config.update,
        rc.trainer.maxtext,
        guard_process=jax.process_index(),
    )
    try:
        # The base weights' commit first: the chat template comes from the tokenizer at that commit.
        resolved = resolved_base_weights(rc) if args.model == "config" else None
        pinned = resolved.revision if resolved is not None else None
        chat = ChatPrompts(task_of(rc, args.seed), chat_tokenizer(rc, args.model, pinned))
        chat.eval_prompts()  # renders the chat prompts once: a tokenizer that cannot load fails here
        reward_url = spec.dataset.reward_url
        task: Task = RemoteReward(chat, reward_url) if reward_url else chat
        client = SamplerClient(
            rc.endpoints.samplers, rc.name, max_seqs=rc.sampler.max_num_seqs, token=run_token()
        )
        if args.model == "config":
            model_spec, step_cfg, _ = model_setup(rc, "config", args.steps)
            early = Reporter(
                sink_for(rc, in_cluster="KUBERNETES_SERVICE_HOST" in os.environ)
                if jax.process_index() == 0
                else None
            )
            base = prepare_base_weights(
                rc, model_spec.maxtext, lambda line: early.update(message=line), resolved
            )
            model_spec = dataclasses.replace(model_spec, checkpoint=base)
        elif args.model == "miniature":
            model_spec = miniature_spec(rc, mesh=True, checkpoint=spec.model.checkpoint)
            step_cfg = cpu_step_config(rc, int(model_spec.maxtext["max_target_length"]), steps)
        else:
            vocab, max_len = cpu_shape(rc)
            model_spec = cpu_model_spec(
                spec.lora.rank,
                spec.lora.alpha,
                checkpoint=spec.model.checkpoint,
                vocab_size=vocab,
                max_len=max_len,
            )
            step_cfg = cpu_step_config(rc, max_len, steps)
        every = checkpoint_every(rc, args.checkpoint_every)
        problem = model_problem(step_cfg, model_spec.decoder_block)  # the plan's packing fits the model
        if problem is not None:
            raise BadConfig(problem)
        align("rljob-policy")  # the policy's first collective, with every process there (rljob.trainer.main)
        policy = Policy(model_spec)
        initial = load_adapter(spec.lora.init_from, policy.peft) if spec.lora.init_from else None
        scored = policy.scoring_program()
        source = SamplerSource(
            client,
            task,
            steps=steps,
            group_size=alg.group_size,
            groups_per_batch=alg.groups_per_batch,
            logprobs=lambda lora, t, p, s: scored(policy.base, lora, t, p, s),
            pack=step_cfg.pack_config(),
            parity_rows=policy.row_multiple(),
            parity_len=int(policy.cfg.max_target_length),
            evaluation=evaluation_options(rc, args.eval_every),
            parity_threshold=(
                args.parity_threshold
                if args.parity_threshold is not None
                else rc.spec.sampler.weights.parity_tolerance
            ),
            advantage_normalization=alg.advantage_normalization,
            loss_normalization=alg.loss_normalization,
            overlong=(alg.overlong_buffer, alg.overlong_penalty),
            sampling=Sampling(
                temperature=alg.sampling.temperature,
                top_p=alg.sampling.top_p,
                top_k=alg.sampling.top_k,
                stop=alg.sampling.stop,
            ),
        )
    except DatasetError as e:  # every problem, one line each (rljob.trainer.tasks)
        print(str(e), file=sys.stderr)
        return EXIT_BAD_CONFIG
    except (LoopConfigError, ValueError, BadConfig) as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return EXIT_BAD_CONFIG
    first = jax.process_index() == 0
    tb_dir = args.tensorboard_dir or rc.storage.tensorboard  # under storage.root: outlives the process
    steplog = StepLog(tb_dir if first else None, args.log_jsonl)
    source.emit = lambda rec: steplog.event(rec.pop("event"), **rec)
    reporter = Reporter(sink_for(rc, in_cluster="KUBERNETES_SERVICE_HOST" in os.environ) if first else None)
    try:
        trainer = Trainer(policy, step_cfg)
        # The step compiled (or loaded) and the base in its layouts before the parity gate scores with it,
        # at whichever step the gate comes: the parity program the compile stage compiled
        # (Trainer.lay_out_base).
        trainer.lay_out_base()
        run(
            trainer,
            RunPaths(rc.storage.checkpoints, rc.storage.adapters, rc.storage.rollouts),
            RunSettings(
                steps=steps,
                checkpoint_every=every,
                export_adapters=first,
                max_non_finite_steps=max_non_finite_steps(rc),
                profile=profile(rc, args.tensorboard_dir),
            ),
            source,
            steplog=steplog,
            reporter=reporter,
            to_peft=policy.peft.to_peft,
            peft_config=policy.peft.config(),
            initial_lora=initial,
            programs_ran=jax_cache.loaded,
        )
    except ParityError as e:
        print(f"parity gate: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except Diverged as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_CONFIG
    except SamplerRejected as e:
        print(f"sampler rejected a request (check spec.algorithm, spec.sampler): {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    finally:
        source.close()
        jax_cache.close()
    return EXIT_OK


__all__ = ["LoopOptions", "chat_tokenizer", "cpu_step_config", "evaluation_options", "run_loop", "task_of"]
