"""The fit check: do the weights, the LoRA and its optimizer state fit a trainer device, and do a sampler
replica's weights leave room for its KV cache? Arithmetic on the model's shapes, no JAX, microseconds.

What is counted, per JAX device (HBM per device: rljob.recipes.tpu.hbm_bytes_per_device):

Trainer (rljob.trainer: MaxText model + qwix LoRA + optax AdamW on the LoRA factors only):
- the frozen base weights, in MaxText's effective ``weight_dtype`` (the job's key, else the model config's,
  else MaxText's default, float32), sharded over every mesh axis but data: MaxText's logical axis rules
  (configs/base.yml) put ``embed`` on fsdp/context/expert, ``mlp``/``heads``/``vocab`` on tensor and
  ``exp`` on expert, and no parameter on data;
- the LoRA factors (rljob.trainer.lora: in the kernel's dtype, replicated but for the layer axis, which
  maps to the stage axis rljob leaves at 1): the factors, AdamW's two moments (optax keeps them in the
  parameter dtype), the gradient accumulator and one micro-batch's gradient: five copies. rljob's optimizer
  keeps no float32 master copy (rljob.trainer.train_step);
- each decoder layer's input, which the backward restarts from under any remat policy (MaxText's scan
  carry): layers x tokens per device x emb x the activation dtype, unless remat_policy custom offloads it
  (decoder_layer_input offload);
- a reserve of TRAINER_RESERVE of the device's HBM for everything else (a layer's forward/backward
  working set, collective buffers, XLA temporaries, libtpu's own). That is a floor, not a forecast: the
  real peak is the TPU compiler's to say (`rljob drill --compile`, docs/drill.md).

Sampler (vLLM's TPU backend, tpu-inference): the weights under the replica's layout (bf16, or a quantized
checkpoint's bytes: its quantized linear weights and their scales at the quantization's bytes, the
embeddings, output head, routers and gated delta net's small projections in bf16;
rljob.recipes.quantization) (MLPs and
experts split over tensor x expert parallelism; attention and embeddings over tensor parallelism,
replicated over the expert axis, as tpu-inference's sharding axis names lay them out), the LoRA slots
vLLM allocates (maxLoras x the largest rank over every attention and dense-MLP projection), within
vLLM's ``gpu_memory_utilization`` (VLLM_MEMORY_UTILIZATION of HBM, the default rljob leaves). What is left
is the KV cache: per token, each full-attention layer's K and V (the KV heads a device holds: tensor
parallelism beyond the KV heads replicates them; MLA: the compressed latent), per sequence the gated
delta net layers' recurrent and convolution state. A replica is refused when that room cannot hold one
sequence of maxModelLen (vLLM refuses to start then); the plan shows how many sequences of maxModelLen
it holds at once against maxNumSeqs (fewer means queued or preempted sequences, not a failure).

Left out: activations beyond the layer inputs, the fused log-prob head's blocks, fragmentation, host
memory, vLLM's compiled-graph and sampler buffers (inside the utilization's headroom). Sliding-window
layers are counted as full attention, Gemma 4's global layers at the local layers' head size: both
overcount or undercount by a few percent at most of the weights, and the KV cache conservatively.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from typing import Any

from rljob.recipes import families, lora_targets, maxtext_keys, mesh, quantization, tpu
from rljob.recipes.api import RLJobSpec
from rljob.recipes.runconfig import MESH_AXES, MeshPlan, RunConfig, SamplerPlan, TrainerPlan

# Fraction of a trainer device's HBM held back for what the check does not count (see the docstring).
TRAINER_RESERVE = 0.10
# vLLM's default --gpu-memory-utilization (vllm/config/cache.py CacheConfig.gpu_memory_utilization,
# https://docs.vllm.ai/en/stable/api/vllm/config/cache/: 0.9 in the releases tpu-inference 0.32 builds on,
# 0.92 in later ones; the lower is taken). rljob's sampler does not set it.
VLLM_MEMORY_UTILIZATION = 0.9
SAMPLER_WEIGHT_BYTES = 2  # the sampler's LoRA slots and unquantized weights: bf16
KV_BYTES = 2  # KV cache and recurrent state in the model's dtype, bf16
GIB = 2**30

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp8": 1, "int8": 1}
# MaxText decoder blocks whose attention is MLA (compressed KV): DeepSeek's.
_MLA_BLOCKS = families.blocks_where("mla")


@dataclass(frozen=True)
class Shapes:
    """The shape facts of one MaxText model that its size follows from."""

    block: str
    layers: int
    emb: int
    vocab: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    moe_mlp: int
    experts: int
    shared_experts: int
    first_dense: int
    moe_every: int
    gated_mlp: bool
    tied: bool
    attention_layers: int  # full-attention layers (the rest: gated delta net)
    gated_attention: bool  # the query projection also produces an output gate (Qwen3-Next, Qwen3.5)
    share_kv: bool  # global layers' keys double as values (Gemma 4)
    global_layers: int  # full-attention layers among sliding-window ones with their own shapes (Gemma 4)
    global_kv_heads: int
    global_head_dim: int
    mla: bool
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    gdn: tuple[int, int, int, int, int]  # key heads, key head dim, value heads, value head dim, conv kernel

    @property
    def gdn_layers(self) -> int:
        return self.layers - self.attention_layers

    def moe_layers(self) -> int:
        if self.experts <= 1:
            return 0
        # layers i >= first_dense with (i + 1) % moe_every == 0 (MaxText's interleave_moe_layer_step)
        first = max(0, min(self.first_dense, self.layers))
        return self.layers // self.moe_every - first // self.moe_every


def _int(value: Any, default: int = 0) -> int:
    v = maxtext_keys.number(value)
    return default if v is None else int(v)


def shapes(model: str, keys: Mapping[str, Any], version: str = maxtext_keys.DEFAULT_VERSION) -> Shapes | None:
    """The model's shapes from MaxText's model config under the job's keys (``override_model_config``
    changes them); None where the version or the model is not known (the plan reports those)."""
    try:
        keyset = maxtext_keys.load(version)
    except KeyError:
        return None
    if model not in keyset.models:
        return None
    get = maxtext_keys.effective(keys, keyset, model)

    layers = _int(get("num_decoder_layers")) or _int(get("base_num_decoder_layers"))
    emb = _int(get("base_emb_dim"))
    if layers < 1 or emb < 1:
        return None
    block = str(get("decoder_block") or "").lower()
    mlp = _int(get("base_mlp_dim"))
    moe_mlp = _int(get("base_moe_mlp_dim"))
    acts = get("mlp_activations")
    gated = not isinstance(acts, list | tuple) or len(acts) >= 2
    gdn_blocks = maxtext_keys.GATED_DELTA_NET_BLOCKS
    interval = max(1, _int(get("inhomogeneous_layer_cycle_interval"), 1))
    attention_layers = layers // interval if block in gdn_blocks else layers
    # MaxText 0.2.5 models/gemma4.py GEMMA4_ATTENTION_PATTERN: five sliding-window layers, then a global one
    # (global_head_dim, global_num_kv_heads, share_kv_projections apply to the global layers only).
    global_layers = layers // (families.FAMILIES["gemma4"].attention_cycle or 1) if block == "gemma4" else 0
    mla = block in _MLA_BLOCKS or str(get("attention_type")).lower() == "mla"
    return Shapes(
        block=block,
        layers=layers,
        emb=emb,
        vocab=_int(get("vocab_size")),
        q_heads=_int(get("base_num_query_heads"), 1),
        kv_heads=_int(get("base_num_kv_heads"), 1),
        head_dim=_int(get("head_dim"), 128),
        mlp=mlp,
        moe_mlp=moe_mlp if moe_mlp > 0 else mlp,
        experts=_int(get("num_experts"), 1),
        shared_experts=_int(get("shared_experts")),
        first_dense=_int(get("first_num_dense_layers")),
        moe_every=max(1, _int(get("interleave_moe_layer_step"), 1)),
        gated_mlp=gated,
        tied=maxtext_keys.truthy(get("logits_via_embedding")),
        attention_layers=attention_layers,
        gated_attention=block in gdn_blocks,
        share_kv=maxtext_keys.truthy(get("share_kv_projections")),
        global_layers=global_layers,
        global_kv_heads=_int(get("global_num_kv_heads")) or _int(get("base_num_kv_heads"), 1),
        global_head_dim=_int(get("global_head_dim")) or _int(get("head_dim"), 128),
        mla=mla,
        q_lora_rank=_int(get("q_lora_rank")),
        kv_lora_rank=_int(get("kv_lora_rank")),
        qk_nope=_int(get("qk_nope_head_dim")),
        qk_rope=_int(get("qk_rope_head_dim")),
        v_head=_int(get("v_head_dim")),
        gdn=(
            _int(get("gdn_num_key_heads")),
            _int(get("gdn_key_head_dim")),
            _int(get("gdn_num_value_heads")),
            _int(get("gdn_value_head_dim")),
            _int(get("gdn_conv_kernel_dim"), 4),
        ),
    )


@dataclass(frozen=True)
class Params:
    """Parameter counts of a model by where they live."""

    embedding: int  # token embedding and (untied) output head
    attention: int  # attention and gated delta net projections, every layer
    dense_mlp: int  # dense MLP layers and shared experts
    experts: int  # routed experts and routers

    @property
    def total(self) -> int:
        return self.embedding + self.attention + self.dense_mlp + self.experts


def _attention_params(s: Shapes, global_layer: bool = False) -> int:
    if s.mla:
        nq, qk = s.q_heads, s.qk_nope + s.qk_rope
        q = s.emb * s.q_lora_rank + s.q_lora_rank * nq * qk if s.q_lora_rank else s.emb * nq * qk
        kv = s.emb * (s.kv_lora_rank + s.qk_rope) + s.kv_lora_rank * nq * (s.qk_nope + s.v_head)
        return q + kv + nq * s.v_head * s.emb
    hd, kv = (s.global_head_dim, s.global_kv_heads) if global_layer else (s.head_dim, s.kv_heads)
    q_out = s.q_heads * hd * (2 if s.gated_attention else 1)
    kv_out = kv * hd * (1 if global_layer and s.share_kv else 2)
    return s.emb * (q_out + kv_out) + s.q_heads * hd * s.emb


def _gdn_params(s: Shapes) -> int:
    nk, dk, nv, dv, kernel = s.gdn
    qkvz = s.emb * (2 * nk * dk + 2 * nv * dv)
    ba = s.emb * 2 * nv
    conv = (2 * nk * dk + nv * dv) * kernel
    return qkvz + ba + conv + nv * dv * s.emb


def params(s: Shapes) -> Params:
    """Parameter counts by shape (norms, biases and other vectors left out: well under 0.1%)."""
    mats = 3 if s.gated_mlp else 2
    moe = s.moe_layers()
    dense = s.layers - moe
    shared = mats * s.emb * s.moe_mlp * s.shared_experts * moe
    return Params(
        embedding=s.vocab * s.emb * (1 if s.tied else 2),
        attention=(s.attention_layers - s.global_layers) * _attention_params(s)
        + s.global_layers * _attention_params(s, global_layer=True)
        + s.gdn_layers * _gdn_params(s),
        dense_mlp=dense * mats * s.emb * s.mlp + shared,
        experts=moe * (s.experts * mats * s.emb * s.moe_mlp + s.emb * s.experts),
    )


def lora_params(s: Shapes, rank: int, targets: Iterable[str]) -> int:
    """LoRA parameters (both factors) of the projections ``targets`` names (Hugging Face or MaxText names)
    wraps: attention on the full-attention layers, the MLP on dense layers and shared experts, and with
    the target ``experts`` a gate, up and down factor pair per routed expert of each MoE layer
    (rljob.trainer.expert_lora)."""
    names = {lora_targets.HF_TO_MAXTEXT.get(t, t) for t in targets}
    q_out = s.q_heads * s.head_dim * (2 if s.gated_attention else 1)
    kv_out = s.kv_heads * s.head_dim
    per_attn = {
        "query": s.emb + q_out,
        "key": s.emb + kv_out,
        "value": s.emb + kv_out,
        "out": s.q_heads * s.head_dim + s.emb,
    }
    moe = s.moe_layers()
    mlp_width = [(s.layers - moe, s.mlp)] + (
        [(moe, s.moe_mlp * s.shared_experts)] if s.shared_experts else []
    )
    total = s.attention_layers * sum(n for k, n in per_attn.items() if k in names)
    for layers, width in mlp_width:
        per_mlp = {"wi_0": s.emb + width, "wi_1": s.emb + width, "wo": width + s.emb}
        total += layers * sum(n for k, n in per_mlp.items() if k in names)
    if lora_targets.EXPERTS in names:
        total += moe * s.experts * 3 * (s.emb + s.moe_mlp)
    return rank * total


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _dtype_bytes(value: Any, default: int) -> int:
    return _DTYPE_BYTES.get(str(value).lower(), default)


@dataclass(frozen=True)
class RoleFit:
    """One role's bytes per device against its capacity (what the plan compares and `rljob plan` shows)."""

    devices: int
    hbm_bytes_per_device: int
    capacity_bytes: int  # what the counted parts may use: HBM less the reserve / x the utilization
    parts: Mapping[str, int]  # bytes per device of each counted part
    fits: bool
    kv_sequences: int | None = None  # sampler: sequences of maxModelLen the KV cache holds at once

    @property
    def used_bytes(self) -> int:
        return sum(self.parts.values())


