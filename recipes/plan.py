"""Resolve and check an RLJob: recipe < profile < manifest, defaults, TPU plan, mesh, MaxText keys.

`resolve(job)` returns the RunConfig (contract 2) or raises PlanError carrying EVERY problem found,
each a line `spec.path: message`. Nothing here does I/O beyond the package's own data files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from rljob.recipes import (
    disk,
    failure,
    fit,
    libtpu,
    loop_options,
    manifest,
    maxtext_policy,
    mesh,
    models,
    naming,
    overrides,
    podpolicy,
    quantization,
    run_checks,
    sampler_layout,
    service_keys,
    spec_layers,
    startup,
    tpu,
    trainer_keys,
)
from rljob.recipes.api import PodTemplate, RLJob, RLJobSpec
from rljob.recipes.defaults import DEFAULT_DATASET_OBJECT, DEFAULT_PAD_ALIGN
from rljob.recipes.defaults import DEFAULT_SAMPLER_IMAGE as DEFAULT_SAMPLER_IMAGE  # re-exported
from rljob.recipes.defaults import DEFAULT_TRAINER_IMAGE as DEFAULT_TRAINER_IMAGE  # re-exported
from rljob.recipes.failure import SamplerFailure

# PlanError and pydantic's errors as `path: message` lines live below the plan and the manifest parser,
# which both raise them; re-exported here for the callers of the plan.
from rljob.recipes.problems import MAX_PROBLEM_CHARS as MAX_PROBLEM_CHARS
from rljob.recipes.problems import MAX_PROBLEMS as MAX_PROBLEMS
from rljob.recipes.problems import PlanError as PlanError
from rljob.recipes.problems import pydantic_problems as pydantic_problems
from rljob.recipes.runconfig import (
    COORDINATOR_PORT,
    SAMPLER_PORT,
    CacheDisk,
    Endpoints,
    PreflightPlacement,
    ProgressTarget,
    ResolvedSpec,
    RunConfig,
    SamplerPlan,
    StoragePaths,
    TpuPlan,
    TrainerPlan,
)


def _require(spec: RLJobSpec, problems: list[str]) -> bool:
    """Append a problem for each required field nobody set; whether there was one."""
    need = {
        "spec.model.name": spec.model and spec.model.name,
        "spec.trainer.tpu": spec.trainer and spec.trainer.tpu,
        "spec.sampler.tpu": spec.sampler and spec.sampler.tpu,
        "spec.storage.root": spec.storage and spec.storage.root,
    }
    missing = [path for path, value in need.items() if not value]
    for path in missing:
        problems.append(f"{path}: required (set it, or name a spec.recipe that does)")
    return bool(missing)


def resolve(
    job: RLJob,
    policy: podpolicy.PodPolicy = podpolicy.DEFAULT,
    *,
    fit_check: bool = True,
    restart_job: bool = True,
) -> RunConfig:
    """The resolved run config of a job, or PlanError with every problem. `policy`: the operator's pod
    policy (rljob.recipes.podpolicy), the same in the webhook, the reconcile and `rljob validate`.
    `restart_job`: whether the cluster's JobSet admits the failure action RestartJob (its feature gate
    RestartJob; the operator's start-up dry run or the chart's `jobset.restartJob`, `rljob plan
    --jobset-restart-job`): it decides what a sampler crash restarts (`RunConfig.sampler_failure`,
    rljob.recipes.failure).

    ``fit_check`` False skips the HBM fit check (rljob.recipes.fit) for the drill's scaled manifests,
    which keep the model's name on a shrunken slice and run a miniature of it.

    Each section below fills what it resolves into the working spec and appends its problems; a section
    whose input an earlier one could not resolve (a TPU shape) checks what it can and plans nothing. The
    problems of every section are raised together at the end."""
    spec, layers, problems = _working_spec(job)
    _dataset(spec, problems)
    _model(spec)
    seq = _algorithm_and_packing(spec, layers, job, problems)  # before the trainer: max_target_length
    trainer_tpu = _trainer_tpu(spec, problems)
    sampler_tpu = _sampler_tpu(spec, problems)
    _service(spec, problems)
    problems += loop_options.problems(spec, lambda *path: layers.sets(job, *path))
    problems += service_keys.problems(spec)
    _lora(spec, problems)
    assert spec.trainer is not None
    problems += libtpu.problems(spec.trainer.libtpu_flags, trainer_tpu.accelerator if trainer_tpu else None)
    sampler_plan = _sampler(spec, sampler_tpu, seq, layers, job, problems)
    trainer_plan = _trainer(spec, trainer_tpu, layers, job, problems)
    if fit_check:
        problems.extend(fit.plan_problems(spec, trainer_plan, sampler_plan))
    _pod_overrides(spec, problems)
    _pod_policy(spec, job, policy, problems)
    _names(spec, trainer_tpu, sampler_tpu, job, problems)
    _run_values(spec, job, problems)
    if problems or trainer_plan is None or sampler_plan is None:
        raise PlanError(problems or ["spec: could not be resolved"])
    return _run_config(
        spec, trainer_plan, sampler_plan, job, layers.derived, failure.sampler_failure(restart_job), policy
    )


def _working_spec(job: RLJob) -> tuple[RLJobSpec, spec_layers.Layers, list[str]]:
    """The merged spec (spec_layers.merged_spec) as a model the sections fill in, its layers and the
    problems found so far; PlanError at once when the merge is not a valid spec or lacks a required field."""
    merged, layers, problems = spec_layers.merged_spec(job)
    try:
        spec = RLJobSpec.model_validate(merged)
    except ValidationError as err:
        raise PlanError(problems + pydantic_problems(err, "spec")) from None
    # Without a required field or the recipe nothing further can be planned; any other problem found so
    # far (an unknown profile) is reported together with the rest.
    if _require(spec, problems) or layers.unknown_recipe:
        raise PlanError(problems)
    assert spec.model and spec.trainer and spec.sampler and spec.storage and spec.algorithm
    assert spec.lora and spec.packing and spec.failure_policy and spec.dataset
    assert spec.model.name and spec.trainer.tpu and spec.sampler.tpu and spec.storage.root
    # Set by DEFAULTS (a null in a layer is no value: _merge keeps the lower layer's).
    assert spec.trainer.slices and spec.trainer.maxtext_version and spec.sampler.max_num_seqs
    assert spec.sampler.expert_parallel and spec.sampler.data_parallel
    return spec, layers, problems


def _dataset(spec: RLJobSpec, problems: list[str]) -> None:
    """spec.dataset: fills path (the default object under the storage root) for a task that reads one."""
    assert spec.dataset and spec.storage and spec.storage.root
    # The task is any name the trainer image registers (docs/tasks.md); the trainer refuses an unknown one.
    if spec.dataset.task != "successor" and spec.dataset.path is None:
        spec.dataset.path = f"{spec.storage.root.rstrip('/')}/{DEFAULT_DATASET_OBJECT}"
    elif spec.dataset.task == "successor" and spec.dataset.path is not None:
        problems.append(
            "spec.dataset.path: task successor generates its prompts and reads no file (remove path, or "
            "set task: math)"
        )


def _model(spec: RLJobSpec) -> None:
    """spec.model: fills maxtextModel from the model name."""
    assert spec.model and spec.model.name
    if spec.model.maxtext_model is None:
        spec.model.maxtext_model = spec.model.name.rsplit("/", 1)[-1].lower()


def _algorithm_and_packing(
    spec: RLJobSpec, layers: spec_layers.Layers, job: RLJob, problems: list[str]
) -> int:
    """spec.algorithm and spec.packing: fills tokenBudget (and padAlign where its default cannot work);
    the longest sequence (maxPromptTokens + maxTokens)."""
    alg, pack = spec.algorithm, spec.packing
    assert alg and alg.max_prompt_tokens and alg.max_tokens and alg.group_size and alg.groups_per_batch
    assert pack and pack.pad_align and pack.segment_align and pack.pad_position
    seq = alg.max_prompt_tokens + alg.max_tokens
    group_problem = startup.group_size_problem(alg.group_size)
    if group_problem:
        problems.append(group_problem)
    if pack.token_budget is None:  # whole Splash blocks (trainer_keys.splash_problems checks a given one)
        unit = math.lcm(pack.segment_align, 128, trainer_keys.splash_unit(spec))
        pack.token_budget = trainer_keys.round_up(seq, unit)
    if pack.token_budget < seq:
        problems.append(
            f"spec.packing.tokenBudget: {pack.token_budget} is below maxPromptTokens + maxTokens = {seq}: "
            "a full-length sequence would not fit a packed row"
        )
    _rows_of_the_model(spec, layers, problems)
    fix = _pad_align_below(pack.segment_align, pack.token_budget)
    if (
        pack.pad_position != "end"
        and pack.pad_align >= pack.token_budget
        and fix
        and not layers.sets(job, "packing", "padAlign")
    ):
        layers.derived["spec.packing.padAlign"] = (
            f"the default {pack.pad_align} is not below the token budget {pack.token_budget}, so padPosition "
            f"{pack.pad_position} would never move a row: the largest segmentAlign {pack.segment_align} "
            "x 2^k below the budget"
        )
        pack.pad_align = fix
    if pack.segment_align > pack.token_budget:
        problems.append(
            f"spec.packing.segmentAlign: {pack.segment_align} exceeds the token budget {pack.token_budget}"
        )
    if pack.pad_align % pack.segment_align:
        problems.append(
            f"spec.packing.padAlign: {pack.pad_align} is not a multiple of segmentAlign {pack.segment_align}"
        )
    if pack.pad_position == "end" and pack.pad_align != DEFAULT_PAD_ALIGN:
        problems.append(
            f"spec.packing.padAlign: {pack.pad_align} is only read with padPosition start or balanced; with "
            "end it would do nothing (remove it, or set padPosition: start)"
        )
    if pack.pad_position != "end" and pack.pad_align >= pack.token_budget:
        default = "" if layers.sets(job, "packing", "padAlign") else " (the default)"
        problems.append(
            f"spec.packing.padAlign: {pack.pad_align}{default} is not below the token budget "
            f"{pack.token_budget}: padPosition {pack.pad_position} would never move a row; set padAlign to a "
            f"multiple of segmentAlign {pack.segment_align} below {pack.token_budget}"
            + (f" (e.g. {fix})" if fix else "")
            + " or raise spec.packing.tokenBudget above it"
        )
    return seq


def _rows_of_the_model(spec: RLJobSpec, layers: spec_layers.Layers, problems: list[str]) -> None:
    """spec.packing for the model's decoder: fills maxSegmentsPerRow 1 for a decoder with gated delta net
    layers (models.RECURRENT_DECODER_BLOCKS) and refuses another value, or padding anywhere but at the
    end, for it; any other decoder keeps what the spec says (None: as many rollouts as fit)."""
    assert spec.packing and spec.model
    pack = spec.packing
    block = trainer_keys.decoder_block(spec, (spec.trainer.maxtext if spec.trainer else None) or {})
    if not models.recurrent(block):
        return
    why = (
        f"the {block} decoder of {spec.model.maxtext_model} has gated delta net layers, whose state runs "
        "along the whole row, so it trains one rollout per row with the padding at the end"
    )
    if pack.pad_position != "end":
        problems.append(f"spec.packing.padPosition: {pack.pad_position}; {why} (set end, or remove it)")
    if pack.max_segments_per_row is None:
        pack.max_segments_per_row = 1
        layers.derived["spec.packing.maxSegmentsPerRow"] = why
    elif pack.max_segments_per_row != 1:
        problems.append(
            f"spec.packing.maxSegmentsPerRow: {pack.max_segments_per_row}; {why} (set 1, or remove it)"
        )


def _pad_align_below(segment_align: int, budget: int) -> int | None:
    """The largest segmentAlign x 2^k below the token budget (a padAlign padPosition start can use)."""
    best = None
    align = segment_align
    while 0 < align < budget:
        best = align
        align *= 2
    return best


def _trainer_tpu(spec: RLJobSpec, problems: list[str]) -> TpuPlan | None:
    """spec.trainer.tpu: one slice's TPU plan; fills containersPerHost. None: not a TPU shape."""
    assert spec.trainer and spec.trainer.tpu
    containers = spec.trainer.containers_per_host
    try:
        if containers is None:
            containers = tpu.default_containers(spec.trainer.tpu, "trainer")
        else:
            tpu.plan(spec.trainer.tpu)  # the shape alone: its own problem names spec.trainer.tpu
    except tpu.TpuError as e:
        problems.append(f"spec.trainer.tpu: {e}")
        return None
    try:
        trainer_tpu = tpu.plan(spec.trainer.tpu, containers)
    except tpu.TpuError as e:
        # a valid shape: what is refused is the containers the manifest (or its recipe) asked for
        problems.append(f"spec.trainer.containersPerHost: {e}")
        return None
    spec.trainer.containers_per_host = containers
    return trainer_tpu


