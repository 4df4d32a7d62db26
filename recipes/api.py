"""The RLJob custom resource (group rljob.dev, version v1alpha1) as pydantic models.

Contract 1 of the project: the operator builds the CRD's OpenAPI schema from these models (every
field's description becomes `kubectl explain` text), the CLI and the operator parse manifests with
them, and the operator writes `status` through `RLJobStatus`.

JSON names are camelCase (alias generator); Python attribute names are snake_case. Unknown fields are
refused everywhere except `metadata`, which carries whatever the API server adds.

Spec fields that a catalog recipe can supply are optional here: a manifest that names
`spec.recipe` may omit them. Completeness of the merged spec is checked by `rljob.recipes.plan`,
which reports every missing field as `spec.path: message`.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema, field_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict
from rljob.recipes import syntax
from rljob.recipes.defaults import DEFAULT_DATASET_OBJECT
from rljob.recipes.defaults import text as _default
from rljob.recipes.failure import SamplerFailure
from rljob.recipes.generations import BY_ACCELERATOR, GENERATIONS
from rljob.recipes.quantization import BF16_PARITY_NATS, QUANTIZATIONS, QUANTIZED_PARITY_NATS, served_on

GROUP = "rljob.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
_SPLIT = " or ".join(g.prefix for g in GENERATIONS.values() if g.split_containers)


def _or(words: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


_GS_ROOT = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](/[^\s]*)?$")


class ApiModel(BaseModel):
    """Base of every RLJob model: camelCase aliases, unknown fields refused."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        use_attribute_docstrings=False,
    )


# --------------------------------------------------------------------------------------------- spec


class TpuSlice(ApiModel):
    """A TPU slice written out: the GKE accelerator label value and the slice topology."""

    accelerator: str = Field(
        description="Value of the node label cloud.google.com/gke-tpu-accelerator: "
        + _or(list(BY_ACCELERATOR))
        + ".",
        max_length=64,
    )
    topology: str = Field(
        description="Slice topology (node label cloud.google.com/gke-tpu-topology): AxB on "
        + _or([g.accelerator for g in GENERATIONS.values() if g.dims == 2])
        + " (e.g. 2x4), AxBxC on "
        + _or([g.accelerator for g in GENERATIONS.values() if g.dims == 3])
        + " (e.g. 2x2x1).",
        pattern=r"^[0-9]+x[0-9]+(x[0-9]+)?$",
        max_length=32,
    )

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, v: str) -> str:
        if v not in BY_ACCELERATOR:
            raise ValueError(f"Input should be {_or([repr(a) for a in BY_ACCELERATOR])}")
        return v


# In the CRD a `tpu` field holds either the shorthand string or the object form; a structural schema
# cannot say "string or object", so the field is declared with x-kubernetes-preserve-unknown-fields
# and its value is checked by the admission path (these models).
_TPU_DESCRIPTION = (
    "TPU slice shape: the xpk type name "
    + " / ".join(f"`{g.prefix}-N`" for g in GENERATIONS.values())
    + " (N counts TensorCores: "
    + ", ".join(f"{g.tensorcores_per_chip} per {g.prefix} chip" for g in GENERATIONS.values())
    + "; "
    + ", ".join(f"`{g.maxtext_prefix}-N`" for g in GENERATIONS.values() if g.maxtext_prefix != g.prefix)
    + " as MaxText names it) or the object {accelerator: "
    + " | ".join(BY_ACCELERATOR)
    + ", topology: AxB or AxBxC}."
)
TpuField = Annotated[
    Annotated[str, StringConstraints(max_length=32)] | TpuSlice,
    WithJsonSchema({"description": _TPU_DESCRIPTION, "x-kubernetes-preserve-unknown-fields": True}),
]


def _hf_id(description: str, revision: bool = False) -> Any:
    """An optional Hugging Face model id field (a revision with ``revision``)."""
    limit, pattern = (
        (syntax.HF_REVISION_MAX, syntax.HF_REVISION)
        if revision
        else (syntax.HF_MODEL_ID_MAX, syntax.HF_MODEL_ID)
    )
    return Field(None, description=description, min_length=1, max_length=limit, pattern=pattern)


class ModelSpec(ApiModel):
    """The model being post-trained."""

    name: str | None = _hf_id(
        "Hugging Face model id of the base model, e.g. Qwen/Qwen3-8B (org/name or name; starts with a letter "
        "or digit)."
    )
    maxtext_model: str | None = Field(
        default=None,
        description="MaxText model_name of the base model, e.g. qwen3-8b. Default: the recipe's.",
        min_length=1,
        max_length=syntax.MAXTEXT_MODEL_MAX,
        pattern=syntax.MAXTEXT_MODEL,
    )
    revision: str | None = _hf_id(
        "Hugging Face revision of spec.model.name (a branch, a tag or a commit hash) that both roles load: "
        "the trainer converts it into MaxText's layout and the sampler serves it. A branch or tag is "
        "resolved to a commit once per run, by the trainer's first start, and both roles load that commit "
        "(the samplers wait for it); a commit hash is loaded as it is. " + _default("model.revision"),
        revision=True,
    )
    checkpoint: str | None = Field(
        default=None,
        description="gs:// path of the base weights as a MaxText checkpoint (load_parameters_path: the "
        "step's items directory that maxtext.checkpoint_conversion.to_maxtext writes, e.g. "
        "gs://BUCKET/qwen3-8b/0/items), converted from spec.model.name at spec.model.revision (the "
        "sampler serves those). The trainer loads it before applying LoRA and refuses one that does not "
        "fit the model (exit 2). Without it the trainer converts spec.model.name's Hugging Face weights "
        "itself, once, into {storage.root}/cache/converted/ (shared by every run under that root).",
        pattern=r"^gs://[^/\s]+(/\S*)?$",
        max_length=syntax.PATH_MAX,
    )


_AXIS_MAX = 65536  # below is mesh.resolve's own check (-1 or >= 1)


class MeshAxes(ApiModel):
    """Parallelism per mesh axis. -1 means inferred: the axis takes what the others leave."""

    data: int | None = Field(
        default=None, le=_AXIS_MAX, description="Data parallelism (replicas of the model)."
    )
    fsdp: int | None = Field(
        default=None, le=_AXIS_MAX, description="Fully sharded data parallelism (parameter sharding)."
    )
    tensor: int | None = Field(default=None, le=_AXIS_MAX, description="Tensor (model) parallelism.")
    context: int | None = Field(default=None, le=_AXIS_MAX, description="Context (sequence) parallelism.")
    expert: int | None = Field(
        default=None, le=_AXIS_MAX, description="Expert parallelism for mixture-of-experts layers."
    )


class MeshSpec(MeshAxes):
    """Trainer mesh. The axes here are ICI axes (within one slice); `dcn` holds the axes across slices.

    Default: every device of a slice on fsdp (ici fsdp = -1, the rest 1) and every slice on data
    (dcn data = -1)."""

    dcn: MeshAxes | None = Field(
        default=None,
        description="Parallelism across slices (DCN). The product must equal spec.trainer.slices.",
    )