def _gib(n: int) -> str:
    if n >= 2**60 or n <= -(2**60):  # a nonsense shape (e.g. an overridden model config): no float
        return f"{n // GIB} GiB"
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB / 10 or n == 0 else f"{n / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------------------- trainer


def _shards(ici: MeshPlan, dcn: MeshPlan) -> int:
    """Devices one parameter is split over: every mesh axis but data."""
    out = 1
    for axis in MESH_AXES:
        if axis != "data":
            out *= int(getattr(ici, axis)) * int(getattr(dcn, axis))
    return out


def trainer_fit(
    s: Shapes,
    keys: Mapping[str, Any],
    hbm: int,
    devices: int,
    shards: int,
    tokens_per_device: float,
    rank: int,
    targets: Iterable[str],
    default_weight_dtype: Any = "float32",
) -> RoleFit:
    """The trainer's bytes per device (see the module docstring)."""
    p = params(s)
    wbytes = _dtype_bytes(keys.get("weight_dtype", default_weight_dtype), 4)
    abytes = _dtype_bytes(keys.get("dtype", "bfloat16"), 2)
    lora = lora_params(s, rank, targets) * wbytes
    offloaded = (
        str(keys.get("remat_policy")) == "custom" and str(keys.get("decoder_layer_input")) == "offload"
    )
    parts = {
        "weights": _ceil_div(p.total * wbytes, max(1, shards)),
        "lora": lora,
        "optimizer": 4 * lora,  # AdamW's two moments, the gradient accumulator, one micro-batch gradient
        "layer_inputs": 0
        if offloaded
        else math.ceil(s.layers * Fraction(tokens_per_device) * s.emb * abytes),
    }
    capacity = int(hbm * (1 - TRAINER_RESERVE))
    return RoleFit(devices, hbm, capacity, parts, sum(parts.values()) <= capacity)


