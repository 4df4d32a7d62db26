"""Resolve and check an RLJob: recipe < profile < manifest, defaults, TPU plan, mesh, MaxText keys.

`resolve(job)` returns the RunConfig (contract 2) or raises PlanError carrying EVERY problem found,
each a line `spec.path: message`. Nothing here does I/O beyond the package's own data files.
"""

from __future__ import annotations

import copy
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
    lora_targets,
    manifest,
    maxtext_keys,
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
    startup,
    tpu,
)
from rljob.recipes.api import PodTemplate, RLJob, RLJobSpec
from rljob.recipes.defaults import DEFAULT_DATASET_OBJECT, DEFAULT_PAD_ALIGN, DEFAULTS
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
    MeshPlan,
    PreflightPlacement,
    ProgressTarget,
    ResolvedSpec,
    RunConfig,
    SamplerPlan,
    StoragePaths,
    TpuPlan,
    TrainerPlan,
)
from rljob.recipes.syntax import key_path

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The fused log-prob head's token tile defaults to the largest divisor of a device's tokens per
# micro-batch up to this (spec.trainer.logprobs.tokenTile).
MAX_DEFAULT_TOKEN_TILE = 2048
# The plain defaults (DEFAULTS: the one table, rljob.recipes.defaults) without spec.service's, which apply
# only to a spec that sets spec.service.
_BASE_DEFAULTS = {k: v for k, v in DEFAULTS.items() if k != "service"}

# MaxText keys rljob derives from the spec; a recipe, profile or manifest may not set them. Those of
# NOT_IN_KEYS are not put in the final key dict either: nothing rljob runs reads them there (the trainer
# reads the spec field itself; rljob.recipes.maxtext_policy), so `rljob plan` does not list them.
DERIVED_KEYS: dict[str, str] = {
    "model_name": "spec.model.maxtextModel",
    "run_name": "metadata.name",
    "base_output_directory": "spec.storage.root",
    "load_parameters_path": "spec.model.checkpoint",
    "max_target_length": "spec.packing.tokenBudget",
    "per_device_batch_size": "spec.trainer.microBatchSize",
    "learning_rate": "spec.algorithm.learningRate",
    "steps": "spec.algorithm.steps",
    "packing": "spec.packing",
    **{
        f"{kind}_{axis}_parallelism": "spec.trainer.mesh"
        for kind in ("ici", "dcn")
        for axis in ("data", "fsdp", "tensor", "context", "expert")
    },
}

# Unknown MaxText keys that get a "did you mean" hint (see _maxtext).
MAX_KEY_HINTS = 10

# Where each maxtext key came from, lowest precedence first; "derived": no layer set it and MaxText's
# default would not run, so the plan filled the value that does (RunConfig.derived says why).
SOURCES = ("rljob", "recipe", "profile", "manifest", "derived")