class LogprobsSpec(ApiModel):
    """Block sizes of the trainer's fused log-prob head (trainer/logprobs.py): each device scores its
    tokens tile by tile against vocabulary chunks, so one [tokenTile, vocabChunk] block of float32 logits
    is alive at a time; the head's vocabulary columns are split over every trainer device."""

    token_tile: int | None = Field(
        default=None,
        ge=1,
        description="Tokens per tile. Must divide the tokens each device scores per micro-batch "
        "(microBatchSize x tokenBudget / devices; no partly recomputed last tile). Default: the largest "
        "divisor of that count up to 2048.",
    )
    vocab_chunk: int | None = Field(
        default=None,
        ge=1,
        description="Vocabulary columns per chunk (clamped to a device's share of the vocabulary). "
        + _default("trainer.logprobs.vocabChunk"),
    )


# ------------------------------------------------------------------------------------ pod overrides
# The shape of a pod template (metadata + spec, as in KubeRay's `template` and Kubeflow Trainer's
# podTemplateOverrides), limited to what a TPU run may change. The container fields (env, envFrom,
# volumeMounts, resources) apply to every TPU container of the role. The parts whose full Kubernetes schema
# is large (valueFrom, envFrom, volumes, affinity) are free-form here; rljob.recipes.plan checks them
# against the Kubernetes pod schema that JobSet's CRD embeds, so a bad one is refused with its field named.

_ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# A resource quantity (apimachinery's resource.Quantity, the pattern of the Kubernetes OpenAPI schema).
_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
_QUANTITY = rf"^(\+|-)?{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_NUMBER}))?$"
_FREE: JsonDict = {"x-kubernetes-preserve-unknown-fields": True}
_FREE_ITEMS: JsonDict = {
    "type": "array",
    "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
}


class PodMetadata(ApiModel):
    """Labels and annotations added to every pod of the role."""

    labels: dict[str, Annotated[str, StringConstraints(max_length=63)]] | None = Field(
        default=None,
        max_length=64,
        description="Labels added to the pods (the ones rljob, JobSet and Job set may not be overridden).",
    )
    annotations: dict[str, Annotated[str, StringConstraints(max_length=65536)]] | None = Field(
        default=None,
        max_length=64,
        description='Annotations added to the pods, e.g. gke-gcsfuse/volumes: "true" for the GCS FUSE CSI '
        "driver's sidecar.",
    )


class EnvVar(ApiModel):
    """An environment variable of the role's containers (Kubernetes EnvVar)."""

    name: str = Field(
        description="Variable name. Names rljob sets (RLJOB_*, JAX_*, MEGASCALE_*, POD_*, ...) are refused.",
        min_length=1,
        max_length=256,
        pattern=_ENV_NAME,
    )
    value: str | None = Field(default=None, max_length=65536, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="Source of the value, as in Kubernetes: secretKeyRef {name, key}, configMapKeyRef, "
        "fieldRef or resourceFieldRef.",
        json_schema_extra=_FREE,
    )


class VolumeMount(ApiModel):
    """A mount of one of spec.volumes in each of the role's containers (Kubernetes VolumeMount)."""

    name: str = Field(
        description="Name of a volume in this template's spec.volumes.",
        max_length=63,
        pattern=syntax.DNS1123_LABEL,
    )
    mount_path: str = Field(
        description="Absolute path in the container.", min_length=2, max_length=1024, pattern=r"^/"
    )
    sub_path: str | None = Field(default=None, max_length=1024, description="Path within the volume.")
    read_only: bool | None = Field(default=None, description="Mount read-only.")


class Toleration(ApiModel):
    """A toleration added to the TPU one (Kubernetes Toleration), e.g. for Spot node pools."""

    key: str | None = Field(default=None, max_length=317, description="Taint key; empty with Exists: all.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Exists or Equal (default)."
    )
    value: str | None = Field(default=None, max_length=63, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="NoSchedule, PreferNoSchedule or NoExecute; empty: all."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated after it appears."
    )


Quantity = Annotated[
    Annotated[str, StringConstraints(pattern=_QUANTITY, max_length=64)] | int,
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": _QUANTITY}),
]


class Resources(ApiModel):
    """Requests and limits of each TPU container besides its TPU chips (Kubernetes ResourceRequirements)."""

    requests: dict[str, Quantity] | None = Field(
        default=None,
        max_length=16,
        description="Requests by resource name (cpu, memory, ephemeral-storage): win over rljob's floor of "
        "1 CPU and 4Gi and its ephemeral-storage for the caches (sized from the model: `rljob plan`; the "
        "cache emptyDir's sizeLimit then follows this request). google.com/tpu is rljob's (from the slice) "
        "and refused here.",
    )
    limits: dict[str, Quantity] | None = Field(
        default=None,
        max_length=16,
        description="Limits by resource name. A limit without a request makes the request equal to it, as "
        "in Kubernetes. google.com/tpu is refused here.",
    )


class PodTemplateSpec(ApiModel):
    """What a pod template may change in the role's pods; the rest (TPU placement, command, image,
    security context) stays rljob's."""

    env: list[EnvVar] | None = Field(
        default=None, max_length=128, description="Variables added to the containers."
    )
    env_from: list[dict[str, Any]] | None = Field(
        default=None,
        max_length=32,
        description="Variables from a Secret or ConfigMap (Kubernetes EnvFromSource: secretRef, "
        "configMapRef, prefix); explicit env, rljob's included, wins.",
        json_schema_extra=_FREE_ITEMS,
    )
    volumes: list[dict[str, Any]] | None = Field(
        default=None,
        max_length=64,
        description="Volumes added to the pods (Kubernetes Volume, e.g. csi: {driver: "
        "gcsfuse.csi.storage.gke.io}, secret, persistentVolumeClaim, ephemeral); names run-config, dshm "
        "and rljob-cache are rljob's.",
        json_schema_extra=_FREE_ITEMS,
    )
    volume_mounts: list[VolumeMount] | None = Field(
        default=None, max_length=64, description="Mounts of these volumes in every container of the role."
    )
    resources: Resources | None = Field(
        default=None, description="CPU, memory and other resources per container."
    )
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=32, description="Tolerations added to the TPU taint's."
    )
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=63)]] | None = Field(
        default=None,
        max_length=32,
        description='Node labels added to the TPU selector, e.g. cloud.google.com/gke-spot: "true" or '
        "cloud.google.com/reservation-name. The TPU keys (gke-tpu-accelerator, gke-tpu-topology, "
        "placement-policy-name) are rljob's.",
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="Kubernetes Affinity of the pods; node affinity on the TPU keys is refused.",
        json_schema_extra=_FREE,
    )
    service_account_name: str | None = Field(
        default=None,
        description="ServiceAccount of the pods instead of the one rljob creates (e.g. one bound to a Google "
        "service account through Workload Identity). The trainer's is granted the progress ConfigMap.",
        max_length=syntax.DNS1123_SUBDOMAIN_MAX,
        pattern=syntax.DNS1123_SUBDOMAIN,
    )