def _trainer_keys(plan: TrainerPlan) -> tuple[dict[str, Any], Any]:
    """The trainer's MaxText keys and the weight_dtype it runs without the key (the model config's, else
    MaxText's default)."""
    keyset = maxtext_keys.load(plan.maxtext_version)
    weight_dtype = maxtext_keys.effective({}, keyset, str(plan.maxtext.get("model_name")))("weight_dtype")
    return dict(plan.maxtext), "float32" if weight_dtype is None else weight_dtype


def check_trainer(
    plan: TrainerPlan, model: str, rank: int, targets: Iterable[str], token_budget: int
) -> tuple[RoleFit | None, str | None]:
    """(the trainer's fit, the problem line where it does not fit); (None, None) for an unknown model."""
    s = shapes(model, plan.maxtext, plan.maxtext_version)
    if s is None:
        return None, None
    keys, default_dtype = _trainer_keys(plan)
    hbm = tpu.hbm_bytes_per_device(plan.tpu.accelerator)
    tokens = plan.micro_batch_size * token_budget / plan.devices
    targets = list(targets)
    fit = trainer_fit(
        s, keys, hbm, plan.devices, _shards(plan.ici, plan.dcn), tokens, rank, targets, default_dtype
    )
    if fit.fits:
        return fit, None
    parts = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in fit.parts.items() if v)
    if keys.get("weight_dtype") is None:
        parts += (
            f"; weights in {default_dtype}, MaxText's default weight_dtype: set "
            "spec.trainer.maxtext.weight_dtype"
        )
    what = (
        f"{_gib(fit.used_bytes)} per device ({parts}) against {_gib(fit.capacity_bytes)} usable of a "
        f"device's {_gib(hbm)} HBM ({TRAINER_RESERVE:.0%} held back for XLA's temporaries)"
    )
    custom = keys.get("custom_mesh_and_rule")
    rows = mesh.batch_shards(plan.ici, plan.dcn, str(custom) if custom else None)
    fewer = _max_micro_batch(fit, plan.micro_batch_size, rows)
    if fewer is not None:
        return fit, (
            f"spec.trainer.microBatchSize: {plan.micro_batch_size} rows of {token_budget} tokens over "
            f"{plan.devices} devices do not fit the trainer of {model}: {what}; at most {fewer} rows fit "
            f"(a multiple of {' x '.join(mesh.batch_axes(str(custom) if custom else None))} = {rows})"
        )
    msg = f"spec.trainer.tpu: {plan.tpu.type_name} x {plan.slices} slice(s) cannot hold the trainer of "
    msg += f"{model}: {what}"
    if plan.ici.data * plan.dcn.data > 1:
        msg += f"; spec.trainer.mesh.data {plan.ici.data * plan.dcn.data} replicates the weights (use fsdp)"
    return fit, msg + "; " + _trainer_hint(s, keys, plan, rank, targets, token_budget, default_dtype)