def _sampler_tpu(spec: RLJobSpec, problems: list[str]) -> TpuPlan | None:
    """spec.sampler.tpu: one replica's TPU plan. None: not a TPU shape."""
    assert spec.sampler and spec.sampler.tpu
    try:
        return tpu.plan(spec.sampler.tpu)
    except tpu.TpuError as e:
        problems.append(f"spec.sampler.tpu: {e}")
        return None


def _service(spec: RLJobSpec, problems: list[str]) -> None:
    """spec.service (service mode): an adapter slot per training client. A trainer of any number of hosts
    and slices serves: process 0 answers the API and every process runs its device operations in the same
    order (rljob.trainer.tinker.collective); the rendered Service selects process 0's pod."""
    svc = spec.service
    if svc is None:
        return
    assert spec.trainer and spec.trainer.slices and spec.sampler
    assert spec.algorithm is not None
    problems.extend(maxtext_policy.service_algorithm_problems(spec.algorithm))
    assert svc.max_training_clients is not None and spec.sampler.max_loras is not None
    if spec.sampler.max_loras < svc.max_training_clients:
        problems.append(
            f"spec.sampler.maxLoras: {spec.sampler.max_loras} is below spec.service.maxTrainingClients "
            f"{svc.max_training_clients}: the samplers must hold every training client's adapter at once"
        )