class PodTemplate(ApiModel):
    """Overrides of the role's pods: metadata {labels, annotations} and spec (env, volumes, resources,
    scheduling, service account), merged with what rljob renders."""

    metadata: PodMetadata | None = Field(default=None, description="Labels and annotations of the pods.")
    spec: PodTemplateSpec | None = Field(default=None, description="Pod and container overrides.")


_Quantity = Annotated[str, StringConstraints(pattern=_QUANTITY, max_length=64)]


class PreflightSpec(ApiModel):
    """An opt-in compile preflight: before the TPU JobSet exists, a CPU pod of the trainer image compiles
    the trainer's programs at full size for the run's TPU topology with libtpu's compiler
    (`python -m rljob.trainer.compilecheck`, docs/drill.md "Starting without compiling")."""

    compile: bool | None = Field(
        default=None,
        description="Run the preflight. It costs one CPU pod of the trainer image (no TPU) with `cpu` and "
        "`memory` below, for the length of the compile: on a 2-core machine the full-size Qwen3.5-397B "
        "programs took about 23 minutes and reached 9.3 GB resident (that recipe sets `memory` 16Gi), "
        "Qwen3-8B's 2 to 7 minutes (docs/drill.md). It buys: a run that does not "
        "fit its TPU's HBM is refused (Ready=False, reason CompileDoesNotFit, one line per problem naming "
        "the field, and a Warning event) before any TPU is requested, and the compiled programs are written "
        "to JAX's persistent compilation cache under spec.storage's cache/ (jax-trainer/), which the trainer "
        "pods restore before they compile: on a TPU v5e the trainer loaded its step's programs from those "
        "entries instead of compiling them (docs/drill.md, 'Starting without compiling'). "
        + _default("trainer.preflight.compile"),
    )
    cpu: _Quantity | None = Field(
        default=None,
        description="CPU requested by the preflight pod (a resource quantity). "
        + _default("trainer.preflight.cpu"),
    )
    memory: _Quantity | None = Field(
        default=None,
        description="Memory requested and limited for the preflight pod (a resource quantity). "
        + _default("trainer.preflight.memory"),
    )


class TrainerSpec(ApiModel):
    """The MaxText trainer (rljob's GRPO loop on MaxText models, LoRA via qwix)."""

    tpu: TpuField | None = Field(default=None, description=_TPU_DESCRIPTION)
    slices: int | None = Field(
        default=None, ge=1, le=64, description="Number of identical TPU slices. " + _default("trainer.slices")
    )
    mesh: MeshSpec | None = Field(default=None, description="Trainer device mesh (MaxText ici_*/dcn_* keys).")
    maxtext_version: str | None = Field(
        default=None,
        description="MaxText version pinned by the trainer image; its key set validates `maxtext`. "
        + _default("trainer.maxtextVersion"),
        max_length=syntax.VERSION_MAX,
        pattern=syntax.VERSION,
    )
    maxtext: dict[str, Any] | None = Field(
        default=None,
        description="Extra MaxText config keys (key: value). Win over the profile's and the recipe's keys.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
        max_length=1024,
    )
    libtpu_flags: dict[str, Any] | None = Field(
        default=None,
        description="libtpu flags of the trainer (name: value, without the leading dashes), passed as "
        "LIBTPU_INIT_ARGS to the trainer containers, the compile preflight and `rljob drill --compile`, e.g. "
        "xla_tpu_scoped_vmem_limit_kib: 65472. Win over the profile's and the recipe's flags; null removes "
        "one of theirs.",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
        max_length=128,
    )
    profile: str | None = Field(
        default=None,
        description="A tuned-flag profile of the recipe, by name.",
        max_length=syntax.CATALOG_NAME_MAX,
        pattern=syntax.CATALOG_NAME,
    )
    image: str | None = Field(
        default=None,
        description="Trainer container image (a reference such as registry/path:tag or @sha256:...). "
        + _default("trainer.image"),
        max_length=syntax.IMAGE_MAX,
        pattern=syntax.IMAGE,
    )
    containers_per_host: int | None = Field(
        default=None,
        ge=1,
        le=2,
        description=f"TPU containers per pod: 1, or 2 on 4-chip {_SPLIT} hosts (2 chips each, one per NUMA "
        f"node, as xpk does). Default: 2 for the trainer on {_SPLIT}, else 1.",
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="Sequences (packed rows) per optimizer micro-step across all trainer devices. Must be a "
        "multiple of the data x fsdp x expert parallelism, over which MaxText splits the rows (data x fsdp "
        "under custom_mesh_and_rule ep-as-cp). Default: that parallelism (one row per shard).",
    )
    logprobs: LogprobsSpec | None = Field(default=None, description="Block sizes of the fused log-prob head.")
    template: PodTemplate | None = Field(
        default=None, description="Overrides of the trainer pods (env, Secrets, volumes, scheduling)."
    )
    preflight: PreflightSpec | None = Field(
        default=None,
        description="The opt-in compile preflight on a CPU pod before the TPU JobSet is created (the "
        "preflight pod takes the trainer template's env, envFrom, volumes, volume mounts, ServiceAccount "
        "and pod labels and annotations, not its scheduling).",
    )


# Each quantization and the generations vLLM's TPU backend serves it on (rljob.recipes.quantization).
_QUANTIZED_ON = "; ".join(
    f"{q.name}: {', '.join(g.prefix for g in GENERATIONS.values() if served_on(q, g))}"
    + (f" (quantization_config.quant_method {q.vllm_method})" if q.vllm_method else "")
    for q in QUANTIZATIONS.values()
    if q.generations
)


class SamplerWeightsSpec(ApiModel):
    """The weights the samplers serve: spec.model.name's own (bfloat16), or a quantized checkpoint of the same
    model where vLLM's TPU backend serves it (rljob.recipes.quantization; docs/fit.md)."""

    quantization: Literal[tuple(QUANTIZATIONS)] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="How the served checkpoint stores its weights: bfloat16 (spec.model.name itself, the "
        "weights the trainer trains) or a quantization vLLM's TPU backend serves on the sampler's TPU "
        f"generation ({_QUANTIZED_ON}). A quantized checkpoint counts its quantized weights at their bytes "
        "in the fit check (embeddings, the output head, routers and norms stay bfloat16), is served with "
        "vLLM --quantization, and the trainer's step-0 parity gate compares against it at "
        "parityTolerance. " + _default("sampler.weights.quantization"),
    )
    name: str | None = _hf_id(
        "Hugging Face id of the quantized checkpoint of spec.model.name the samplers serve, e.g. "
        "Qwen/Qwen3.5-397B-A17B-FP8; required with a quantization. The trainer still trains "
        "spec.model.name's "
        "bfloat16 weights: this checkpoint must be a quantization of exactly those (the step-0 parity gate "
        "refuses one whose log-probs are not). Default: spec.model.name."
    )
    revision: str | None = _hf_id(
        "Hugging Face revision of name (a branch, a tag or a commit hash). Default: spec.model.revision at "
        "bfloat16, else main.",
        revision=True,
    )
    parity_tolerance: float | None = Field(
        default=None,
        gt=0,
        le=10,
        description="The trainer's step-0 parity gate: the largest mean |trainer - sampler| log-prob (nats) "
        "over the first batch's sampled tokens before it trains; above it the trainer exits 2. Default: "
        f"{BF16_PARITY_NATS:g} at bfloat16 (the same weights; two bf16 programs measured 0.04 apart on a "
        f"TPU), {QUANTIZED_PARITY_NATS:g} for a quantized checkpoint (a rounding of them; a bound chosen, "
        "not measured: docs/fit.md).",
    )