def _max_micro_batch(fit: RoleFit, micro: int, rows: int) -> int | None:
    """The most rows per micro-batch (a multiple of ``rows``, below ``micro``) whose layer inputs fit beside
    everything else; None when the weights and LoRA state alone do not fit, or not even ``rows`` do."""
    fixed = fit.used_bytes - fit.parts["layer_inputs"]
    per_row = _ceil_div(fit.parts["layer_inputs"], max(1, micro))
    if micro <= rows or fixed > fit.capacity_bytes or per_row <= 0:
        return None
    most = (fit.capacity_bytes - fixed) // per_row // rows * rows
    return most if rows <= most < micro else None


def _trainer_hint(
    s: Shapes,
    keys: Mapping[str, Any],
    plan: TrainerPlan,
    rank: int,
    targets: list[str],
    token_budget: int,
    default_dtype: Any,
) -> str:
    """The smallest slice of the same generation that holds the trainer with every device on fsdp, one row
    of tokenBudget per device, at the same number of slices."""
    gen = tpu.BY_ACCELERATOR[plan.tpu.accelerator]
    hbm = tpu.hbm_bytes_per_device(plan.tpu.accelerator)
    for name, per_slice in _slice_sizes(gen.prefix):
        devices = per_slice * plan.slices
        fit = trainer_fit(s, keys, hbm, devices, devices, token_budget, rank, targets, default_dtype)
        if fit.fits:
            return f"the smallest {gen.prefix} slice that holds it with every device on fsdp is {name}"
    return f"no {gen.prefix} slice holds it: lower spec.lora.rank or spec.packing.tokenBudget, or add slices"