def _lora(spec: RLJobSpec, problems: list[str]) -> None:
    """spec.lora: a rank vLLM serves; fills alpha (2 x rank). The targets are checked with the trainer's
    MaxText keys (trainer_keys.lora_problems)."""
    assert spec.lora
    if spec.lora.rank is not None and spec.lora.rank not in sampler_layout.VLLM_LORA_RANKS:
        problems.append(
            f"spec.lora.rank: {spec.lora.rank} is not a vLLM LoRA rank "
            f"({', '.join(map(str, sampler_layout.VLLM_LORA_RANKS))})"
        )
    if spec.lora.alpha is None and spec.lora.rank is not None:
        spec.lora.alpha = float(2 * spec.lora.rank)


def _sampler(
    spec: RLJobSpec,
    sampler_tpu: TpuPlan | None,
    seq: int,
    layers: spec_layers.Layers,
    job: RLJob,
    problems: list[str],
) -> SamplerPlan | None:
    """spec.sampler: fills the layout (rljob.recipes.sampler_layout: the rules of vLLM's TPU backend) and
    maxModelLen; None without a TPU plan."""
    if sampler_tpu is None:
        return None
    assert spec.sampler and spec.sampler.expert_parallel and spec.sampler.data_parallel
    assert spec.sampler.max_num_seqs and spec.lora
    layout = sampler_layout.resolve(
        spec.model.maxtext_model if spec.model else None,
        sampler_tpu.devices,
        sampler_tpu.type_name,
        sampler_tpu.type_name.rsplit("-", 1)[0],
        spec.sampler.tensor_parallel,
        spec.sampler.expert_parallel if layers.sets(job, "sampler", "expertParallel") else None,
        spec.sampler.data_parallel,
        trainer_keys.maxtext_version(spec),
    )
    tp, ep, dp = layout.tp, layout.ep, layout.dp
    spec.sampler.tensor_parallel, spec.sampler.expert_parallel, spec.sampler.data_parallel = tp, ep, dp
    layers.derived.update(layout.derived)
    problems.extend(layout.problems)
    if spec.sampler.max_model_len is None:
        spec.sampler.max_model_len = trainer_keys.round_up(seq, 128)  # >= 128, the field's minimum
    if spec.sampler.max_model_len < seq:
        problems.append(
            f"spec.sampler.maxModelLen: {spec.sampler.max_model_len} is below "
            f"maxPromptTokens + maxTokens = {seq}"
        )
    assert spec.lora.rank and spec.sampler.replicas and spec.sampler.max_loras
    quant = _sampler_weights(spec, sampler_tpu, problems)
    return SamplerPlan(
        tpu=sampler_tpu,
        replicas=spec.sampler.replicas,
        tensor_parallel=tp,
        expert_parallel=ep,
        data_parallel=dp,
        max_model_len=spec.sampler.max_model_len,
        lora_max_rank=spec.lora.rank,
        max_loras=spec.sampler.max_loras,
        max_num_seqs=spec.sampler.max_num_seqs,
        quantization=quant,
        cache_disk=_cache_disk(spec, "sampler", sampler_tpu, spec.sampler.template),
    )