class SamplerSpec(ApiModel):
    """The vLLM samplers that generate rollouts with the latest LoRA adapter."""

    tpu: TpuField | None = Field(default=None, description=_TPU_DESCRIPTION)
    replicas: int | None = Field(
        default=None, ge=1, le=256, description="Number of sampler slices. " + _default("sampler.replicas")
    )
    tensor_parallel: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Tensor parallelism of one replica (tpu-inference's tensor_parallelism). "
        "tensorParallel x dataParallel x expertParallel must equal the replica's devices; the model's "
        "attention heads, KV heads (or a multiple of them: vLLM replicates them) and gated delta net heads "
        "must split over tensorParallel x expertParallel (rljob.recipes.sampler_layout lists the rules). "
        "Default: the replica's devices / (dataParallel x expertParallel), or, where that does not run or "
        "pads a mixture-of-experts model's experts to twice their size, a layout that does (shown as "
        "derived by `rljob plan`).",
    )
    expert_parallel: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Expert parallelism of one replica for a mixture-of-experts model (tpu-inference's "
        "expert_parallelism; vLLM --enable-expert-parallel); above 1 the model's experts split over every "
        "device of the replica, so they must divide by tensorParallel x expertParallel. "
        + _default("sampler.expertParallel", "unless the plan derives another: see tensorParallel"),
    )
    data_parallel: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Data parallelism inside one replica (vLLM --data-parallel-size); the pinned vLLM TPU "
        "build serves LoRA only at 1. " + _default("sampler.dataParallel"),
    )
    max_model_len: int | None = Field(
        default=None,
        ge=128,
        le=1 << 22,
        description="vLLM --max-model-len. Default: prompt + algorithm.maxTokens rounded up.",
    )
    max_loras: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="vLLM --max-loras: adapter versions live at once. "
        + _default("sampler.maxLoras", "the serving one and the next")
        + " With spec.service: spec.service.maxTrainingClients when that is more.",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        le=1 << 16,
        description="vLLM --max-num-seqs: sequences one replica decodes at once; the trainer sends a "
        "replica at most this many at a time. " + _default("sampler.maxNumSeqs"),
    )
    weights: SamplerWeightsSpec | None = Field(
        default=None,
        description="The weights the samplers serve: spec.model.name's, or a quantized checkpoint of it.",
    )
    image: str | None = Field(
        default=None,
        description="Sampler container image (a reference such as registry/path:tag or @sha256:...). "
        + _default("sampler.image"),
        max_length=syntax.IMAGE_MAX,
        pattern=syntax.IMAGE,
    )
    template: PodTemplate | None = Field(
        default=None, description="Overrides of the sampler pods (env, Secrets, volumes, scheduling)."
    )


class LoraSpec(ApiModel):
    """The LoRA adapter trained by the trainer (qwix) and served by the samplers (vLLM)."""

    rank: int | None = Field(
        default=None,
        ge=1,
        le=512,
        description="LoRA rank; one of vLLM's ranks 1, 8, 16, 32, 64, 128, 256, 320, 512. "
        + _default("lora.rank"),
    )
    alpha: float | None = Field(
        default=None, gt=0, le=1e6, description="LoRA alpha (scale = alpha / rank). Default: 2 x rank."
    )
    targets: (
        list[Annotated[str, StringConstraints(pattern=syntax.MODULE_NAME, max_length=syntax.MODULE_NAME_MAX)]]
        | None
    ) = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="Module names the adapter wraps. " + _default("lora.targets"),
    )
    init_from: str | None = Field(
        default=None,
        max_length=syntax.PATH_MAX,
        description="Warm start: a PEFT adapter directory (adapter_model.safetensors and "
        "adapter_config.json, as rljob, PEFT and the Tinker service write them) as gs://bucket/path or an "
        "absolute path in the trainer's filesystem, e.g. a previous run's "
        "{storage.root}/{namespace}/{name}/{uid}/adapters/v{N}. A run that has no checkpoint yet starts its "
        "LoRA factors from it (its rank, alpha and target modules must be this spec's: the trainer refuses "
        "another, exit 2) and publishes it as adapter v0, which the samplers serve first; a resumed run "
        "restores its checkpoint instead. Default: none (B = 0).",
    )

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, value: str | None) -> str | None:
        if value is not None and not (_GS_ROOT.match(value) or value.startswith("/")):
            raise ValueError("a gs://bucket/path URI or an absolute path")
        return value


class SamplingSpec(ApiModel):
    """The sampling parameters of the training rollouts: those vLLM's TPU backend (tpu-inference) applies,
    temperature, top-k then top-p (its TPUSupportedSamplingMetadata and _apply_sampling_transforms in
    tpu_inference/layers/jax/sample/, https://github.com/vllm-project/tpu-inference), and stop strings
    (vLLM's detokenizer, on every backend). Others (min_p, penalties, logit bias) it does not apply on
    TPU, so the spec has none."""

    temperature: float | None = Field(
        default=None,
        gt=0,
        le=100,
        description="Sampling temperature (above 0: GRPO needs a group's completions to differ). "
        + _default("algorithm.sampling.temperature"),
    )
    top_p: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Nucleus sampling: the smallest set of tokens whose probability reaches topP (1: off). "
        + _default("algorithm.sampling.topP"),
    )
    top_k: int | None = Field(
        default=None,
        ge=0,
        le=1 << 20,
        description="Sample from the topK most likely tokens (0: off; 1: greedy). "
        + _default("algorithm.sampling.topK"),
    )
    stop: list[Annotated[str, StringConstraints(min_length=1, max_length=256)]] | None = Field(
        default=None,
        max_length=16,
        description="Stop strings: a completion ends with the token that completes the first of them "
        "(vLLM's stop; the text leaves it out, the tokens trained on keep it). "
        + _default("algorithm.sampling.stop"),
    )