# ------------------------------------------------------------------------------------------- sampler


def kv_bytes_per_token(s: Shapes, tp: int) -> int:
    """KV cache bytes per token on one device at tensor parallelism ``tp``: the full-attention layers' K and
    V of the KV heads a device holds (at least one: vLLM replicates KV heads when tp exceeds them), or
    MLA's latent (replicated over tp)."""
    if s.mla:
        return s.attention_layers * (s.kv_lora_rank + s.qk_rope) * KV_BYTES
    heads = max(1, _ceil_div(s.kv_heads, max(1, tp)))
    return s.attention_layers * 2 * heads * s.head_dim * KV_BYTES


def state_bytes_per_sequence(s: Shapes, tp: int) -> int:
    """Gated delta net state per sequence on one device: the recurrent state [value heads, key dim, value
    dim] and the convolution's last kernel-1 inputs, split over tp by heads."""
    nk, dk, nv, dv, kernel = s.gdn
    if not s.gdn_layers:
        return 0
    per_layer = nv * dk * dv + (2 * nk * dk + nv * dv) * (kernel - 1)
    return _ceil_div(s.gdn_layers * per_layer * KV_BYTES, max(1, tp))


def unquantized_params(s: Shapes) -> tuple[int, int]:
    """Parameters a quantized checkpoint keeps in bf16 (rljob.recipes.quantization), as (attention side:
    the embedding and output head, the gated delta net layers' in_proj_ba and convolution; MLP side: the
    routers), the two sides of params(s) that sampler_fit splits differently."""
    p = params(s)
    nk, dk, nv, dv, kernel = s.gdn
    small_gdn = s.gdn_layers * (s.emb * 2 * nv + (2 * nk * dk + nv * dv) * kernel) if s.gdn_layers else 0
    routers = s.moe_layers() * s.emb * s.experts if s.experts > 1 else 0
    return p.embedding + small_gdn, routers


