"""The resolved run config (contract 2).

The renderer writes one `RunConfig` as JSON into the run ConfigMap (key `run.json`), mounted in every
trainer and sampler pod at `/etc/rljob/run.json`; the path is also in env `RLJOB_CONFIG`. Trainer and
sampler entrypoints read it with `RunConfig.load(path)`. Locally (laptop, tests) the same file points at
local ports and a gs:// root on the GCS emulator.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field
from rljob.recipes.api import ApiModel, PodTemplate
from rljob.recipes.failure import SamplerFailure

CONFIG_KEY = "run.json"
CONFIG_DIR = "/etc/rljob"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
CONFIG_ENV = "RLJOB_CONFIG"
PROGRESS_KEY = "progress.json"
SAMPLER_PORT = 8000
# Each sampler's adapter agent (load a PEFT directory from storage on request; the Tinker service uses it)
# listens on the sampler's port + this offset, at this path.
ADAPTER_AGENT_PORT_OFFSET = 1
ADAPTER_AGENT_PATH = "/rljob/v1/adapters"
# The `logprobs` of every completion request to a sampler: the sampled token's log-prob comes back with any
# value >= 0, but vLLM's TPU engine (tpu-inference 0.32) computes none for 0 and answers tokens without
# them (https://github.com/vllm-project/tpu-inference/issues/3572; seen on a v5e with rljob's flags), so 1
# (the sampled token's and one alternative's; the trainer reads `token_logprobs` only).
SAMPLED_LOGPROBS = 1
# The adapter agent loads PEFT directories from below this folder of spec.storage's adapters only.
NAMED_ADAPTERS_DIR = "tinker"
# The API keys a service-mode trainer accepts (comma-separated), from key API_KEYS_SECRET_KEY of the
# Secret spec.service.apiKeySecret names.
API_KEYS_ENV = "RLJOB_TINKER_API_KEYS"
API_KEYS_SECRET_KEY = "api-keys"
# A service-mode trainer serves HTTPS when both are set: the PEM certificate chain and its private key (the
# keys tls.crt and tls.key of a kubernetes.io/tls Secret, given through spec.trainer.template env).
TLS_CERT_ENV = "RLJOB_TINKER_TLS_CERT"
TLS_KEY_ENV = "RLJOB_TINKER_TLS_KEY"
# The run's own token (rljob.common.credentials): from key RUN_TOKEN_SECRET_KEY of the Secret the operator
# creates for each run (naming.credentials_secret), in every trainer and sampler container's env.
RUN_TOKEN_ENV = "RLJOB_RUN_TOKEN"
RUN_TOKEN_SECRET_KEY = "token"
# The sampler gives vLLM the run's token in this variable, vLLM's own for its --api-key (in the env, not in
# the argv, so it shows in no process list or log line).
VLLM_API_KEY_ENV = "VLLM_API_KEY"
# The JAX coordinator (trainer process 0). Not 8476..8479: libtpu's TPU_PROCESS_PORT of the pod's TPU
# containers (rljob.recipes.topology); 8482 is the port JAX's own Cloud TPU cluster detection uses for it
# (jax/_src/clusters/cloud_tpu_cluster.py, coordinator_port).
COORDINATOR_PORT = 8482
# A multi-host sampler replica is one vLLM server over a Ray cluster (rljob.sampler.ray_replica): the
# replica's hosts, its head's address (pod 0) and the Ray head's port, in every sampler container's env.
SAMPLER_HOSTS_ENV = "RLJOB_SAMPLER_HOSTS"
RAY_HEAD_ENV = "RLJOB_RAY_HEAD"
RAY_PORT_ENV = "RLJOB_RAY_PORT"
RAY_PORT = 6379
# Ray's token authentication (Ray >= 2.52: https://docs.ray.io/en/latest/ray-security/token-auth.html):
# every node of a replica's Ray cluster gets RAY_AUTH_MODE=token and the run's token as RAY_AUTH_TOKEN.
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
# Local disk of a pod (or a laptop) where the caches kept under storage.root are restored before start.
# In a pod it is rljob's emptyDir volume CACHE_VOLUME mounted at LOCAL_CACHE_DEFAULT, sized by the plan
# (CacheDisk, rljob.recipes.disk), not the container's writable layer.
LOCAL_CACHE_ENV = "RLJOB_LOCAL_CACHE"
LOCAL_CACHE_DEFAULT = "/tmp/rljob-cache"
CACHE_VOLUME = "rljob-cache"
# The object under StoragePaths.root that names the commit spec.model.revision resolved to for this run:
# written once, by the trainer's process 0 at its first start; every later start of either role serves or
# trains that commit (rljob.common.revision).
BASE_REVISION_KEY = "base-revision.json"

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "context", "expert")


class TpuPlan(ApiModel):
    """One slice of one role, resolved from the catalog."""

    accelerator: str = Field(description="Node label cloud.google.com/gke-tpu-accelerator value.")
    topology: str = Field(description="Node label cloud.google.com/gke-tpu-topology value (AxB or AxBxC).")
    type_name: str = Field(
        description="xpk-style name, e.g. v5p-16, v5litepod-16 (TensorCores: the generation's per chip x "
        "chips)."
    )
    machine_type: str = Field(description="GCE machine type of one host.")
    chips: int = Field(strict=True, ge=1, description="Chips in one slice.")
    hosts: int = Field(strict=True, ge=1, description="Hosts (VMs, pods) in one slice.")
    chips_per_host: int = Field(strict=True, ge=1, description="Chips per host.")
    devices_per_chip: int = Field(
        strict=True, ge=1, description="JAX devices per chip (the generation's, rljob.recipes.generations)."
    )
    devices: int = Field(strict=True, ge=1, description="JAX devices in one slice.")
    containers_per_host: int = Field(
        strict=True, ge=1, description="TPU containers per pod (2 on split 4-chip hosts)."
    )
    chips_per_container: int = Field(
        strict=True, ge=1, description="google.com/tpu requested by each TPU container."
    )
    placement_policy: str | None = Field(
        default=None,
        description="GKE workload policy of a multi-host slice's node pool where the generation takes one "
        "(node label cloud.google.com/placement-policy-name); None where pools are chosen by topology alone.",
    )


class MeshPlan(ApiModel):
    """A resolved mesh: every axis an integer >= 1."""

    data: int = Field(strict=True, ge=1, description="Data parallelism.")
    fsdp: int = Field(strict=True, ge=1, description="FSDP parallelism.")
    tensor: int = Field(strict=True, ge=1, description="Tensor parallelism.")
    context: int = Field(strict=True, ge=1, description="Context parallelism.")
    expert: int = Field(strict=True, ge=1, description="Expert parallelism.")

    def product(self) -> int:
        out = 1
        for axis in MESH_AXES:
            out *= int(getattr(self, axis))
        return out


class CacheDisk(ApiModel):
    """The local disk of one host's caches (rljob.recipes.disk): rljob's emptyDir at `path`."""

    path: str = Field(description="Mount path of the emptyDir (the pods' $RLJOB_LOCAL_CACHE default).")
    parts: dict[str, int] = Field(description="Bytes per host by what the caches hold, before the headroom.")
    bytes: int = Field(
        strict=True, ge=0, description="rljob's size per host: the parts with headroom, in GiB."
    )
    size_limit: str = Field(description="The emptyDir's sizeLimit (one pod's).")
    request: str = Field(description="ephemeral-storage requested by each TPU container of the pod.")
    source: Literal["rljob", "template"] = Field(
        description="rljob: sized from the model; template: the pod template's ephemeral-storage request "
        "wins."
    )


class TrainerPlan(ApiModel):
    """The trainer role, resolved."""

    tpu: TpuPlan = Field(description="One trainer slice.")
    slices: int = Field(description="Number of slices.")
    hosts: int = Field(description="Hosts over all slices.")
    chips: int = Field(description="Chips over all slices.")
    devices: int = Field(description="JAX devices over all slices.")
    ici: MeshPlan = Field(description="Mesh within a slice (MaxText ici_* keys).")
    dcn: MeshPlan = Field(description="Mesh across slices (MaxText dcn_* keys).")
    micro_batch_size: int = Field(description="Packed rows per micro-step over all devices.")
    maxtext_version: str = Field(description="MaxText version whose key set was checked.")
    maxtext: dict[str, Any] = Field(description="The final MaxText key dict (key -> value).")
    maxtext_sources: dict[str, str] = Field(
        description="Where each MaxText key came from: rljob, recipe, profile, manifest, or derived (no "
        "layer set it and MaxText's default would not run; RunConfig.derived says why)."
    )
    cache_disk: CacheDisk = Field(description="The local disk of one host's caches.")
    libtpu_flags: dict[str, str] = Field(
        default_factory=dict,
        description="libtpu flags (name -> value), LIBTPU_INIT_ARGS of every trainer process "
        "(rljob.recipes.libtpu).",
    )


class SamplerPlan(ApiModel):
    """The sampler role, resolved."""

    tpu: TpuPlan = Field(description="One sampler slice.")
    replicas: int = Field(description="Sampler slices (one vLLM server each).")
    tensor_parallel: int = Field(description="Tensor parallelism (tpu-inference tensor_parallelism).")
    expert_parallel: int = Field(description="Expert parallelism (tpu-inference expert_parallelism).")
    data_parallel: int = Field(description="vLLM --data-parallel-size.")
    max_model_len: int = Field(description="vLLM --max-model-len.")
    lora_max_rank: int = Field(description="vLLM --max-lora-rank.")
    max_loras: int = Field(description="vLLM --max-loras.")
    max_num_seqs: int = Field(description="vLLM --max-num-seqs (sequences in flight per replica).")
    quantization: str = Field(
        default="bfloat16",
        description="How the served weights are stored (spec.sampler.weights.quantization; "
        "rljob.recipes.quantization): the fit check counts their bytes.",
    )
    cache_disk: CacheDisk = Field(description="The local disk of one host's caches (the model's weights).")


class StoragePaths(ApiModel):
    """Storage locations derived from spec.storage.root."""

    root: str = Field(
        description="{root}/{namespace}/{name}/{uid} ({root}/{namespace}/{name} without a uid)."
    )
    checkpoints: str = Field(description="Trainer checkpoints (orbax).")
    adapters: str = Field(description="Published adapters: versions v{N}/ and the pointer object LATEST.")
    rollouts: str = Field(description="Rollout records.")
    cache: str = Field(description="Caches of this run (compilation caches, the sampler's model download).")
    converted: str | None = Field(
        default=None,
        description="The MaxText checkpoint converted from spec.model.name at spec.model.revision: "
        "{storage.root}/cache/converted/<name>@<revision>/maxtext-<version> (converted_dir), shared by "
        "every run under the same storage root; the trainer converts into it once, when spec.model."
        "checkpoint is unset. None only where no model is resolved (rljob status's own paths).",
    )
    tensorboard: str = Field(
        description="TensorBoard event files of the trainer's step metrics (reward, loss, KL, policy lag, "
        "tokens/s, padding fraction, skipped updates): they outlive the pods; `rljob status` and "
        "TensorBoard read them.",
    )
    profile: str = Field(
        description="JAX profiler traces of the steps the MaxText key profiler (xplane) chose, "
        "<run>/<host>.xplane.pb: the TensorBoard log directory's profile plugin directory, which "
        "TensorBoard's profile plugin and XProf read (rljob.trainer.profiling).",
    )


class Endpoints(ApiModel):
    """Network addresses inside the JobSet."""

    samplers: list[str] = Field(description="Base URL of each sampler replica.")
    coordinator: str = Field(description="JAX coordinator address host:port (trainer job 0 pod 0).")


class ProgressTarget(ApiModel):
    """Where the trainer reports progress (contract 4)."""

    config_map: str | None = Field(default=None, description="ConfigMap `<rljob>-progress` (in a pod).")
    key: str = Field(default=PROGRESS_KEY, description="ConfigMap key.")
    file: str | None = Field(
        default=None, description="Local file written instead of a ConfigMap (laptop, tests)."
    )


# ------------------------------------------------------------------------------------- resolved spec
# The spec as the plan resolved it: recipe < profile < manifest over the one defaults table
# (rljob.recipes.defaults), every derived value computed (rljob.recipes.plan.resolve builds it; nothing
# else does). Field names are the API's (recipes/api.py), so `rljob plan` reads like the manifest. Only a
# field whose absence means something is optional (no recipe, no base checkpoint, no pod template, no
# dataset file for the successor task, no service, any API key, no queue, no priority class); the parts
# the plan resolves into the role plans (spec.trainer.tpu, .mesh and .maxtext; spec.sampler.tpu) are read
# from RunConfig.trainer / RunConfig.sampler instead.

_Count = Annotated[int, Field(ge=1)]


class _Resolved(ApiModel):
    model_config = ConfigDict(frozen=True)


class ResolvedModel(_Resolved):
    """spec.model, resolved."""

    name: str = Field(description="Hugging Face model id.")
    maxtext_model: str = Field(description="MaxText model_name (default: the id's last part, lowercased).")
    revision: str = Field(description="Hugging Face revision of `name` that both roles load.")
    checkpoint: str | None = Field(
        default=None,
        description="Base weights (a MaxText checkpoint converted from `name`); None: the trainer "
        "converts `name` into StoragePaths.converted.",
    )


class ResolvedLogprobs(_Resolved):
    """spec.trainer.logprobs, resolved."""

    token_tile: _Count = Field(description="Tokens per tile of the fused log-prob head.")
    vocab_chunk: _Count = Field(description="Vocabulary columns per chunk.")


class ResolvedPreflight(_Resolved):
    """spec.trainer.preflight, resolved."""

    compile: bool = Field(description="Run the compile preflight before the JobSet is created.")
    cpu: str = Field(description="CPU requested by the preflight pod.")
    memory: str = Field(description="Memory requested and limited for the preflight pod.")


class ResolvedTrainer(_Resolved):
    """spec.trainer, resolved (its TPU, mesh and MaxText keys: RunConfig.trainer)."""

    slices: _Count = Field(description="Number of slices.")
    maxtext_version: str = Field(description="MaxText version whose key set was checked.")
    profile: str | None = Field(default=None, description="The recipe's profile; None: none.")
    image: str = Field(description="Trainer container image.")
    containers_per_host: _Count = Field(description="TPU containers per pod.")
    micro_batch_size: _Count = Field(description="Packed rows per micro-step over all devices.")
    logprobs: ResolvedLogprobs = Field(description="Block sizes of the fused log-prob head.")
    template: PodTemplate | None = Field(default=None, description="Pod overrides; None: none.")
    preflight: ResolvedPreflight = Field(description="The compile preflight.")


class ResolvedSamplerWeights(_Resolved):
    """spec.sampler.weights, resolved."""

    quantization: str = Field(description="bfloat16, or the quantization of the served checkpoint.")
    name: str = Field(description="Hugging Face id the samplers serve (spec.model.name at bfloat16).")
    revision: str = Field(description="Hugging Face revision of `name`.")
    parity_tolerance: float = Field(gt=0, description="The step-0 parity gate's bound (nats).")


class ResolvedSampler(_Resolved):
    """spec.sampler, resolved (its TPU: RunConfig.sampler)."""

    replicas: _Count = Field(description="Sampler slices.")
    tensor_parallel: _Count = Field(description="Tensor parallelism of one replica.")
    expert_parallel: _Count = Field(description="Expert parallelism of one replica.")
    data_parallel: _Count = Field(description="Data parallelism of one replica.")
    max_model_len: _Count = Field(description="vLLM --max-model-len.")
    max_loras: _Count = Field(description="vLLM --max-loras.")
    max_num_seqs: _Count = Field(description="vLLM --max-num-seqs.")
    weights: ResolvedSamplerWeights = Field(description="The weights the samplers serve.")
    image: str = Field(description="Sampler container image.")
    template: PodTemplate | None = Field(default=None, description="Pod overrides; None: none.")


class ResolvedLora(_Resolved):
    """spec.lora, resolved."""

    rank: int = Field(ge=1, le=512, description="LoRA rank.")
    alpha: float = Field(gt=0, description="LoRA alpha (default 2 x rank).")
    targets: tuple[str, ...] = Field(min_length=1, description="Module names the adapter wraps.")
    init_from: str | None = Field(default=None, description="The PEFT adapter it starts from; None: none.")


class ResolvedSampling(_Resolved):
    """spec.algorithm.sampling, resolved."""

    temperature: float = Field(gt=0, description="Sampling temperature.")
    top_p: float = Field(gt=0, le=1, description="Nucleus sampling's probability mass (1: off).")
    top_k: int = Field(ge=0, description="Sample from the k most likely tokens (0: off).")
    stop: tuple[str, ...] = Field(description="Stop strings (none: empty).")


class ResolvedEvaluation(_Resolved):
    """spec.evaluation, resolved."""

    every: int = Field(ge=0, description="Evaluate every N steps (0: never).")
    pass_k: _Count = Field(description="pass@k's k.")
    maj_k: int = Field(ge=0, description="maj@k's k (0: not measured).")
    samples: _Count = Field(description="Samples per held-out prompt.")
    temperature: float = Field(ge=0, description="Sampling temperature (0: greedy).")


class ResolvedAlgorithm(_Resolved):
    """spec.algorithm, resolved."""

    loss: Literal["importance_sampling", "ppo"] = Field(description="Policy loss.")
    group_size: _Count = Field(description="Completions per prompt.")
    groups_per_batch: _Count = Field(description="Prompts per optimizer step.")
    max_tokens: _Count = Field(description="Completion token limit.")
    max_prompt_tokens: _Count = Field(description="Prompt token limit.")
    learning_rate: float = Field(gt=0, description="Adam learning rate.")
    steps: _Count = Field(description="Optimizer steps.")
    warmup_steps: int = Field(ge=0, description="Steps of the linear learning-rate warm-up (0: none).")
    learning_rate_schedule: Literal["constant", "linear", "cosine"] = Field(
        description="The learning rate after the warm-up."
    )
    kl_penalty_coef: float = Field(ge=0, description="Weight of the KL penalty (0: none).")
    advantage_normalization: Literal["mean", "std"] = Field(description="GRPO advantage normalization.")
    clip_low: float = Field(ge=0, lt=1, description="Loss ppo: the ratio's lower bound is 1 - clipLow.")
    clip_high: float = Field(ge=0, description="Loss ppo: the ratio's upper bound is 1 + clipHigh.")
    importance_ratio: Literal["token", "sequence"] = Field(
        description="The importance ratio per token, or per sequence (GSPO)."
    )
    loss_normalization: Literal["token", "sequence"] = Field(
        description="One mean over the step's tokens, or over each completion's then over completions."
    )
    overlong_buffer: int = Field(
        ge=0, description="Tokens of DAPO's overlong shaping below maxTokens (0: off)."
    )
    overlong_penalty: float = Field(gt=0, description="The reward a completion of maxTokens tokens loses.")
    sampling: ResolvedSampling = Field(description="The rollouts' sampling parameters.")


class ResolvedPacking(_Resolved):
    """spec.packing, resolved."""

    token_budget: _Count = Field(description="Tokens per packed row.")
    segment_align: _Count = Field(description="Segment start alignment.")
    pad_position: Literal["end", "start", "balanced"] = Field(description="Where a row's padding goes.")
    pad_align: _Count = Field(description="Shift alignment of padPosition start.")
    max_segments_per_row: _Count | None = Field(
        default=None,
        description="Rollouts per packed row at most; None: as many as fit (1: a gated delta net decoder).",
    )


class ResolvedDataset(_Resolved):
    """spec.dataset, resolved."""

    task: str = Field(description="The task's name in the entry-point group rljob.tasks.")
    options: dict[str, str] = Field(default_factory=dict, description="The task's options (none: empty).")
    path: str | None = Field(
        default=None, description="The task's data; None for successor, which reads none."
    )
    eval_size: _Count = Field(description="Problems held out for evaluation.")
    prompt_template: str = Field(description="Format string of each prompt (task math).")
    reward_url: str | None = Field(
        default=None, description="The reward service grading completions; None: the task's own reward."
    )


class ResolvedService(_Resolved):
    """spec.service, resolved (present only in service mode)."""

    api: Literal["tinker"] = Field(description="The API served.")
    port: int = Field(ge=1, le=65535, description="Port of the API.")
    max_training_clients: _Count = Field(description="Training clients at once.")
    checkpoint_every: int = Field(ge=0, description="Steps between automatic checkpoints (0: none).")
    api_key_secret: str = Field(description="Secret of the accepted API keys (required).")
    client_namespaces: list[str] = Field(
        description="Namespaces whose pods may reach the API besides the run's own (none: empty)."
    )


class ResolvedStorage(_Resolved):
    """spec.storage, resolved (the run's own paths: RunConfig.storage)."""

    root: str = Field(description="gs:// storage root.")


class ResolvedFailurePolicy(_Resolved):
    """spec.failurePolicy, resolved."""

    max_restarts: int = Field(
        ge=0, description="Counted restarts of the run (a trainer crash) before it fails."
    )
    max_sampler_restarts: int = Field(
        ge=0, description="Counted restarts of single sampler Jobs (a sampler crash) before the run fails."
    )
    max_non_finite_steps: _Count = Field(description="Consecutive non-finite updates before exit 2.")


class ResolvedSpec(_Resolved):
    """The RLJob spec as the plan resolved it (see the comment above)."""

    recipe: str | None = Field(default=None, description="The catalog recipe; None: none.")
    model: ResolvedModel = Field(description="The base model.")
    trainer: ResolvedTrainer = Field(description="The trainer role.")
    sampler: ResolvedSampler = Field(description="The sampler role.")
    lora: ResolvedLora = Field(description="The LoRA adapter.")
    algorithm: ResolvedAlgorithm = Field(description="The RL algorithm.")
    packing: ResolvedPacking = Field(description="Sequence packing.")
    dataset: ResolvedDataset = Field(description="Training prompts and their grading.")
    evaluation: ResolvedEvaluation = Field(description="Evaluation during training.")
    service: ResolvedService | None = Field(default=None, description="Service mode; None: the RL loop.")
    storage: ResolvedStorage = Field(description="Run storage.")
    failure_policy: ResolvedFailurePolicy = Field(description="Retry policy.")
    suspend: bool = Field(description="Suspend the run.")
    queue_name: str | None = Field(default=None, description="Kueue LocalQueue; None: none.")
    priority_class_name: str | None = Field(default=None, description="PriorityClass; None: none.")


class PreflightPlacement(ApiModel):
    """Where the compile preflight's pod may run: the operator's pod policy (preflightNodeSelector,
    preflightTolerations), not the manifest."""

    node_selector: dict[str, str] = Field(description="The preflight pod's nodeSelector.")
    tolerations: list[dict[str, Any]] = Field(description="The preflight pod's tolerations.")


class RunConfig(ApiModel):
    """Everything a trainer or sampler process needs to run, resolved by rljob.recipes.plan."""

    kind: Literal["RunConfig"] = Field(default="RunConfig", description="Document kind.")
    name: str = Field(description="RLJob name.")
    namespace: str = Field(description="RLJob namespace.")
    job_set_name: str = Field(description="Name of the JobSet.")
    spec: ResolvedSpec = Field(
        description="The resolved spec (recipe < profile < manifest over the defaults, every value filled)."
    )
    trainer: TrainerPlan = Field(description="Trainer plan.")
    sampler: SamplerPlan = Field(description="Sampler plan.")
    storage: StoragePaths = Field(description="Storage paths.")
    endpoints: Endpoints = Field(description="Endpoints.")
    progress: ProgressTarget = Field(description="Progress report target.")
    sampler_failure: SamplerFailure = Field(
        description="What a sampler crash restarts (rljob.recipes.failure): the sampler Job alone, or the "
        "whole run where the cluster's JobSet refuses the failure action RestartJob (the plan's input "
        "`restart_job`)."
    )
    preflight: PreflightPlacement | None = Field(
        default=None,
        description="The compile preflight's placement (from the operator's pod policy); None when "
        "spec.trainer.preflight.compile is off.",
    )
    derived: dict[str, str] | None = Field(
        default=None,
        description="The values the plan filled because their default would not run, each spec path (as in "
        "the manifest, e.g. spec.sampler.expertParallel or spec.trainer.maxtext.<key>) with the reason; "
        "None: none. A value a recipe, profile or manifest sets is never derived.",
    )

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """Read a run config file (the one file read recipes/ does outside its own package data)."""
        return cls.model_validate_json(Path(path).read_text(encoding="utf-8"))


def named_adapter(uri: str) -> str:
    """The name samplers serve the PEFT directory ``uri`` under (the Tinker service's sampler weights): a
    digest of the directory, whose last segment is the digest of its content, so new weights get a new
    name and the adapter agent can check that a name belongs to its directory."""
    return "tinker-" + hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:24]