class EvaluationSpec(ApiModel):
    """Evaluation during training on the held-out split (spec.dataset.evalSize prompts)."""

    every: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000_000,
        description="Evaluate every N steps (0: never). " + _default("evaluation.every"),
    )
    pass_k: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="pass@k, from the unbiased estimator of https://arxiv.org/abs/2107.03374 over the "
        "samples drawn per prompt. " + _default("evaluation.passK"),
    )
    maj_k: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="maj@k: a prompt counts as solved when the most common answer of its first majK "
        "samples is graded correct (0: not measured). " + _default("evaluation.majK"),
    )
    samples: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Samples per held-out prompt; at least passK and majK. Default: max(passK, majK).",
    )
    temperature: float | None = Field(
        default=None,
        ge=0,
        le=100,
        description="Sampling temperature of the evaluation (0: greedy, only with one sample). Default: 0 "
        "with one sample, else 1.",
    )


class AlgorithmSpec(ApiModel):
    """The RL algorithm (GRPO family)."""

    loss: Literal["importance_sampling", "ppo"] | None = Field(
        default=None,
        description="Policy loss: importance_sampling or ppo (clipped). " + _default("algorithm.loss"),
    )
    group_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Completions sampled per prompt. " + _default("algorithm.groupSize"),
    )
    groups_per_batch: int | None = Field(
        default=None,
        ge=1,
        le=65536,
        description="Prompts (groups) per optimizer step. " + _default("algorithm.groupsPerBatch"),
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="Completion token limit. " + _default("algorithm.maxTokens"),
    )
    max_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="Prompt token limit. " + _default("algorithm.maxPromptTokens"),
    )
    learning_rate: float | None = Field(
        default=None, gt=0, lt=1, description="Adam learning rate. " + _default("algorithm.learningRate")
    )
    steps: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000_000,
        description="Optimizer steps to run. " + _default("algorithm.steps"),
    )
    warmup_steps: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000_000,
        description="Optimizer steps of a linear learning-rate warm-up from 0 to learningRate: step s "
        "(0-based) updates with learningRate x (s + 1) / (warmupSteps + 1); the steps after it follow "
        "learningRateSchedule. " + _default("algorithm.warmupSteps", "no warm-up"),
    )
    learning_rate_schedule: Literal["constant", "linear", "cosine"] | None = Field(
        default=None,
        description="The learning rate after the warm-up: constant, or decaying to 0 at the last step "
        "(steps) linearly or along a half cosine (optax linear_schedule / cosine_decay_schedule). "
        + _default("algorithm.learningRateSchedule"),
    )
    kl_penalty_coef: float | None = Field(
        default=None,
        ge=0,
        le=1e6,
        description="Weight of a k3 KL penalty against the base policy (the adapter off), per token: the "
        "trainer computes the base policy's log-probs of each packed micro-batch in one more forward pass. "
        + _default("algorithm.klPenaltyCoef", "no penalty, no extra pass"),
    )
    advantage_normalization: Literal["mean", "std"] | None = Field(
        default=None,
        description="GRPO advantage of a completion from its group's rewards: mean = reward - group mean "
        "(the Tinker cookbook's compute_advantages; Dr. GRPO, https://arxiv.org/abs/2503.20783), std = that "
        "divided by the group's standard deviation (the original GRPO; tunix's compute_advantages with "
        "std_scale). "
        + _default("algorithm.advantageNormalization")
        + " Dividing by the std weights a group whose rewards barely differ as much "
        "as one whose rewards differ a lot, and changes the loss scale from step to step. Either way a group "
        "whose rewards are all equal carries no signal and is left out of the step.",
    )
    # The loop's loss and sampling options (rljob.recipes.loop_options checks them together).
    clip_low: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="Loss ppo: a token's (or, with importanceRatio sequence, a sequence's) ratio is clipped "
        "below at 1 - clipLow (DAPO's eps_low). " + _default("algorithm.clipLow"),
    )
    clip_high: float | None = Field(
        default=None,
        ge=0,
        le=100,
        description="Loss ppo: the ratio is clipped above at 1 + clipHigh (DAPO's eps_high; clip-higher, "
        "https://arxiv.org/abs/2503.14476, sets it above clipLow, e.g. 0.28, so a positive-advantage "
        "token's probability may rise further). " + _default("algorithm.clipHigh"),
    )
    importance_ratio: Literal["token", "sequence"] | None = Field(
        default=None,
        description="token: each token's own ratio pi / pi_old (GRPO, PPO); sequence: GSPO's sequence-level "
        "ratio (https://arxiv.org/abs/2507.18071), exp of the mean of a completion's token log-ratios, "
        "shared by all of its tokens (clipped as one with loss ppo; GSPO pairs it with lossNormalization "
        "sequence). " + _default("algorithm.importanceRatio"),
    )
    loss_normalization: Literal["token", "sequence"] | None = Field(
        default=None,
        description="How the step's tokens are weighted: token, one mean over every completion token of "
        "the step (DAPO's token-level loss: a long completion weighs in proportion to its length); "
        "sequence, the mean over each completion's tokens, then over completions (the original GRPO: each "
        "completion weighs the same). " + _default("algorithm.lossNormalization"),
    )
    overlong_buffer: int | None = Field(
        default=None,
        ge=0,
        le=1 << 20,
        description="DAPO's soft overlong punishment: a completion longer than maxTokens - overlongBuffer "
        "tokens loses overlongPenalty x (its length - (maxTokens - overlongBuffer)) / overlongBuffer of "
        "reward, linearly up to overlongPenalty at maxTokens; at most maxTokens. "
        + _default("algorithm.overlongBuffer", "no shaping"),
    )
    overlong_penalty: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="The reward a completion of maxTokens tokens loses with overlongBuffer set. "
        + _default("algorithm.overlongPenalty"),
    )
    sampling: SamplingSpec | None = Field(
        default=None,
        description="How the samplers sample the training rollouts (vLLM's sampling parameters, those its "
        "TPU backend applies). The completion length is maxTokens.",
    )


class PackingSpec(ApiModel):
    """Token-budget sequence packing of training rows (first-fit decreasing into one compiled shape)."""

    token_budget: int | None = Field(
        default=None,
        ge=128,
        le=1 << 22,
        description="Tokens per packed row (MaxText max_target_length). Default: maxPromptTokens + maxTokens "
        "rounded up to a multiple of 128 and of segmentAlign.",
    )
    segment_align: int | None = Field(
        default=None,
        ge=1,
        le=1 << 22,
        description="Every segment after the first in a row starts at a multiple of this many tokens. "
        + _default("packing.segmentAlign"),
    )
    pad_position: Literal["end", "start", "balanced"] | None = Field(
        default=None,
        description="Where a row's padding goes: end, start or balanced. "
        + _default("packing.padPosition")
        + " With start each row is "
        "the end layout moved right by its trailing padding rounded down to padAlign, so under load-balanced "
        "context parallelism every rank skips the padding's key tiles (Splash). With balanced the trainer "
        "orders each row's rollouts to minimise the busiest context rank's attention tiles under the "
        "plan's context parallelism and Splash blocks (sa_block_q x sa_block_kv, sa_block_q_dkv x "
        "sa_block_kv_dkv), never more than start gives; tokenBudget must then be a multiple of 2 x "
        "context x each query block and of each key block.",
    )
    pad_align: int | None = Field(
        default=None,
        ge=1,
        le=1 << 22,
        description="With padPosition start (and balanced's pad-first candidate): the shift is rounded "
        "down to a multiple of this many tokens (a positive multiple of segmentAlign), so segment starts "
        "keep their place relative to the kernel's tiles. Not read with end, where only the default is "
        "accepted. " + _default("packing.padAlign", "the largest Splash block"),
    )
    max_segments_per_row: int | None = Field(
        default=None,
        ge=1,
        le=1 << 22,
        description="At most this many rollouts in one packed row. Default: as many as fit, and 1 for a "
        "model whose decoder has gated delta net layers (MaxText decoder blocks qwen3_5 and qwen3_next): "
        "their convolution and recurrence run along the whole row, so such a model trains one rollout per "
        "row with padPosition end, and the plan refuses any other value or padPosition for it.",
    )


