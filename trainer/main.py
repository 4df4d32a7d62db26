"""``rljob-trainer --config PATH``: the trainer entrypoint (exit codes per contract 3).

Contexts:
- Kubernetes (a JobSet pod; ``KUBERNETES_SERVICE_HOST`` set) or a local process given a rendered
  container's environment (``rljob drill``): one JAX process per TPU container, its id, the count and the
  coordinator from the container's environment (rljob.recipes.topology.process_topology: slice
  ``JOB_INDEX``, host ``JOB_COMPLETION_INDEX``, container ``RLJOB_CONTAINER_INDEX``); jax.distributed is
  initialized when there is more than one process; in a pod progress goes to the ``<rljob>-progress``
  ConfigMap.
- Local (laptop, tests): one process unless ``RLJOB_NUM_PROCESSES`` / ``RLJOB_PROCESS_ID`` /
  ``RLJOB_COORDINATOR`` say otherwise (the two-process CPU test uses them); progress goes to
  RunConfig.progress.file.

``--model tiny`` swaps the MaxText model keys for the tiny CPU model (rljob.trainer.model.tiny_keys) and
the packed shape for a small one, keeping everything else of the run config. With the run config's model
the frozen base weights come from spec.model.checkpoint when the run config names one (a converted MaxText
checkpoint, which must fit the model built; rljob.trainer.base_checkpoint), else from the trainer's own
conversion of spec.model.name at spec.model.revision, cached in storage (prepare_base_weights,
rljob.trainer.hf_weights); the tiny model's come from spec.model.checkpoint, else a random initialization.
``--rollouts sampler`` (the default, what the pods run) runs the RL loop against the samplers of
RunConfig.endpoints.samplers: this entrypoint initializes jax.distributed and runs
:func:`rljob.trainer.loop.run_loop` with the parsed options.
With ``spec.service`` (service mode) it runs no loop but serves the API (rljob.trainer.tinker.main).
``--rollouts synthetic`` trains on fixed synthetic rollouts (a function of seed and step), for tests and
resume checks.

Exit codes: 0 done; 2 bad configuration (one line ``field: message`` on stderr, no traceback; a base
checkpoint that is missing or does not fit the model is ``spec.model.checkpoint: ...``); 1 any other
failure (a restart counted against spec.failurePolicy.maxRestarts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from rljob.recipes import libtpu, topology
from rljob.recipes.failure import EXIT_BAD_CONFIG, EXIT_OK, NO_CREDENTIALS
from rljob.recipes.runconfig import CONFIG_ENV, CONFIG_PATH, RunConfig, TrainerPlan
from rljob.trainer.sync import align

if TYPE_CHECKING:
    from rljob.trainer.hf_weights import BaseWeights

__all__ = [
    "BadConfig",
    "DistributedEnv",
    "align",
    "checkpoint_every",
    "distributed_env",
    "head_blocks",
    "main",
    "model_setup",
    "optimizer_options",
    "profile",
]

log = logging.getLogger("rljob.trainer")


class BadConfig(Exception):
    """A configuration problem: exit 2 with ``field: message``."""


class DistributedEnv:
    def __init__(
        self,
        coordinator: str,
        num_processes: int,
        process_id: int,
        in_cluster: bool,
        tpu_env: dict[str, str] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.num_processes = num_processes
        self.process_id = process_id
        self.in_cluster = in_cluster
        # libtpu's variables of this container (rljob.recipes.topology), exported before JAX starts.
        self.tpu_env = tpu_env or {}


def _rendered(env: dict[str, str], rc: RunConfig | None) -> dict[str, str]:
    """The container's environment, with what a render made before the topology variables existed filled
    from the run config (the same values the render now writes)."""
    if rc is None:
        return env
    tpu = rc.trainer.tpu
    defaults = {
        topology.SLICES_ENV: str(rc.trainer.slices),
        topology.HOSTS_ENV: str(tpu.hosts),
        topology.CONTAINERS_ENV: str(tpu.containers_per_host),
        topology.CHIPS_ENV: str(tpu.chips_per_container),
        topology.COORDINATOR_ENV: rc.endpoints.coordinator,
        topology.NAME_ENV: rc.name,
    }
    return {**{k: v for k, v in defaults.items() if v}, **env}


def distributed_env(rc: RunConfig | None, env: dict[str, str] | None = None) -> DistributedEnv:
    """Process topology from the container's JobSet environment (rljob.recipes.topology: in a pod, or a
    local process given a rendered container's environment, as ``rljob drill`` does) or from RLJOB_*
    overrides (local runs and tests)."""
    env = dict(os.environ if env is None else env)
    in_cluster = "KUBERNETES_SERVICE_HOST" in env
    if in_cluster or topology.CONTAINERS_ENV in env:
        try:
            top = topology.process_topology(_rendered(env, rc))
        except topology.TopologyError as e:
            raise BadConfig(str(e)) from e
        if rc is not None:
            want = rc.trainer.slices * rc.trainer.tpu.hosts * rc.trainer.tpu.containers_per_host
            if top.num_processes != want:
                raise BadConfig(
                    f"env {topology.SLICES_ENV}/{topology.HOSTS_ENV}/{topology.CONTAINERS_ENV}: "
                    f"{top.num_processes} processes, the run config's trainer has {want}"
                )
        return DistributedEnv(top.coordinator, top.num_processes, top.process_id, in_cluster, top.tpu_env)
    idx = env.get(topology.LOCAL_PROCESS_ID_ENV, "0")
    count = int(env.get(topology.LOCAL_NUM_PROCESSES_ENV, "1"))
    coord = env.get(topology.LOCAL_COORDINATOR_ENV, rc.endpoints.coordinator if rc is not None else "")
    try:
        pid = int(idx)
    except ValueError as e:
        raise BadConfig(f"env {topology.LOCAL_PROCESS_ID_ENV}: not an integer: {idx!r}") from e
    if count > 1 and not coord:
        raise BadConfig("endpoints.coordinator: required with more than one trainer process")
    if not 0 <= pid < max(count, 1):
        raise BadConfig(f"env {topology.LOCAL_PROCESS_ID_ENV}: {pid} is outside 0..{count - 1}")
    return DistributedEnv(coord, count, pid, in_cluster)


def settle_xla_flags(maxtext: Mapping[str, Any]) -> None:
    """XLA_FLAGS fixed before this process compiles anything (rljob.recipes.libtpu.settled_xla_flags): the
    trainer and the compile stage then file and look up its programs under the same cache keys."""
    value = libtpu.settled_xla_flags(os.environ, maxtext)
    if value is not None:
        os.environ[libtpu.XLA_FLAGS_ENV] = value


def initialize_distributed(
    denv: DistributedEnv, maxtext: Mapping[str, Any] | None = None, plan: TrainerPlan | None = None
) -> None:
    """JAX's distributed runtime for ``denv``; with ``plan``, the TPUs it sees checked against the plan's
    (rljob.trainer.devices: BadConfig naming each difference)."""
    # libtpu reads its process layout from the environment when the TPU backend starts: the container's
    # worker id, port and peers (rljob.recipes.topology), before anything imports JAX's TPU backend.
    os.environ.update(denv.tpu_env)
    settle_xla_flags(maxtext or {})
    import jax

    if denv.num_processes > 1:
        # CPU (the local multi-process runs and tests) needs a collectives backend across processes;
        # without one a cross-process computation waits forever. TPUs ignore this setting.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]
        jax.distributed.initialize(
            coordinator_address=denv.coordinator,
            num_processes=denv.num_processes,
            process_id=denv.process_id,
        )
    if plan is not None:
        from rljob.trainer import devices

        if found := devices.problems(plan, jax.local_devices(), jax.device_count()):
            # One line (the operator shows a failed container's last line): every difference, "; " apart.
            raise BadConfig("; ".join(found))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rljob-trainer", description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.environ.get(CONFIG_ENV, CONFIG_PATH), help="run.json path")
    p.add_argument(
        "--model",
        choices=["config", "tiny", "miniature"],
        default=os.environ.get(topology.TRAINER_MODEL_ENV, "config"),
        help="MaxText model: the run config's keys, the tiny CPU model, or (sampler loop only) the "
        "miniature of the run's model on the run config's mesh (rljob drill)",
    )
    p.add_argument(
        "--rollouts",
        choices=["sampler", "synthetic"],
        default="sampler",
        help="sampler: the RL loop against RunConfig.endpoints.samplers; synthetic: fixed synthetic rollouts",
    )
    p.add_argument("--steps", type=int, default=None, help="override spec.algorithm.steps")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the task's prompts, or of the synthetic rollouts"
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="steps between checkpoints (default: MaxText key checkpoint_period, else 1)",
    )
    p.add_argument("--tensorboard-dir", default=os.environ.get(topology.TENSORBOARD_DIR_ENV))
    p.add_argument("--log-jsonl", default=None, help="also append the JSON step lines to this file")
    p.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="sampler loop: evaluate held-out prompts every N steps (0: never); default "
        "spec.evaluation.every",
    )
    p.add_argument(
        "--parity-threshold",
        type=float,
        default=None,
        help="sampler loop: the step-0 parity gate's bound on the mean |logprob difference| (nats); default "
        "spec.sampler.weights.parityTolerance",
    )
    p.add_argument(
        "--distributed-check",
        action="store_true",
        help="initialize jax.distributed, print the process topology as JSON and exit",
    )
    return p


def load_config(path: str) -> RunConfig:
    try:
        return RunConfig.load(path)
    except FileNotFoundError as e:
        raise BadConfig(f"--config: no such file: {path}") from e
    except ValidationError as e:
        from rljob.recipes.plan import pydantic_problems

        problems = pydantic_problems(e) or [str(e).splitlines()[0]]
        raise BadConfig(problems[0]) from e
    except ValueError as e:  # JSON syntax
        raise BadConfig(f"--config: {path}: {str(e).splitlines()[0]}") from e


def _settings(rc: RunConfig, steps_override: int | None) -> dict[str, Any]:
    """The step settings of the resolved spec (``steps_override``: --steps)."""
    alg, lora, pack = rc.spec.algorithm, rc.spec.lora, rc.spec.packing
    steps = steps_override if steps_override is not None else alg.steps
    if steps <= 0:
        raise BadConfig(f"--steps: must be > 0, got {steps}")
    return {
        "steps": steps,
        "lr": alg.learning_rate,
        "loss": alg.loss,
        "kl": alg.kl_penalty_coef,
        "advantage_normalization": alg.advantage_normalization,
        "group_size": alg.group_size,
        "groups": alg.groups_per_batch,
        "rank": lora.rank,
        "alpha": lora.alpha,
        "targets": lora.targets,
        "budget": pack.token_budget,
        "pad_position": pack.pad_position,
        "segment_align": pack.segment_align,
        "pad_align": pack.pad_align,
        "max_segments": pack.max_segments_per_row,
    }


def tile_model(rc: RunConfig, budget: int, tiny: bool = False) -> dict[str, Any]:
    """StepConfig's context_ranks / kernel_blocks / dual_chunk_swap for padPosition balanced: the plan's
    context parallelism and Splash blocks. The tiny CPU model runs on one device with a short row: one
    context rank, blocks clamped to half its row."""
    from rljob.recipes import maxtext_keys

    keyset = maxtext_keys.load(rc.trainer.maxtext_version)
    context = rc.trainer.ici.context * rc.trainer.dcn.context
    model = maxtext_keys.attention_tile_model(rc.trainer.maxtext, keyset, 1 if tiny else context)
    if tiny:
        half = budget // 2
        model["kernel_blocks"] = tuple((min(q, half), min(k, half)) for q, k in model["kernel_blocks"])
    return model


def head_blocks(rc: RunConfig) -> dict[str, Any]:
    """spec.trainer.logprobs (the fused log-prob head's tile and chunk, filled by the plan) as StepConfig's
    ``token_tile`` / ``vocab_chunk``; the head clamps them to the shapes it meets (the tiny model's)."""
    lp = rc.spec.trainer.logprobs
    return {"token_tile": lp.token_tile, "vocab_chunk": lp.vocab_chunk}


DEFAULT_MICRO_BATCHES = 4  # micro-batches per compiled accumulate call without gradient_accumulation_steps


def optimizer_options(
    rc: RunConfig, steps: int, micro_batches: int = DEFAULT_MICRO_BATCHES
) -> dict[str, Any]:
    """StepConfig's optimizer, schedule and accumulation fields: spec.algorithm (learning rate, warm-up,
    schedule over ``steps``) and the MaxText keys rljob's trainer reads (rljob.recipes.maxtext_policy
    TRAINER_KEYS; the plan checked their values); ``micro_batches``: without gradient_accumulation_steps."""
    from rljob.recipes.maxtext_policy import trainer_float, trainer_int

    alg, keys = rc.spec.algorithm, dict(rc.trainer.maxtext)

    def dtype(key: str) -> str | None:
        return str(keys[key]) if keys.get(key) not in (None, "") else None

    return {
        "learning_rate": alg.learning_rate,
        "warmup_steps": alg.warmup_steps,
        "lr_schedule": alg.learning_rate_schedule,
        "total_steps": steps,
        "micro_batches": trainer_int(keys, "gradient_accumulation_steps", micro_batches),
        "max_grad_norm": trainer_float(keys, "gradient_clipping_threshold", 1.0),
        "weight_decay": trainer_float(keys, "adam_weight_decay", 0.0),
        "adam_b1": trainer_float(keys, "adam_b1", 0.9),
        "adam_b2": trainer_float(keys, "adam_b2", 0.999),
        "adam_eps": trainer_float(keys, "adam_eps", 1e-8),
        "adam_eps_root": trainer_float(keys, "adam_eps_root", 0.0),
        "mu_dtype": dtype("mu_dtype"),
        "grad_dtype": dtype("grad_dtype"),
    }


def checkpoint_every(rc: RunConfig, flag: int | None) -> int:
    """Steps between checkpoints: --checkpoint-every, else MaxText checkpoint_period, else every step."""
    from rljob.recipes.maxtext_policy import trainer_int

    every = flag if flag is not None else trainer_int(dict(rc.trainer.maxtext), "checkpoint_period", 1)
    if every < 1:
        raise BadConfig(f"--checkpoint-every: must be >= 1, got {every}")
    return every


def profile(rc: RunConfig, tensorboard_dir: str | None) -> Any:
    """The run's ProfileSettings (rljob.trainer.profiling; None without profiler: xplane): traces go under
    the TensorBoard directory (default {storage}/tensorboard: StoragePaths.profile)."""
    from rljob.trainer.profiling import profile_settings

    return profile_settings(dict(rc.trainer.maxtext), tensorboard_dir or rc.storage.tensorboard)


def loss_config(rc: RunConfig) -> Any:
    """The train step's LossConfig from spec.algorithm: the loss, its clip bounds (clipLow, clipHigh), the
    ratio's level (importanceRatio) and the KL penalty."""
    from rljob.trainer.losses import LossConfig

    alg = rc.spec.algorithm
    return LossConfig(
        kind=alg.loss,
        clip_low=alg.clip_low,
        clip_high=alg.clip_high,
        ratio=alg.importance_ratio,
        kl_coef=alg.kl_penalty_coef,
    )


def model_setup(rc: RunConfig, model: str, steps: int | None) -> tuple[Any, Any, dict[str, Any]]:
    """(ModelSpec, StepConfig, settings) of the run config (``model`` "config") or of the tiny CPU model
    with the config's other settings; raises BadConfig naming the field."""
    from rljob.trainer.model import ModelSpec, tiny_keys
    from rljob.trainer.train_step import StepConfig, model_problem

    st = _settings(rc, steps)
    checkpoint = rc.spec.model.checkpoint
    if model == "tiny":
        keys = tiny_keys()
        budget, rows, base_model = int(keys["max_target_length"]), 2, "rljob/tiny-qwen3"
        st.update(groups=4, group_size=4)
    else:
        from rljob.trainer.hf_weights import base_weights

        keys = dict(rc.trainer.maxtext)
        budget, rows = int(st["budget"]), int(rc.trainer.micro_batch_size)
        base_model = rc.spec.model.name
        # spec.model.checkpoint, else the conversion of spec.model.name that prepare_base_weights makes.
        checkpoint = base_weights(rc).checkpoint
    align: dict[str, Any] = {"segment_align": st["segment_align"], "pad_align": st["pad_align"]}
    if model == "tiny" and align["pad_align"] >= budget:  # the tiny model's rows are 128 tokens
        align["pad_align"] = budget // 2
    if st["pad_position"] == "balanced":
        align.update(tile_model(rc, budget, tiny=model == "tiny"))
    try:
        spec = ModelSpec(
            maxtext=keys,
            lora_rank=st["rank"],
            lora_alpha=st["alpha"],
            lora_targets=st["targets"],
            base_model=base_model,
            checkpoint=checkpoint,
            maxtext_version=rc.spec.trainer.maxtext_version,
        )
        step_cfg = StepConfig(
            budget=budget,
            rows=rows,
            **optimizer_options(rc, st["steps"]),
            loss=loss_config(rc),
            pad_position=st["pad_position"],
            max_segments=st["max_segments"],
            **align,
            **head_blocks(rc),
        )
        problem = model_problem(step_cfg, spec.decoder_block)
        if problem is not None:
            raise ValueError(problem)
        step_cfg.pack_config()
    except ValueError as e:
        raise BadConfig(str(e).splitlines()[0]) from e
    return spec, step_cfg, st


def resolved_base_weights(rc: RunConfig) -> BaseWeights:
    """The run's base weights (rljob.trainer.hf_weights.BaseWeights) with spec.model.revision resolved to a
    commit on the Hub once per run: process 0 asks at the first start and pins the answer for every later
    start and for the samplers (rljob.common.revision); every process gets its answer; a commit hash, or no
    route to the Hub, keeps the revision as written (``ref`` is then empty). Every process calls it (a
    collective); the resolved commit is printed. BadConfig names the field."""
    import jax
    from rljob.trainer.hf_weights import WeightsError, base_weights, resolve_revision, run_resolver

    try:
        bw = resolve_revision(
            base_weights(rc),
            run_resolver(rc.storage.root) if jax.process_index() == 0 else (lambda _m, _r: None),
            share=_from_process_0,
        )
    except WeightsError as e:
        raise BadConfig(str(e)) from e
    if bw.ref:
        print(_pinned_line(bw), file=sys.stderr, flush=True)
    return bw


def _pinned_line(bw: BaseWeights) -> str:
    return f"base weights: {bw.model}@{bw.ref} is commit {bw.revision}"


def prepare_base_weights(
    rc: RunConfig, maxtext: Any, report: Any = None, resolved: BaseWeights | None = None
) -> str:
    """Before the policy of ``--model config`` is built: the base weights at their pinned commit
    (``resolved``, or :func:`resolved_base_weights` now), then spec.model's weights converted into the
    storage cache keyed on that commit unless a complete conversion is there (process 0 converts, the others
    wait: rljob.trainer.hf_weights), or spec.model.checkpoint checked against the model the sampler serves.
    Returns the checkpoint the policy loads. ``report`` (a str callable) gets the resolved commit and the
    conversion's progress lines; BadConfig names the field."""
    import jax
    from rljob.common import caches
    from rljob.trainer.hf_weights import WeightsError, check_source, ensure_converted
    from rljob.trainer.model import maxtext_config

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        if report is not None:
            report(line)

    bw = resolved if resolved is not None else resolved_base_weights(rc)
    if bw.ref and report is not None:
        report(_pinned_line(bw))
    try:
        if not bw.convert:
            check_source(bw)
            return bw.checkpoint
        done = ensure_converted(
            bw,
            maxtext_config(maxtext),
            process_index=jax.process_index(),
            local_dir=caches.local_root(),
            report=say,
        )
    except WeightsError as e:
        raise BadConfig(str(e)) from e
    if not done.hit:
        say(f"base weights: converted {done.tensors} tensors in {done.seconds:.0f} s into {bw.directory}")
    return bw.checkpoint


def _from_process_0(value: str | None) -> str | None:
    """Process 0's ``value`` (a commit hash or None) on every process of the trainer."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    buf = np.zeros(40, np.uint8)
    if value:
        buf[:] = np.frombuffer(value.encode()[:40].ljust(40, b"0"), np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return bytes(got).decode() if got.any() else None


def max_non_finite_steps(rc: RunConfig) -> int:
    """spec.failurePolicy.maxNonFiniteSteps."""
    return rc.spec.failure_policy.max_non_finite_steps


def run_main(args: argparse.Namespace) -> int:
    rc = load_config(args.config)
    denv = distributed_env(rc)
    if args.model == "miniature" and args.rollouts != "sampler":
        raise BadConfig("--model miniature: only with --rollouts sampler (the loop rljob drill runs)")
    if rc.spec.service is not None and not args.distributed_check:
        # Service mode: no loop of its own; the trainer serves the API (process 0; every other process runs
        # its device operations: rljob.trainer.tinker.main).
        from rljob.trainer.tinker import main as service_main

        return service_main.main(["--config", args.config, "--model", args.model])
    initialize_distributed(denv, rc.trainer.maxtext, rc.trainer)
    import jax

    if args.rollouts == "sampler" and not args.distributed_check:
        from rljob.trainer import loop

        return loop.run_loop(
            rc,
            loop.LoopOptions(
                model=args.model,
                steps=args.steps,
                seed=args.seed,
                checkpoint_every=checkpoint_every(rc, args.checkpoint_every),
                eval_every=args.eval_every,
                parity_threshold=args.parity_threshold,
                tensorboard_dir=args.tensorboard_dir,
                log_jsonl=args.log_jsonl,
            ),
        )

    if args.distributed_check:
        print(
            json.dumps(
                {
                    "process_index": jax.process_index(),
                    "process_count": jax.process_count(),
                    "devices": jax.device_count(),
                    "local_devices": jax.local_device_count(),
                }
            ),
            flush=True,
        )
        return EXIT_OK

    from rljob.trainer.model import CheckpointError, Policy
    from rljob.trainer.progress import Reporter, StepLog, sink_for
    from rljob.trainer.runtime import RunPaths, RunSettings, run, synthetic_rollouts
    from rljob.trainer.train_step import Trainer

    spec, step_cfg, st = model_setup(rc, args.model, args.steps)
    budget, rows, groups, group_size = step_cfg.budget, step_cfg.rows, st["groups"], st["group_size"]
    reporter = Reporter(sink_for(rc, denv.in_cluster) if jax.process_index() == 0 else None)
    if args.model == "config":
        base = prepare_base_weights(rc, spec.maxtext, lambda line: reporter.update(message=line))
        spec = dataclasses.replace(spec, checkpoint=base)
    try:
        policy = Policy(spec)
    except CheckpointError as e:
        raise BadConfig(str(e)) from e
    trainer = Trainer(policy, step_cfg)
    tb_dir = args.tensorboard_dir or rc.storage.tensorboard  # under storage.root: outlives the pod
    steplog = StepLog(tb_dir if jax.process_index() == 0 else None, args.log_jsonl)
    steplog.event(
        "start",
        model=args.model,
        steps=st["steps"],
        processes=denv.num_processes,
        budget=budget,
        rows=rows,
        lora_rank=spec.lora_rank,
    )

    def source(step: int, lora: Any) -> tuple[list[Any], dict[str, float]]:
        return synthetic_rollouts(
            step,
            seed=args.seed,
            vocab_size=policy.vocab_size,
            groups=groups,
            group_size=group_size,
            max_prompt=budget // 4,
            max_completion=budget // 2,
            normalization=st["advantage_normalization"],
        )

    run(
        trainer,
        RunPaths(rc.storage.checkpoints, rc.storage.adapters, rc.storage.rollouts),
        RunSettings(
            steps=st["steps"],
            checkpoint_every=checkpoint_every(rc, args.checkpoint_every),
            export_adapters=jax.process_index() == 0,
            max_non_finite_steps=max_non_finite_steps(rc),
            profile=profile(rc, args.tensorboard_dir),
        ),
        source,
        steplog=steplog,
        reporter=reporter,
        to_peft=policy.peft.to_peft,
        peft_config=policy.peft.config(),
    )
    steplog.event("done", step=st["steps"])
    steplog.close()
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get(topology.LOG_LEVEL_ENV, "WARNING"))
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse: usage errors are bad configuration
        return EXIT_BAD_CONFIG if e.code not in (0, None) else EXIT_OK
    from google.auth.exceptions import DefaultCredentialsError
    from rljob.common.storage import NoCredentials
    from rljob.trainer.runtime import Diverged

    try:
        return run_main(args)
    except (BadConfig, Diverged) as e:
        print(f"rljob-trainer: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    except (DefaultCredentialsError, NoCredentials):  # google-auth's own: orbax and gcsfs paths
        print(f"rljob-trainer: {NO_CREDENTIALS}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