def _merge(base: dict[str, Any], over: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    """Deep merge key by key; `tpu` and lists are replaced whole; a maxtext key set to null is removed.

    Any other null is no value, as the API server prunes it from a stored RLJob (the CRD declares no
    field nullable): the lower layer's value stays, so `rljob render` of a file with `maxTokens: null`
    gives what the operator renders from the stored object."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        here = (*path, key)
        if value is None:
            if path and path[-1] in ("maxtext", "libtpuFlags"):
                out.pop(key, None)
        elif key != "tpu" and isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, here)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _dump(spec: RLJobSpec) -> dict[str, Any]:
    return spec.model_dump(mode="json", by_alias=True, exclude_unset=True)


class _Layers:
    """The spec layers of a job and the maxtext keys each contributes."""

    def __init__(self) -> None:
        self.recipe: dict[str, Any] = {}
        self.profile: dict[str, Any] = {}
        self.recipe_name: str | None = None
        self.profile_name: str | None = None
        self.unknown_recipe = False
        # What the plan filled because the default would not run: spec path -> reason (RunConfig.derived).
        self.derived: dict[str, str] = {}

    def sets(self, job: RLJob, *path: str) -> bool:
        """Whether the recipe, its profile or the manifest sets the spec field at ``path`` (camelCase
        keys under spec): a value the plan may not replace by a derived one."""
        for layer in (self.recipe, self.profile, _dump(job.spec)):
            node: Any = layer
            for key in path:
                node = node.get(key) if isinstance(node, dict) else None
            if node is not None:
                return True
        return False


def _layers(job: RLJob, problems: list[str]) -> _Layers:
    from rljob.recipes import recipe_catalog

    layers = _Layers()
    manifest = _dump(job.spec)
    name = job.spec.recipe
    if name is not None:
        try:
            recipe = recipe_catalog.load(name)
        except KeyError:
            problems.append(
                f"spec.recipe: unknown recipe {name!r}; known: {', '.join(recipe_catalog.names())}"
            )
            layers.unknown_recipe = True
            return layers
        layers.recipe_name = name
        layers.recipe = _dump(recipe.spec)
        profile = (manifest.get("trainer") or {}).get("profile") or (layers.recipe.get("trainer") or {}).get(
            "profile"
        )
        if profile is not None:
            if profile not in recipe.profiles:
                known = ", ".join(recipe.profiles) or "none"
                problems.append(
                    f"spec.trainer.profile: recipe {name} has no profile {profile!r}; profiles: {known}"
                )
            else:
                layers.profile_name = profile
                layers.profile = _dump(recipe.profiles[profile].spec)
    elif job.spec.trainer is not None and job.spec.trainer.profile is not None:
        problems.append("spec.trainer.profile: a profile belongs to a recipe; set spec.recipe")
    return layers


def merged_spec(job: RLJob) -> tuple[dict[str, Any], _Layers, list[str]]:
    """defaults < recipe < profile < manifest, as a camelCase dict, with the problems found so far."""
    problems: list[str] = []
    layers = _layers(job, problems)
    upper = _merge(_merge(layers.recipe, layers.profile), _dump(job.spec))
    base = _BASE_DEFAULTS
    if isinstance(upper.get("service"), dict):
        # The samplers' maxLoras then defaults to one adapter per training client (each client's newest
        # sampler weights served at once).
        clients = upper["service"].get("maxTrainingClients") or DEFAULTS["service"]["maxTrainingClients"]
        base = _merge(
            _BASE_DEFAULTS,
            {
                "service": DEFAULTS["service"],
                "sampler": {"maxLoras": max(int(DEFAULTS["sampler"]["maxLoras"]), int(clients))},
            },
        )
    merged = _merge(_merge(_merge(base, layers.recipe), layers.profile), _dump(job.spec))
    return merged, layers, problems


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


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


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


def _working_spec(job: RLJob) -> tuple[RLJobSpec, _Layers, list[str]]:
    """The merged spec (merged_spec) as a model the sections fill in, its layers and the problems found so
    far; PlanError at once when the merge is not a valid spec or lacks a required field."""
    merged, layers, problems = merged_spec(job)
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


def _algorithm_and_packing(spec: RLJobSpec, layers: _Layers, job: RLJob, problems: list[str]) -> int:
    """spec.algorithm and spec.packing: fills tokenBudget (and padAlign where its default cannot work);
    the longest sequence (maxPromptTokens + maxTokens)."""
    alg, pack = spec.algorithm, spec.packing
    assert alg and alg.max_prompt_tokens and alg.max_tokens and alg.group_size and alg.groups_per_batch
    assert pack and pack.pad_align and pack.segment_align and pack.pad_position
    seq = alg.max_prompt_tokens + alg.max_tokens
    group_problem = startup.group_size_problem(alg.group_size)
    if group_problem:
        problems.append(group_problem)
    if pack.token_budget is None:
        pack.token_budget = _round_up(seq, math.lcm(pack.segment_align, 128))
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


def _rows_of_the_model(spec: RLJobSpec, layers: _Layers, problems: list[str]) -> None:
    """spec.packing for the model's decoder: fills maxSegmentsPerRow 1 for a decoder with gated delta net
    layers (models.RECURRENT_DECODER_BLOCKS) and refuses another value, or padding anywhere but at the
    end, for it; any other decoder keeps what the spec says (None: as many rollouts as fit)."""
    assert spec.packing and spec.model
    pack = spec.packing
    block = _decoder_block(spec, (spec.trainer.maxtext if spec.trainer else None) or {})
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


def _decoder_block(spec: RLJobSpec, keys: Mapping[str, Any]) -> str | None:
    """The model's MaxText decoder block: the ``decoder_block`` key of ``keys``, else its model config's
    (MaxText's default under it); None where the MaxText version or the model is unknown (reported by
    _maxtext)."""
    assert spec.model is not None
    try:
        keyset = maxtext_keys.load(_version(spec))
    except KeyError:
        return None
    if str(spec.model.maxtext_model) not in keyset.models:
        return None
    return str(
        maxtext_keys.effective(keys, keyset, str(spec.model.maxtext_model))("decoder_block") or ""
    ).lower()


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
    MaxText keys (_lora_problems)."""
    assert spec.lora
    if spec.lora.rank is not None and spec.lora.rank not in VLLM_LORA_RANKS:
        problems.append(
            f"spec.lora.rank: {spec.lora.rank} is not a vLLM LoRA rank "
            f"({', '.join(map(str, VLLM_LORA_RANKS))})"
        )
    if spec.lora.alpha is None and spec.lora.rank is not None:
        spec.lora.alpha = float(2 * spec.lora.rank)


def _sampler(
    spec: RLJobSpec, sampler_tpu: TpuPlan | None, seq: int, layers: _Layers, job: RLJob, problems: list[str]
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
        _version(spec),
    )
    tp, ep, dp = layout.tp, layout.ep, layout.dp
    spec.sampler.tensor_parallel, spec.sampler.expert_parallel, spec.sampler.data_parallel = tp, ep, dp
    layers.derived.update(layout.derived)
    problems.extend(layout.problems)
    if spec.sampler.max_model_len is None:
        spec.sampler.max_model_len = _round_up(seq, 128)  # >= 128, the field's minimum
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
    spec: RLJobSpec, trainer_tpu: TpuPlan | None, layers: _Layers, job: RLJob, problems: list[str]
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
        _maxtext(spec, layers, job, {}, problems, rules=False)
        problems.extend(_lora_problems(spec, None))
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
    keys, sources = _maxtext(spec, layers, job, _derived_keys(spec, job, ici, dcn, micro / devices), problems)
    problems.extend(_head_problems(spec, keys, micro * spec.packing.token_budget, devices))
    if spec.packing.pad_position == "balanced":
        problems.extend(_balanced_problems(spec, keys, mesh.total(ici, dcn, "context")))
    problems.extend(_lora_problems(spec, keys))
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
    final MaxText keys (the sampler's: the merged spec's keys, which hold every shape override)."""
    assert spec.model and spec.trainer
    model_keys = keys if keys is not None else (spec.trainer.maxtext or {})
    return disk.plan(role, str(spec.model.maxtext_model), model_keys, _version(spec), tpu, template)


NOT_IN_KEYS = frozenset(
    {"run_name", "base_output_directory", "load_parameters_path", "learning_rate", "steps"}
)


def _derived_keys(
    spec: RLJobSpec, job: RLJob, ici: MeshPlan, dcn: MeshPlan, per_device_batch: float
) -> dict[str, Any]:
    """The MaxText keys rljob sets from the spec (DERIVED_KEYS but NOT_IN_KEYS)."""
    assert spec.model and spec.packing
    return {
        "model_name": spec.model.maxtext_model,
        "max_target_length": spec.packing.token_budget,
        "per_device_batch_size": per_device_batch,
        "packing": True,
        **mesh.maxtext_keys(ici, dcn),
    }


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
    return converted_dir(spec.storage.root, spec.model.name, spec.model.revision, _version(spec))


def _version(spec: RLJobSpec) -> str:
    """spec.trainer.maxtextVersion (set by DEFAULTS)."""
    assert spec.trainer is not None and spec.trainer.maxtext_version is not None
    return spec.trainer.maxtext_version


def _head_problems(spec: RLJobSpec, keys: Mapping[str, Any], tokens: int, devices: int) -> list[str]:
    """What the trainer's fused log-prob head needs (rljob.trainer.model / logprobs), checked here so the
    trainer never refuses at start: MaxText's hidden states in training, MaxText's vocabulary tiling at
    the trainer's value, and block sizes that fit a device's share of a micro-batch (``tokens``: packed
    tokens of one micro-batch over all ``devices``). Fills spec.trainer.logprobs.tokenTile."""
    assert spec.trainer is not None and spec.trainer.logprobs is not None and spec.model is not None
    out: list[str] = []
    version = _version(spec)
    try:
        keyset = maxtext_keys.load(version)
    except KeyError:
        return out  # reported by _maxtext
    get = maxtext_keys.effective(keys, keyset, str(spec.model.maxtext_model))

    path = "spec.trainer.maxtext"
    attention = str(get("attention"))
    if attention in ("vllm_rpa", "vllm_batched_rpa"):
        out.append(
            f"{path}.attention: {attention} is vLLM's serving attention: MaxText then computes neither "
            "logits nor the hidden states the trainer's log-prob head reads"
        )
    if (
        maxtext_keys.truthy(get("use_indexer"))
        and (maxtext_keys.number(get("indexer_loss_scaling_factor")) or 0.0) > 0
        and not maxtext_keys.truthy(get("indexer_sparse_training"))
    ):
        out.append(
            f"{path}.use_indexer: the indexer's dense warm-up (indexer_loss_scaling_factor > 0 without "
            "indexer_sparse_training) trains the indexer alone: MaxText skips the hidden states the RL "
            "trainer's log-prob head reads"
        )
    if maxtext_keys.truthy(get("quantize_logits_proj")):
        out.append(
            f"{path}.quantize_logits_proj: MaxText refuses it with vocabulary tiling, which the trainer "
            f"always turns on (num_vocab_tiling >= {maxtext_keys.TRAINER_MIN_VOCAB_TILING}) to read the "
            "hidden states instead of [B, T, V] logits"
        )
    tiling = maxtext_keys.TRAINER_MIN_VOCAB_TILING
    per_device = tokens / devices  # per_device_batch_size x max_target_length
    explicit = int(maxtext_keys.number(get("num_vocab_tiling")) or 1)
    # An explicit num_vocab_tiling > 1 is MaxText's own rule (maxtext_keys.check_rules); at 1 the trainer
    # raises it to its minimum, which MaxText then checks at start.
    if explicit <= 1 and (per_device != int(per_device) or int(per_device) % tiling):
        out.append(
            f"spec.trainer.microBatchSize: {per_device:g} tokens per device (microBatchSize x tokenBudget / "
            f"{devices} devices) do not split into the {tiling} vocabulary tiles of MaxText's "
            "num_vocab_tiling, which the trainer sets to at least "
            f"{maxtext_keys.TRAINER_MIN_VOCAB_TILING} (the hidden states instead of [B, T, V] logits)"
        )
    lp = spec.trainer.logprobs
    if per_device == int(per_device) and per_device >= 1:
        n = int(per_device)
        if lp.token_tile is None:
            lp.token_tile = max(d for d in range(1, min(n, MAX_DEFAULT_TOKEN_TILE) + 1) if n % d == 0)
        elif n % lp.token_tile:
            out.append(
                f"spec.trainer.logprobs.tokenTile: {lp.token_tile} does not divide the {n} tokens each "
                f"device scores per micro-batch (microBatchSize x tokenBudget / {devices} devices): the last "
                "tile of every micro-batch would be partly recomputed"
            )
    elif lp.token_tile is None:
        lp.token_tile = MAX_DEFAULT_TOKEN_TILE
    vocab = maxtext_keys.number(get("vocab_size"))
    if lp.vocab_chunk is not None and vocab and lp.vocab_chunk > vocab:
        out.append(
            f"spec.trainer.logprobs.vocabChunk: {lp.vocab_chunk} exceeds the model's vocabulary of {vocab:g} "
            "tokens"
        )
    return out


def _lora_problems(spec: RLJobSpec, keys: Mapping[str, Any] | None) -> list[str]:
    """What the trainer checks of spec.lora.targets at start (rljob.recipes.lora_targets, the one table
    both use): known projection names and, with the MaxText keys, projections the model's decoder block
    has. ``keys`` None: the names only."""
    assert spec.lora is not None and spec.model is not None and spec.trainer is not None
    targets = spec.lora.targets or []
    block = None  # the names only: no keys, or an unknown model (reported by _maxtext)
    q_lora_rank, sliced = None, False
    if keys is not None:
        if _version(spec) not in maxtext_keys.versions():
            return []  # reported by _maxtext
        block = _decoder_block(spec, keys)
        get = maxtext_keys.effective(keys, maxtext_keys.load(_version(spec)), str(spec.model.maxtext_model))
        q_lora_rank, sliced = get("q_lora_rank") or 0, get("use_sliced_mla_proj") or False
    found = lora_targets.problems(block, targets)
    if not found:
        found = lora_targets.mla_problems(block, targets, q_lora_rank, sliced)
    found += lora_targets.sampler_problems(block, targets)
    return [f"{field}: {message}" for field, message in found]


def _balanced_problems(spec: RLJobSpec, keys: Mapping[str, Any], context: int) -> list[str]:
    """padPosition balanced: the row must split into 2 x context chunks of whole query blocks and into
    whole key blocks of both Splash kernels (the tile model the trainer's packer scores)."""
    assert spec.packing and spec.packing.token_budget and spec.trainer
    try:
        keyset = maxtext_keys.load(_version(spec))
    except KeyError:
        return []  # the unknown version is reported by _maxtext
    model = maxtext_keys.attention_tile_model(keys, keyset, context)
    budget = spec.packing.token_budget
    out = []
    blocks = [n for q, k in model["kernel_blocks"] for n in (2 * context * q, k)]
    # the smallest budget from this one up that every kernel's blocks split (with positive blocks)
    unit = math.lcm(spec.packing.segment_align or 1, *blocks) if min(blocks) > 0 else 1
    fits = _round_up(budget, unit)
    for names, (bq, bk) in zip(maxtext_keys.SPLASH_BLOCK_KEYS, model["kernel_blocks"], strict=True):
        if bq <= 0 or bk <= 0:
            out.append(
                f"spec.trainer.maxtext.{names[0]}: Splash blocks must be positive for padPosition balanced"
            )
        elif budget % (2 * context * bq) or budget % bk:
            out.append(
                f"spec.packing.tokenBudget: {budget} must be a multiple of 2 x context {context} x "
                f"{names[0]} {bq} and of {names[1]} {bk} for padPosition balanced (the next budget that "
                f"fits every kernel: {fits})"
            )
    return out


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


def _maxtext(
    spec: RLJobSpec,
    layers: _Layers,
    job: RLJob,
    derived: dict[str, Any],
    problems: list[str],
    rules: bool = True,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The final MaxText key dict and each key's source; problems appended."""
    assert spec.trainer is not None
    version = _version(spec)
    try:
        keyset = maxtext_keys.load(version)
    except KeyError:
        problems.append(
            f"spec.trainer.maxtextVersion: no MaxText key list for {version!r}; "
            f"known: {', '.join(maxtext_keys.versions())}"
        )
        return {}, {}
    job_keys = dict((job.spec.trainer.maxtext or {}) if job.spec.trainer else {})
    recipe_keys = dict((layers.recipe.get("trainer") or {}).get("maxtext") or {})
    profile_keys = dict((layers.profile.get("trainer") or {}).get("maxtext") or {})
    layer_keys = {"recipe": recipe_keys, "profile": profile_keys, "manifest": job_keys}
    where = {
        "recipe": f" (from recipe {layers.recipe_name})",
        "profile": f" (from profile {layers.profile_name} of recipe {layers.recipe_name})",
        "manifest": "",
    }
    keys: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for k, v in derived.items():
        keys[k], sources[k] = v, "rljob"
    hints_left = MAX_KEY_HINTS
    for source in ("recipe", "profile", "manifest"):
        for k, v in layer_keys[source].items():
            path = key_path("spec.trainer.maxtext", k)
            if v is None:  # a manifest removing a recipe key
                keys.pop(k, None)
                sources.pop(k, None)
                continue
            if k in DERIVED_KEYS:
                problems.append(
                    f"{path}: set by rljob from {DERIVED_KEYS[k]}; set that instead{where[source]}"
                )
                continue
            if k not in keyset:
                # difflib costs O(keys x key length) per unknown key: hints for the first few only.
                hint = keyset.suggest(k) if hints_left > 0 and len(k) <= 64 else []
                hints_left -= 1
                problems.append(
                    f"{path}: not a MaxText {keyset.version} config key{where[source]}"
                    + (f" (did you mean {', '.join(hint)}?)" if hint else "")
                )
                continue
            if spec.service is not None and source != "manifest" and k in maxtext_policy.SERVICE_UNREAD:
                continue  # a recipe's loop-mode key the Tinker service does not read: left out, not listed
            why = maxtext_policy.problem(k, v, keyset, service=spec.service is not None)
            if why is not None:
                problems.append(f"{path}: {why}{where[source]}")
                continue
            keys[k], sources[k] = v, source
    if spec.model and spec.model.maxtext_model not in keyset.models:
        problems.append(
            f"spec.model.maxtextModel: {spec.model.maxtext_model!r} is not a MaxText "
            f"{keyset.version} model name"
        )
    for k, (value, why) in maxtext_keys.derived_keys(keys, keyset).items():
        keys[k], sources[k] = value, "derived"
        layers.derived[key_path("spec.trainer.maxtext", k)] = why
    if rules:
        for k, msg in maxtext_keys.check_rules(keys, keyset):
            origin = where.get(sources.get(k, ""), "")
            problems.append(f"{key_path('spec.trainer.maxtext', k)}: {msg}{origin}")
    return dict(sorted(keys.items())), dict(sorted(sources.items()))


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