class StorageSpec(ApiModel):
    """Where the run keeps its state."""

    root: str | None = Field(
        default=None,
        description="gs:// prefix for checkpoints, adapters, rollouts and caches; the run writes under "
        "{root}/{namespace}/{name}/{uid}/ (uid: the RLJob's metadata.uid, so that an RLJob created again "
        "under the same name never resumes another run's checkpoints; without a uid, as in `rljob render` "
        "of a file, {root}/{namespace}/{name}/).",
        max_length=syntax.PATH_MAX,
    )

    @field_validator("root")
    @classmethod
    def _gs_root(cls, value: str | None) -> str | None:
        if value is not None and not _GS_ROOT.match(value):
            raise ValueError(
                "must be gs://BUCKET or gs://BUCKET/PREFIX "
                "(bucket: 3-63 lowercase letters, digits, '-', '_', '.')"
            )
        # Cloud Storage takes object names literally, while orbax's paths (etils epath) collapse `//` and
        # `/./`: with such a prefix the checkpoints and the rest of the run (adapters, rollouts, written
        # through google-cloud-storage) would land under two different prefixes; `..` would read as a
        # parent it is not.
        if value is not None and {"", ".", ".."} & set(value[len("gs://") :].rstrip("/").split("/")[1:]):
            raise ValueError("the PREFIX of gs://BUCKET/PREFIX may hold no empty, '.' or '..' segment")
        return value


class FailurePolicySpec(ApiModel):
    """How failures are retried, per role. A trainer failure restarts the whole run from its last
    checkpoint; a sampler failure (a crash, an OOM, a lost Ray worker of a multi-host replica) restarts
    that sampler Job alone while the trainer keeps running. Exit 2 (bad configuration) fails the run at
    once. Preemption and maintenance restarts are never counted."""

    max_restarts: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="Counted restarts of the whole run after a trainer crash before the job fails. "
        + _default("failurePolicy.maxRestarts"),
    )
    max_sampler_restarts: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="Counted restarts of single sampler Jobs (all sampler replicas together) after a sampler "
        "crash before the job fails; the trainer keeps running meanwhile. "
        + _default("failurePolicy.maxSamplerRestarts"),
    )
    max_non_finite_steps: int | None = Field(
        default=None,
        ge=1,
        le=10000,
        description="Consecutive optimizer steps whose update is not finite (NaN or Inf in the loss, a "
        "gradient or the update; the trainer skips such an update) before the run fails with exit 2, "
        "not restarted: a restart resumes the same state and rollouts and would diverge again. "
        + _default("failurePolicy.maxNonFiniteSteps"),
    )


_DATA_PATH = re.compile(r"^(gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]/[^\s]*[^\s/]|/[^\s]*[^\s/])$")
# A task's name: an entry point of the group rljob.tasks in the trainer image (docs/tasks.md).
_TASK_NAME = r"^[a-z][a-z0-9_.-]{0,62}$"
_OPTION_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,62}$")
MAX_TASK_OPTIONS = 32


class DatasetSpec(ApiModel):
    """The prompts the RL loop samples and how their completions are graded."""

    task: str | None = Field(
        default=None,
        description="The task: its name in the entry-point group rljob.tasks of the trainer image "
        "(docs/tasks.md: a package installed in the image registers its own). Built in: math, problems "
        "from `path`, each completion graded 1 or 0 by a math verifier (math-verify: LaTeX and plain "
        "numbers, equivalent forms such as 1/2 and 0.5); successor, the toy task of the CPU loop (token "
        "prompts, for development with the tiny model only). The trainer refuses a name its image does "
        "not register (exit 2, listing the ones it has). " + _default("dataset.task"),
        max_length=63,
        pattern=_TASK_NAME,
    )
    options: dict[str, Annotated[str, StringConstraints(max_length=4096)]] | None = Field(
        default=None,
        max_length=MAX_TASK_OPTIONS,
        description="Options of the task, strings by name (keys: a letter or _, then letters, digits, "
        "_ . -; at most 63 characters). Each task documents its own and refuses the ones it does not "
        "know (exit 2); math takes questionField and answerField, the JSON keys of a problem's question "
        "and answer (default question and answer).",
    )
    path: str | None = Field(
        default=None,
        description="The task's data, as a gs:// object or an absolute path in the trainer's filesystem; "
        'for math, JSON Lines of problems, one {"question": ..., "answer": ...} per line (GSM8K style: the '
        "final answer after ####). Default: {storage.root}/"
        + DEFAULT_DATASET_OBJECT
        + " (task successor reads no file). The trainer reads it at start: a missing or malformed file "
        "fails the run at once (exit 2), it is never retried.",
        max_length=syntax.PATH_MAX,
    )
    eval_size: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="Problems held out from the head of the file for evaluation (never trained on). "
        + _default("dataset.evalSize"),
    )
    prompt_template: str | None = Field(
        default=None,
        min_length=1,
        max_length=16384,
        description="Task math: the Python format string of each prompt with the field {question} (no "
        "format spec or conversion; {{ and }} are literal braces). " + _default("dataset.promptTemplate"),
    )

    @field_validator("path")
    @classmethod
    def _data_path(cls, value: str | None) -> str | None:
        if value is not None and not _DATA_PATH.match(value):
            raise ValueError("must be a gs://BUCKET/OBJECT or an absolute path to a file")
        return value

    reward_url: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://[^\s/]+(/\S*)?$",
        description="An HTTP service that grades the completions instead of the task's own reward (e.g. "
        "rewards that run code, in a sandbox of their own): the trainer POSTs each completion as JSON "
        '{"completion", "reference", "prompt", "id"} and reads a number, or {"reward": number}, back; '
        "a failing request is retried with backoff, and a service that never answers stops the trainer "
        "(a crash, restarted). docs/tasks.md.",
    )

    @field_validator("options")
    @classmethod
    def _option_keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        bad = [k for k in value or {} if not _OPTION_KEY.match(k)]
        if bad:
            raise ValueError(
                "option names are a letter or _, then letters, digits, _ . - (at most 63 characters): "
                + ", ".join(repr(k[:70]) for k in sorted(bad)[:5])
            )
        return value

    @field_validator("prompt_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is None:
            return value
        # Parsed, never formatted here: str.format of a spec such as {question:>999999999} allocates what the
        # spec asks for before any check could refuse it. The parse is linear in the template's length.
        import string

        try:
            parsed = list(string.Formatter().parse(value))
            fields = [(f, spec, conv) for _, f, spec, conv in parsed if f is not None]
        except ValueError as e:
            raise ValueError(f"must be a format string whose only field is {{question}} ({e})") from None
        for name, spec, conversion in fields:
            if name != "question" or spec or conversion:
                text = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
                raise ValueError(
                    f"must be a format string whose only field is {{question}}, without a format spec or "
                    f"conversion (found {text[:80] + '}'!r}; write {{{{ and }}}} for literal braces)"
                )
        if not fields:
            raise ValueError("must contain {question}")
        return value


class ServiceSpec(ApiModel):
    """Service mode: the trainer runs no RL loop of its own but serves an API that clients train through."""

    api: Literal["tinker"] = Field(
        description="The API served: tinker (the Tinker HTTP API; the official `tinker` SDK is the client)."
    )
    port: int | None = Field(
        default=None,
        ge=1024,
        le=65535,
        description="Port of the API on the trainer pod and its Service. " + _default("service.port"),
    )
    max_training_clients: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="LoRA adapters trained at once over the one base model (training clients, each its own "
        "adapter, optimizer state and checkpoints); a client beyond it is refused. The samplers' maxLoras "
        "must hold one adapter per client. " + _default("service.maxTrainingClients"),
    )
    checkpoint_every: int | None = Field(
        default=None,
        ge=0,
        description="Optimizer steps between a training client's automatic checkpoints, which a restarted "
        "trainer resumes from (0: only when a client is created or loaded). "
        + _default("service.checkpointEvery"),
    )
    api_key_secret: str | None = Field(
        default=None,
        max_length=syntax.DNS1123_SUBDOMAIN_MAX,
        pattern=syntax.DNS1123_SUBDOMAIN,
        description="Secret (same namespace) whose key `api-keys` lists the accepted API keys, comma-"
        "separated, each starting with tml- (the SDK's rule). Required with spec.service: the API "
        "accepts no request without one of these keys, and each key sees only what it created.",
    )
    client_namespaces: (
        list[
            Annotated[
                str, StringConstraints(max_length=syntax.DNS1123_LABEL_MAX, pattern=syntax.DNS1123_LABEL)
            ]
        ]
        | None
    ) = Field(
        default=None,
        max_length=64,
        description="Namespaces whose pods may reach the API, besides the run's own: the run's "
        "NetworkPolicy admits connections to the API port from these namespaces only (docs/operator.md). "
        + _default("service.clientNamespaces"),
    )