def sampler_weight_bytes(s: Shapes, q: quantization.Quantization) -> tuple[int, int]:
    """The served weights' bytes as (attention and embeddings, MLPs and experts): every parameter at
    ``q``'s bytes with its scales, but those unquantized_params keeps in bf16."""
    p = params(s)
    sides = (p.embedding + p.attention, p.dense_mlp + p.experts)
    if q.vllm_method is None:
        return sides[0] * SAMPLER_WEIGHT_BYTES, sides[1] * SAMPLER_WEIGHT_BYTES
    out = []
    for total, kept in zip(sides, unquantized_params(s), strict=True):
        quantized = total - kept
        out.append(
            kept * SAMPLER_WEIGHT_BYTES + quantized * q.weight_bytes + math.ceil(quantized * q.scale_bytes)
        )
    return out[0], out[1]


def sampler_fit(
    s: Shapes,
    hbm: int,
    tp: int,
    ep: int,
    max_model_len: int,
    max_num_seqs: int,
    max_loras: int,
    lora_rank: int,
    quant: quantization.Quantization | None = None,
) -> RoleFit:
    """One sampler replica's bytes per device at tensor parallelism tp x expert parallelism ep, serving
    weights stored as ``quant`` (None: bf16)."""
    # tpu-inference's mesh (data, attn_dp, expert, model): attention heads on model only, MLPs and experts
    # on model x expert (tpu_inference/layers/common/sharding.py ShardingAxisName: ATTN_HEAD 'model',
    # MLP_TENSOR ('attn_dp', 'model', 'expert')); the embedding is counted over model only.
    attention, mlp = sampler_weight_bytes(s, quant or quantization.get(None))
    weights = _ceil_div(attention, tp) + _ceil_div(mlp, tp * ep)
    every = (*lora_targets.ATTENTION, *lora_targets.MLP)
    lora = max_loras * lora_params(s, lora_rank, every) * SAMPLER_WEIGHT_BYTES
    capacity = int(hbm * VLLM_MEMORY_UTILIZATION)
    free = capacity - weights - lora
    per_seq = kv_bytes_per_token(s, tp) * max_model_len + state_bytes_per_sequence(s, tp)
    sequences = max(0, free) // per_seq if per_seq else max_num_seqs
    kv = min(sequences, max_num_seqs) * per_seq
    parts = {"weights": weights, "lora_slots": lora, "kv_cache": kv}
    return RoleFit(tp * ep, hbm, capacity, parts, sequences >= 1, kv_sequences=int(sequences))