def _sampler_weights(spec: RLJobSpec, sampler_tpu: TpuPlan, problems: list[str]) -> str:
    """spec.sampler.weights: checks it (rljob.recipes.quantization) and fills name, revision and
    parityTolerance; returns the quantization."""
    assert spec.sampler and spec.model and spec.model.name and spec.model.revision
    weights = spec.sampler.weights
    assert weights is not None and weights.quantization  # DEFAULTS
    generation = tpu.BY_ACCELERATOR.get(sampler_tpu.accelerator)
    problems += quantization.problems(weights.quantization, weights.name, spec.model.name, generation)
    q = quantization.get(weights.quantization)
    if weights.name is None or (q.vllm_method is None and weights.name == spec.model.name):
        weights.name = spec.model.name
        weights.revision = weights.revision or spec.model.revision
    weights.revision = weights.revision or "main"
    if weights.parity_tolerance is None:
        weights.parity_tolerance = q.parity_tolerance
    return q.name


def _trainer(
    spec: RLJobSpec, trainer_tpu: TpuPlan | None, layers: spec_layers.Layers, job: RLJob, problems: list[str]
) -> TrainerPlan | None:
    """spec.trainer: the meshes, the micro-batch (fills microBatchSize) and the final MaxText keys, with
    the log-prob head, balanced padding and LoRA targets checked against them; None without a TPU plan
    or a mesh (the MaxText keys and LoRA target names are still checked)."""
    if trainer_tpu is None:
        return None
    assert spec.trainer and spec.trainer.slices and spec.trainer.maxtext_version
    assert spec.packing and spec.packing.token_budget
    slices = spec.trainer.slices
    resolved = mesh.resolve(spec.trainer.mesh, trainer_tpu.devices, slices)
    if isinstance(resolved, list):
        problems.extend(resolved)
        trainer_keys.final_keys(spec, layers, job, {}, problems, rules=False)
        problems.extend(trainer_keys.lora_problems(spec, None))
        return None
    ici, dcn = resolved
    devices = trainer_tpu.devices * slices
    # Splash attention's shard_map splits a micro-batch's rows over these axes: an expert-parallel trainer
    # whose rows covered only data x fsdp did not compile for a TPU (rljob drill --compile found it).
    custom = (spec.trainer.maxtext or {}).get("custom_mesh_and_rule")
    axes = mesh.batch_axes(str(custom) if custom else None)
    shards = mesh.batch_shards(ici, dcn, str(custom) if custom else None)
    micro = spec.trainer.micro_batch_size or shards
    spec.trainer.micro_batch_size = micro
    if micro % shards:
        problems.append(
            f"spec.trainer.microBatchSize: {micro} rows do not split evenly over "
            f"{' x '.join(axes)} = {shards} shards, over which MaxText splits a micro-batch's rows "
            f"(Splash attention needs them even): use a multiple of {shards}"
        )
    keys, sources = trainer_keys.final_keys(
        spec, layers, job, trainer_keys.rljob_keys(spec, job, ici, dcn, micro / devices), problems
    )
    problems.extend(trainer_keys.head_problems(spec, keys, micro * spec.packing.token_budget, devices))
    context = mesh.total(ici, dcn, "context")
    balanced = (
        trainer_keys.balanced_problems(spec, keys, context) if spec.packing.pad_position == "balanced" else []
    )
    problems.extend(balanced or trainer_keys.splash_problems(spec, keys, context))
    problems.extend(trainer_keys.lora_problems(spec, keys))
    return TrainerPlan(
        tpu=trainer_tpu,
        slices=slices,
        hosts=trainer_tpu.hosts * slices,
        chips=trainer_tpu.chips * slices,
        devices=devices,
        ici=ici,
        dcn=dcn,
        micro_batch_size=micro,
        maxtext_version=spec.trainer.maxtext_version,
        maxtext=keys,
        maxtext_sources=sources,
        cache_disk=_cache_disk(spec, "trainer", trainer_tpu, spec.trainer.template, keys),
        libtpu_flags=libtpu.resolve(spec.trainer.libtpu_flags),
    )