class RLJobSpec(ApiModel):
    """Desired state of an RLJob."""

    recipe: str | None = Field(
        default=None,
        description="A catalog recipe (`rljob recipes list`); its values are defaults the manifest "
        "overrides key by key.",
        max_length=syntax.CATALOG_NAME_MAX,
        pattern=syntax.CATALOG_NAME,
    )
    model: ModelSpec | None = Field(default=None, description="The base model.")
    trainer: TrainerSpec | None = Field(default=None, description="The trainer role.")
    sampler: SamplerSpec | None = Field(default=None, description="The sampler role.")
    lora: LoraSpec | None = Field(default=None, description="The LoRA adapter.")
    algorithm: AlgorithmSpec | None = Field(default=None, description="The RL algorithm.")
    packing: PackingSpec | None = Field(default=None, description="Sequence packing.")
    dataset: DatasetSpec | None = Field(default=None, description="Training prompts and their grading.")
    evaluation: EvaluationSpec | None = Field(
        default=None, description="Evaluation during training on the held-out split (the RL loop)."
    )
    service: ServiceSpec | None = Field(
        default=None,
        description="Serve an API (the Tinker API) from the trainer instead of running the built-in RL loop.",
    )
    storage: StorageSpec | None = Field(default=None, description="Run storage.")
    failure_policy: FailurePolicySpec | None = Field(default=None, description="Retry policy.")
    suspend: bool | None = Field(
        default=None, description="Suspend the run (the JobSet is suspended). " + _default("suspend")
    )
    queue_name: str | None = Field(
        default=None,
        description="Kueue LocalQueue name (label kueue.x-k8s.io/queue-name): lowercase letters, digits, "
        "'-' and '.', at most 63.",
        max_length=syntax.QUEUE_NAME_MAX,
        pattern=syntax.QUEUE_NAME,
    )
    priority_class_name: str | None = Field(
        default=None,
        description="PriorityClass of every pod (a DNS-1123 subdomain).",
        max_length=syntax.DNS1123_SUBDOMAIN_MAX,
        pattern=syntax.DNS1123_SUBDOMAIN,
    )


# ------------------------------------------------------------------------------------------- status


class Phase(StrEnum):
    """Lifecycle phase of an RLJob."""

    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class FailureClass(StrEnum):
    """Why the last failure happened (see rljob.recipes.failure)."""

    PREEMPTION = "preemption"
    MAINTENANCE = "maintenance"
    BAD_CONFIGURATION = "badConfiguration"
    CRASH = "crash"