def _layouts(s: Shapes, devices: int) -> list[tuple[int, int]]:
    """(tp, ep) layouts of ``devices`` that the plan's sampler layout rules accept, largest tp first."""
    divisors = {d for k in range(1, math.isqrt(devices) + 1) if devices % k == 0 for d in (k, devices // k)}
    return [
        (tp, devices // tp)
        for tp in sorted(divisors, reverse=True)
        if s.kv_heads % tp == 0
        and (devices // tp == 1 or (s.experts > 1 and s.experts % (devices // tp) == 0))
    ]


@cache
def _slice_sizes(prefix: str) -> tuple[tuple[str, int], ...]:
    """(type name, devices) of each slice size of a generation, smallest first."""
    names = dict.fromkeys(tpu.type_names(prefix))
    return tuple((name, tpu.plan(name).devices) for name in names)


def check_sampler(
    plan: SamplerPlan, model: str, keys: Mapping[str, Any], version: str
) -> tuple[RoleFit | None, str | None]:
    """(one replica's fit, the problem line where it does not fit); (None, None) for an unknown model.
    A layout the plan refuses (tp x ep x dp is not the replica's devices) is counted at its best case,
    every device holding an even share of every weight."""
    s = shapes(model, keys, version)
    if s is None:
        return None, None
    hbm = tpu.hbm_bytes_per_device(plan.tpu.accelerator)
    tp, ep = plan.tensor_parallel, plan.expert_parallel
    layout = f"tensorParallel {tp} x expertParallel {ep}"
    if tp * ep * plan.data_parallel != plan.tpu.devices or plan.data_parallel != 1:
        tp, ep = plan.tpu.devices, 1  # the best case: every weight split over every device
        layout = f"even with every weight split over its {tp} devices"
    quant = quantization.get(plan.quantization)

    def fit_at(tp: int, ep: int, q: quantization.Quantization = quant) -> RoleFit:
        return sampler_fit(
            s, hbm, tp, ep, plan.max_model_len, plan.max_num_seqs, plan.max_loras, plan.lora_max_rank, q
        )

    fit = fit_at(tp, ep)
    if fit.fits:
        return fit, None
    need = kv_bytes_per_token(s, tp) * plan.max_model_len + state_bytes_per_sequence(s, tp)
    msg = (
        f"spec.sampler.tpu: a {plan.tpu.type_name} replica ({layout}) "
        "cannot "
        f"serve {model}: {_gib(fit.parts['weights'])} of {quant.name} weights and "
        f"{_gib(fit.parts['lora_slots'])} of LoRA slots per device leave no room for the KV cache of one "
        f"maxModelLen {plan.max_model_len} sequence ({_gib(need)}) within vLLM's "
        f"{VLLM_MEMORY_UTILIZATION:.0%} of a device's {_gib(hbm)} HBM; "
    )
    gen = tpu.BY_ACCELERATOR[plan.tpu.accelerator]
    smaller = [
        q
        for q in quantization.QUANTIZATIONS.values()
        if q.weight_bytes < quant.weight_bytes and quantization.served_on(q, gen) and fit_at(tp, ep, q).fits
    ]
    if smaller:
        msg += (
            f"at spec.sampler.weights.quantization {smaller[0].name} (the model's {smaller[0].name} "
            f"checkpoint) this replica serves it ({fit_at(tp, ep, smaller[0]).kv_sequences} sequences of "
            "maxModelLen at once); "
        )
    return fit, msg + _sampler_hint(s, plan, hbm, quant)


def _sampler_hint(s: Shapes, plan: SamplerPlan, hbm: int, quant: quantization.Quantization) -> str:
    gen = tpu.BY_ACCELERATOR[plan.tpu.accelerator]
    for name, devices in _slice_sizes(gen.prefix):
        for tp, ep in _layouts(s, devices):
            f = sampler_fit(
                s,
                hbm,
                tp,
                ep,
                plan.max_model_len,
                plan.max_num_seqs,
                plan.max_loras,
                plan.lora_max_rank,
                quant,
            )
            if f.fits:
                return (
                    f"the smallest {gen.prefix} replica that serves it is {name} as tensorParallel {tp} x "
                    f"expertParallel {ep} ({f.kv_sequences} sequences of maxModelLen at once)"
                )
    return (
        f"no {gen.prefix} replica layout serves it (tensorParallel divides the {s.kv_heads} KV heads): "
        "lower spec.sampler.maxModelLen or spec.sampler.maxLoras"
    )


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Fit:
    """The fit of both roles; ``problems``: one `spec.<field>: message` line per role that does not fit."""

    trainer: RoleFit | None
    sampler: RoleFit | None
    problems: list[str]


def check(
    model: str,
    trainer: TrainerPlan | None,
    sampler: SamplerPlan | None,
    lora_rank: int,
    lora_targets_: Iterable[str],
    token_budget: int,
    keys: Mapping[str, Any] | None = None,
    version: str = maxtext_keys.DEFAULT_VERSION,
) -> Fit:
    """Both roles' fit. ``keys``/``version``: the MaxText keys (the trainer plan's when there is one)."""
    problems: list[str] = []
    t = s = None
    if trainer is not None:
        t, msg = check_trainer(trainer, model, lora_rank, lora_targets_, token_budget)
        problems += [msg] if msg else []
        keys, version = trainer.maxtext, trainer.maxtext_version
    if sampler is not None:
        s, msg = check_sampler(sampler, model, keys or {}, version)
        problems += [msg] if msg else []
    return Fit(t, s, problems)


def plan_problems(spec: RLJobSpec, trainer: TrainerPlan | None, sampler: SamplerPlan | None) -> list[str]:
    """The fit problems of a working spec's role plans (rljob.recipes.plan.resolve calls this once)."""
    if spec.model is None or spec.lora is None or spec.packing is None:
        return []
    targets = spec.lora.targets or []
    budget = spec.packing.token_budget or 0
    model = str(spec.model.maxtext_model)
    return check(model, trainer, sampler, spec.lora.rank or 1, targets, budget).problems


def of_run(run: RunConfig) -> Fit:
    """The fit of a resolved run (what `rljob plan` shows)."""
    spec = run.spec
    return check(
        spec.model.maxtext_model,
        run.trainer,
        run.sampler,
        spec.lora.rank,
        spec.lora.targets,
        spec.packing.token_budget,
    )


def summary(fit: Fit, sampler: SamplerPlan | None = None) -> list[str]:
    """Lines for `rljob plan`: each role's bytes per device against its capacity."""
    out = []
    for role, f in (("trainer", fit.trainer), ("sampler", fit.sampler)):
        if f is None:
            continue
        parts = ", ".join(f"{k.replace('_', ' ')} {_gib(v)}" for k, v in f.parts.items())
        line = f"{role} fit: {_gib(f.used_bytes)} of {_gib(f.capacity_bytes)} per device ({parts})"
        if f.kv_sequences is not None and sampler is not None:
            line += (
                f"; the KV cache holds {f.kv_sequences} sequences of maxModelLen {sampler.max_model_len} "
                f"at once (maxNumSeqs {sampler.max_num_seqs})"
            )
        out.append(line)
    return out


__all__ = [
    "TRAINER_RESERVE",
    "VLLM_MEMORY_UTILIZATION",
    "Fit",
    "Params",
    "RoleFit",
    "Shapes",
    "check",
    "kv_bytes_per_token",
    "lora_params",
    "of_run",
    "params",
    "plan_problems",
    "sampler_fit",
    "sampler_weight_bytes",
    "shapes",
    "summary",
    "trainer_fit",
    "unquantized_params",
]