__all__ = [
    "ADAPTER_AGENT_PATH",
    "ADAPTER_AGENT_PORT_OFFSET",
    "API_KEYS_ENV",
    "API_KEYS_SECRET_KEY",
    "BASE_REVISION_KEY",
    "CACHE_VOLUME",
    "CONFIG_DIR",
    "CONFIG_ENV",
    "CONFIG_KEY",
    "CONFIG_PATH",
    "COORDINATOR_PORT",
    "LOCAL_CACHE_DEFAULT",
    "LOCAL_CACHE_ENV",
    "MESH_AXES",
    "NAMED_ADAPTERS_DIR",
    "PROGRESS_KEY",
    "RAY_AUTH_MODE_ENV",
    "RAY_AUTH_TOKEN_ENV",
    "RAY_HEAD_ENV",
    "RAY_PORT",
    "RAY_PORT_ENV",
    "RUN_TOKEN_ENV",
    "RUN_TOKEN_SECRET_KEY",
    "SAMPLED_LOGPROBS",
    "SAMPLER_HOSTS_ENV",
    "SAMPLER_PORT",
    "TLS_CERT_ENV",
    "TLS_KEY_ENV",
    "VLLM_API_KEY_ENV",
    "CacheDisk",
    "Endpoints",
    "MeshPlan",
    "ProgressTarget",
    "ResolvedAlgorithm",
    "ResolvedDataset",
    "ResolvedEvaluation",
    "ResolvedFailurePolicy",
    "ResolvedLogprobs",
    "ResolvedLora",
    "ResolvedModel",
    "ResolvedPacking",
    "ResolvedPreflight",
    "ResolvedSampler",
    "ResolvedSampling",
    "ResolvedService",
    "ResolvedSpec",
    "ResolvedStorage",
    "ResolvedTrainer",
    "RunConfig",
    "SamplerPlan",
    "StoragePaths",
    "TpuPlan",
    "TrainerPlan",
    "named_adapter",
]


def split_gs(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> ("bucket", "a/b") (contract 6: the storage layout)."""
    if not uri.startswith("gs://"):
        raise ValueError(f"spec.storage.root: not a gs:// URI: {uri!r}")
    bucket, _, prefix = uri[len("gs://") :].partition("/")
    if not bucket:
        raise ValueError(f"spec.storage.root: no bucket in {uri!r}")
    return bucket, prefix.strip("/")