def _cache_disk(
    spec: RLJobSpec,
    role: str,
    tpu: TpuPlan,
    template: PodTemplate | None,
    keys: Mapping[str, Any] | None = None,
) -> CacheDisk:
    """The local disk of one host's caches (rljob.recipes.disk), from the model's shapes under the trainer's
    final MaxText keys (the sampler's: the merged spec's keys, which hold every shape override); the
    trainer's counts its conversion of spec.model.name where spec.model.checkpoint is unset."""
    assert spec.model and spec.trainer
    model_keys = keys if keys is not None else (spec.trainer.maxtext or {})
    converts = role == "trainer" and not spec.model.checkpoint
    return disk.plan(
        role,
        str(spec.model.maxtext_model),
        model_keys,
        trainer_keys.maxtext_version(spec),
        tpu,
        template,
        converts,
    )


def _pod_overrides(spec: RLJobSpec, problems: list[str]) -> None:
    """spec.trainer.template and spec.sampler.template."""
    assert spec.trainer and spec.sampler
    problems.extend(overrides.problems("spec.trainer.template", spec.trainer.template))
    problems.extend(overrides.problems("spec.sampler.template", spec.sampler.template))


def _pod_policy(spec: RLJobSpec, job: RLJob, policy: podpolicy.PodPolicy, problems: list[str]) -> None:
    """The operator's pod policy: templates, images, PriorityClass (rljob.recipes.podpolicy)."""
    assert spec.trainer and spec.sampler
    own = naming.service_account(job.metadata.name)
    for role, part in (("trainer", spec.trainer), ("sampler", spec.sampler)):
        problems.extend(podpolicy.template_problems(f"spec.{role}.template", part.template, own, policy))
        problems.extend(podpolicy.image_problems(f"spec.{role}.image", part.image, policy))
    problems.extend(podpolicy.priority_class_problems(spec.priority_class_name, policy))