class Condition(ApiModel):
    """A Kubernetes-style status condition."""

    type: str = Field(description="Condition type, e.g. Ready, Progressing, Failed.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: datetime | None = Field(default=None, description="When status last changed.")
    observed_generation: int | None = Field(default=None, description="metadata.generation this reflects.")


class RoleRestarts(ApiModel):
    """Counted restarts of one role against its budget."""

    used: int = Field(default=0, ge=0, description="Counted restarts so far.")
    left: int = Field(default=0, ge=0, description="Counted restarts left before the job fails.")


class Restarts(ApiModel):
    """Restart accounting. `used`/`left`: restarts of the whole run (a trainer crash) against
    spec.failurePolicy.maxRestarts, the same numbers as `trainer`; `sampler`: restarts of single sampler
    Jobs against spec.failurePolicy.maxSamplerRestarts. Preemption and maintenance are never counted."""

    used: int = Field(default=0, ge=0, description="Counted restarts of the run so far.")
    left: int = Field(default=0, ge=0, description="Counted restarts of the run left before the job fails.")
    trainer: RoleRestarts | None = Field(
        default=None,
        description="Restarts of the whole run after a trainer crash (spec.failurePolicy.maxRestarts).",
    )
    sampler: RoleRestarts | None = Field(
        default=None,
        description="Restarts of single sampler Jobs after a sampler crash "
        "(spec.failurePolicy.maxSamplerRestarts).",
    )


class LastFailure(ApiModel):
    """The most recent failure."""

    failure_class: FailureClass = Field(
        alias="class", description="preemption, maintenance, badConfiguration or crash."
    )
    reason: str = Field(default="", description="Short machine-readable reason.")
    message: str = Field(default="", description="Human-readable detail.")
    time: datetime | None = Field(default=None, description="When it happened.")
    role: str | None = Field(default=None, description="The role that failed: trainer or sampler.")


class RoleStatus(ApiModel):
    """Readiness of one role's pods."""

    ready: int = Field(default=0, ge=0, description="Ready pods.")
    total: int = Field(default=0, ge=0, description="Pods the role needs.")


class RolesStatus(ApiModel):
    """Readiness per role."""

    trainer: RoleStatus = Field(default_factory=RoleStatus, description="Trainer pods.")
    sampler: RoleStatus = Field(default_factory=RoleStatus, description="Sampler pods.")


class EvaluationReport(ApiModel):
    """The newest evaluation on the held-out split (spec.evaluation)."""

    step: int = Field(ge=0, description="The step it evaluated (the adapter of that step or newer).")
    reward_mean: float = Field(description="Mean reward of every held-out sample.")
    pass_k: int = Field(ge=1, description="pass@k's k.")
    pass_at_k: float = Field(ge=0, le=1, description="pass@k (the unbiased estimator), mean over prompts.")
    maj_k: int | None = Field(default=None, ge=1, description="maj@k's k; None: not measured.")
    maj_at_k: float | None = Field(default=None, ge=0, le=1, description="maj@k, mean over prompts.")


class ProgressReport(ApiModel):
    """What the trainer reports after each step (contract 4): ConfigMap `<rljob>-progress`, key
    `progress.json`, copied by the operator into status.progress."""

    step: int = Field(default=0, ge=0, description="Last completed optimizer step.")
    last_checkpoint_step: int | None = Field(default=None, ge=0, description="Step of the newest checkpoint.")
    resumed_from_step: int | None = Field(default=None, ge=0, description="Step this attempt resumed from.")
    reward_mean: float | None = Field(default=None, description="Mean reward of the last step's rollouts.")
    adapter_version: int | None = Field(
        default=None, ge=0, description="Newest published adapter version N (v{N}/)."
    )
    update_time: datetime | None = Field(default=None, description="When the report was written.")
    message: str | None = Field(
        default=None,
        max_length=512,
        description="What the trainer is doing before its first step, with its progress and time (the "
        "base weights' conversion: 'converting Qwen/Qwen3-8B@main: 120/399 tensors, 41 s'); cleared by "
        "the first step's report.",
    )
    evaluation: EvaluationReport | None = Field(
        default=None, description="The newest evaluation on the held-out split; None: none yet."
    )


class PreflightState(StrEnum):
    """Where the compile preflight of a run stands."""

    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    DOES_NOT_FIT = "DoesNotFit"
    FAILED = "Failed"


class PreflightStatus(ApiModel):
    """The compile preflight's Job and outcome (spec.trainer.preflight), kept after the Job is gone."""

    job: str = Field(description="Name of the preflight Job (it names a digest of what it compiles).")
    state: PreflightState = Field(description="Running, Succeeded, DoesNotFit or Failed.")
    message: str | None = Field(
        default=None,
        description="What the compile said: one line per problem for DoesNotFit.",
        max_length=4096,
    )


class RLJobStatus(ApiModel):
    """Observed state of an RLJob (written by the operator)."""

    phase: Phase | None = Field(
        default=None, description="Pending, Running, Restarting, Succeeded, Failed, Suspended."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Status conditions.")
    observed_generation: int | None = Field(default=None, description="metadata.generation last acted on.")
    job_set_name: str | None = Field(default=None, description="Name of the JobSet running this job.")
    restarts: Restarts | None = Field(default=None, description="Restarts used and left.")
    last_failure: LastFailure | None = Field(default=None, description="The most recent failure.")
    roles: RolesStatus | None = Field(default=None, description="Per-role readiness.")
    progress: ProgressReport | None = Field(default=None, description="The trainer's latest progress report.")
    url: str | None = Field(
        default=None,
        description="In-cluster URL of the API the trainer serves (spec.service), e.g. the Tinker API.",
    )
    preflight: PreflightStatus | None = Field(
        default=None, description="The compile preflight (spec.trainer.preflight.compile); None: not run."
    )
    sampler_failure: SamplerFailure | None = Field(
        default=None,
        description="What a sampler crash restarts in this run's JobSet: RestartSamplerJob (that sampler "
        "Job alone, against spec.failurePolicy.maxSamplerRestarts; JobSet's feature gate RestartJob) or "
        "RestartRun (the whole run from its last checkpoint, against spec.failurePolicy.maxRestarts: the "
        "cluster's JobSet refuses the action RestartJob). None: not planned yet.",
    )


# ----------------------------------------------------------------------------------------- resource


class ObjectMeta(BaseModel):
    """The part of Kubernetes object metadata rljob reads; other fields the API server adds are ignored."""

    model_config = ConfigDict(
        extra="ignore",
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    name: str = Field(
        description="RLJob name (DNS-1123 label).",
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    )
    namespace: str = Field(
        default="default",
        description="Namespace.",
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")
    uid: str | None = Field(
        default=None,
        description="Object UID (set by the API server).",
        max_length=syntax.UID_MAX,
        pattern=syntax.UID,
    )
    generation: int | None = Field(default=None, description="Spec generation (set by the API server).")


class RLJob(ApiModel):
    """An RL post-training run: GRPO with a LoRA adapter, a MaxText trainer and vLLM samplers on TPU."""

    api_version: Literal["rljob.dev/v1alpha1"] = Field(
        default="rljob.dev/v1alpha1", description="rljob.dev/v1alpha1."
    )
    kind: Literal["RLJob"] = Field(default="RLJob", description="RLJob.")
    metadata: ObjectMeta = Field(description="Object metadata.")
    spec: RLJobSpec = Field(description="Desired state.")
    status: RLJobStatus | None = Field(default=None, description="Observed state (written by the operator).")


__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "AlgorithmSpec",
    "ApiModel",
    "Condition",
    "EnvVar",
    "EvaluationReport",
    "EvaluationSpec",
    "FailureClass",
    "FailurePolicySpec",
    "LastFailure",
    "LogprobsSpec",
    "LoraSpec",
    "MeshAxes",
    "MeshSpec",
    "ModelSpec",
    "ObjectMeta",
    "PackingSpec",
    "Phase",
    "PodMetadata",
    "PodTemplate",
    "PodTemplateSpec",
    "PreflightSpec",
    "PreflightState",
    "PreflightStatus",
    "ProgressReport",
    "RLJob",
    "RLJobSpec",
    "RLJobStatus",
    "Resources",
    "Restarts",
    "RoleRestarts",
    "RoleStatus",
    "RolesStatus",
    "SamplerSpec",
    "SamplingSpec",
    "ServiceSpec",
    "StorageSpec",
    "Toleration",
    "TpuSlice",
    "TrainerSpec",
    "VolumeMount",
]