def _run_values(spec: RLJobSpec, job: RLJob, problems: list[str]) -> None:
    """Values Kubernetes, Kueue or Cloud Storage would refuse later (rljob.recipes.run_checks)."""
    assert spec.storage is not None
    problems.extend(run_checks.service_port(spec.service.port if spec.service else None))
    problems.extend(run_checks.queue_name(spec.queue_name))
    meta = job.metadata
    problems.extend(run_checks.storage_root(spec.storage.root, meta.namespace, meta.name, meta.uid))


def _names(
    spec: RLJobSpec, trainer_tpu: TpuPlan | None, sampler_tpu: TpuPlan | None, job: RLJob, problems: list[str]
) -> None:
    """metadata.name: the names of every object and pod the job gets are valid."""
    assert spec.trainer and spec.sampler
    roles: dict[str, tuple[int, int]] = {}
    if trainer_tpu is not None and spec.trainer.slices:
        roles[naming.TRAINER] = (spec.trainer.slices, trainer_tpu.hosts)
    if sampler_tpu is not None and spec.sampler.replicas:
        roles[naming.SAMPLER] = (spec.sampler.replicas, sampler_tpu.hosts)
    problems.extend(naming.check(job.metadata.name, roles))


def _run_config(
    spec: RLJobSpec,
    trainer_plan: TrainerPlan,
    sampler_plan: SamplerPlan,
    job: RLJob,
    derived: dict[str, str],
    sampler_failure: SamplerFailure,
    policy: podpolicy.PodPolicy,
) -> RunConfig:
    """The RunConfig of a resolved spec without problems."""
    assert spec.storage and spec.storage.root and spec.trainer
    name, ns = job.metadata.name, job.metadata.namespace
    preflight = None
    if spec.trainer.preflight is not None and spec.trainer.preflight.compile:
        preflight = PreflightPlacement(
            node_selector=dict(policy.preflight_node_selector),
            tolerations=[
                t.model_dump(mode="json", by_alias=True, exclude_none=True)
                for t in policy.preflight_tolerations
            ],
        )
    return RunConfig(
        name=name,
        namespace=ns,
        job_set_name=naming.jobset(name),
        spec=_resolved(spec),
        trainer=trainer_plan,
        sampler=sampler_plan,
        storage=storage_paths(spec.storage.root, job).model_copy(update={"converted": _converted(spec)}),
        endpoints=Endpoints(
            samplers=[naming.sampler_url(name, i, SAMPLER_PORT) for i in range(sampler_plan.replicas)],
            coordinator=f"{naming.coordinator(name)}:{COORDINATOR_PORT}",
        ),
        progress=ProgressTarget(config_map=naming.progress_configmap(name)),
        sampler_failure=sampler_failure,
        preflight=preflight,
        derived=dict(sorted(derived.items())) or None,
    )


def _resolved(spec: RLJobSpec) -> ResolvedSpec:
    """The typed resolved spec of a checked, filled working spec. A field left None that the resolved spec
    requires is a bug of this module (a pydantic ValidationError, not a PlanError)."""
    data = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    for key in ("tpu", "mesh", "maxtext", "libtpuFlags"):  # resolved into RunConfig.trainer
        data["trainer"].pop(key, None)
    data["sampler"].pop("tpu", None)  # resolved into RunConfig.sampler
    return ResolvedSpec.model_validate(data)


def _converted(spec: RLJobSpec) -> str:
    """StoragePaths.converted of a resolved spec."""
    assert spec.model and spec.model.name and spec.model.revision and spec.storage and spec.storage.root
    return converted_dir(
        spec.storage.root, spec.model.name, spec.model.revision, trainer_keys.maxtext_version(spec)
    )


CONVERTED_DIR = "cache/converted"


def converted_dir(root: str, model: str, revision: str, maxtext_version: str) -> str:
    """Where the MaxText checkpoint converted from a Hugging Face model lives under a storage root, keyed
    by everything that changes its bytes: the model, its revision and the MaxText version converting."""
    return f"{root.rstrip('/')}/{CONVERTED_DIR}/{model}@{revision}/maxtext-{maxtext_version}"


def storage_paths(root: str, job: RLJob) -> StoragePaths:
    """The storage locations of a job under a storage root (its namespace, name and uid)."""
    # The RLJob's uid makes the path this run's own: an RLJob deleted and created again under the same
    # name (a new uid) starts from scratch instead of resuming the old run's checkpoints and rollouts.
    base = f"{root.rstrip('/')}/{job.metadata.namespace}/{job.metadata.name}"
    if job.metadata.uid:
        base = f"{base}/{job.metadata.uid}"
    return StoragePaths(
        root=base,
        checkpoints=f"{base}/checkpoints",
        adapters=f"{base}/adapters",
        rollouts=f"{base}/rollouts",
        cache=f"{base}/cache",
        tensorboard=f"{base}/tensorboard",
        profile=f"{base}/tensorboard/plugins/profile",
    )


def _resolve_problems(job: RLJob) -> list[str]:
    """The problems the plan finds in a job (none: it resolves)."""
    try:
        resolve(job)
    except PlanError as e:
        return e.problems
    return []


def parse_manifest(text: str) -> RLJob:
    """An RLJob from YAML text (one document), bounded and checked as the API server checks it; PlanError
    with every problem as a `path: message` line, the plan's of the rest of a manifest with a bad part
    too (rljob.recipes.manifest)."""
    return manifest.parse_text(text, check=_resolve_problems)


def parse_object(doc: Any) -> RLJob:
    """An RLJob from a document (a manifest's data or an API body), as :func:`parse_manifest`."""
    return manifest.parse_object(doc, check=_resolve_problems)
