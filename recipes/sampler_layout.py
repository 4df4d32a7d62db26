"""How one sampler replica is laid out: the rules vLLM's TPU backend applies, and the layout the plan fills.

One replica is one ``vllm serve`` (rljob.sampler.vllm builds it): ``--tensor-parallel-size`` is
tensorParallel x expertParallel (vLLM's world size); with expertParallel > 1 it adds
``--enable-expert-parallel``, tpu-inference's ``sharding_strategy`` {tensor_parallelism, expert_parallelism}
and ``NEW_MODEL_DESIGN=1`` (tpu-inference's mesh with an ``expert`` axis beside ``model``). The rules below
are those of the pinned engine, vllm-tpu 0.32.0 and its tpu-inference 0.32.0 (pyproject's ``sampler-tpu``
extra), each citing the file and function that applies it: tpu_inference/... paths are those of the
tpu-inference 0.32.0 package (https://pypi.org/project/tpu-inference/0.32.0/, from
https://github.com/vllm-project/tpu-inference), vllm/... paths those of vllm-tpu 0.32.0
(https://pypi.org/project/vllm-tpu/0.32.0/):

1. devices: tensorParallel x expertParallel x dataParallel is the replica's devices
   (tpu_inference/layers/common/sharding.py, ``ShardingConfigManager.__init__``: the product of the strategy).
2. LoRA: no data parallelism of any kind (``ShardingConfigManager.validate``: "LoRA is not supported with
   data parallelism"); rljob serves every policy version as a LoRA adapter.
3. query heads: the model's attention heads divide by ``--tensor-parallel-size``
   (vllm/config/model.py, ``ModelConfig.verify_with_parallel_config``).
4. KV heads, split over every attention-head device (the ``ATTN_HEAD`` mesh axes: ``model`` on the 2D mesh,
   ``model`` x ``expert`` under NEW_MODEL_DESIGN; so tensorParallel x expertParallel = ``h``):
   fewer KV heads than ``h`` are replicated, ``h`` / heads copies of each, which needs ``h`` to be a multiple
   of them (tpu_inference/layers/vllm/custom_ops/linear.py, ``VllmQKVParallelLinear.__init__``: "tp_size must
   be divisible by total_num_kv_heads for KV-head replication"); the copies go on one mesh axis, the first of
   ``model``, ``expert`` at least that large (``VllmQKVParallelLinear.forward``: "Cannot find a mesh axis to
   split for KV-head replication"); at least ``h`` KV heads must divide by ``h``
   (tpu_inference/utils.py ``get_padded_num_heads``, called by ``KVCacheManager.get_kv_cache_spec``). Every
   attention layer kind counts (Gemma 4's global layers have fewer KV heads: ``get_layer_kv_params``).
5. experts with expertParallel > 1: ``--enable-expert-parallel`` for a model without experts is refused
   (vllm/config/model.py ``ModelConfig._verify_with_expert_parallelism``); the experts split over every
   device of the replica, the ``EXPERT`` axes (``model`` and ``expert`` among them), so they divide by
   tensorParallel x expertParallel (tpu_inference/layers/common/process_weights/moe_weights.py
   ``shard_moe_weights``; tpu_inference/layers/common/fused_moe_gmm.py: ``num_experts // ep_size``).
6. experts at expertParallel 1 (tpu-inference's GMM_TP backend): each expert's MLP splits over the
   tensor parallelism, which must divide it (moe_weights.py ``process_moe_weights``: ``assert
   intermediate_size % w13_reorder_size == 0``), and each device's share is padded up to 128 columns
   (``get_w13_padding_config``, align=128).
7. gated delta net layers (Qwen3-Next, Qwen3.5): their key and value heads split over the ``ATTN_HEAD``
   devices (tpu_inference/layers/common/gdn_attention.py ``run_jax_gdn_attention``: ``n_kq // tp_size``,
   ``n_v // tp_size`` in a shard_map over ``ATTN_HEAD``), so both divide by tensorParallel x
   expertParallel: fewer key heads than devices leave a device 0 of them, and the GDN kernel divides by
   that (tpu_inference/kernels/gdn/v3/config.py, ``GDNConfig.v_per_kq_head``).

``resolve`` fills what the manifest left unset: the default (every device as tensor parallelism) where it
runs, else a layout the rules accept, recorded with the reason (``Layout.derived``); a value the manifest
set is never changed, and refused with a layout that would work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rljob.recipes import maxtext_keys, models, tpu

# tpu-inference's GMM_TP pads each device's share of an expert's MLP up to this many columns
# (process_weights/moe_weights.py get_w13_padding_config, align=128).
# vLLM's allowed --max-lora-rank values (vllm/config/lora.py MaxLoRARanks at the pinned version): the plan
# refuses another spec.lora.rank, the sampler passes the list on.
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MOE_TP_ALIGN = 128
# The plan lays an MoE model out with expert parallelism instead of its tensor-parallel default when that
# padding would multiply each device's expert weights by at least this much.
MAX_EXPERT_PADDING = 2.0

_TENSOR = "spec.sampler.tensorParallel"
_EXPERT = "spec.sampler.expertParallel"
_DATA = "spec.sampler.dataParallel"


@dataclass(frozen=True)
class LayoutFacts:
    """What the engine checks a layout against, from MaxText's model config (rljob.recipes.models and the
    MaxText key table)."""

    query_heads: int | None
    kv_heads: tuple[int, ...]  # each attention layer kind's KV heads
    experts: int = 0  # 0: dense
    expert_mlp: int | None = None  # each expert's MLP width (base_moe_mlp_dim)
    gdn_heads: tuple[int, ...] = ()  # gated delta net key and value heads; () without such layers


def facts(maxtext_model: str | None, version: str = maxtext_keys.DEFAULT_VERSION) -> LayoutFacts | None:
    """The layout facts of a MaxText model in the key table of MaxText ``version`` (the manifest's
    spec.trainer.maxtextVersion); None where that MaxText does not know it (the plan refuses it)."""
    base = models.facts(maxtext_model, version)
    if base is None:
        return None
    cfg = maxtext_keys.load(version).models.get(str(maxtext_model)) or {}

    def num(key: str) -> int | None:
        v = maxtext_keys.number(cfg.get(key))
        return int(v) if v and v > 0 else None

    kv = [base.num_kv_heads]
    if num("global_num_kv_heads"):
        kv.append(int(num("global_num_kv_heads") or 0))
    gdn: tuple[int, ...] = ()
    if models.recurrent(str(cfg.get("decoder_block", ""))):
        gdn = tuple(n for n in (num("gdn_num_key_heads"), num("gdn_num_value_heads")) if n)
    return LayoutFacts(
        query_heads=num("base_num_query_heads"),
        kv_heads=tuple(dict.fromkeys(kv)),
        experts=base.num_experts,
        expert_mlp=num("base_moe_mlp_dim") if base.num_experts else None,
        gdn_heads=gdn,
    )


def problems(f: LayoutFacts, model: str, tp: int, ep: int, dp: int, devices: int, tpu_name: str) -> list[str]:
    """Every rule of the module docstring that the layout breaks, as ``spec.sampler.<field>: why``."""
    out = []
    if tp * ep * dp != devices:
        out.append(
            f"{_TENSOR}: {tp} x dataParallel {dp} x expertParallel {ep} = {tp * ep * dp} is not the "
            f"{devices} devices of a {tpu_name} sampler replica"
        )
    if dp > 1:
        out.append(
            f"{_DATA}: {dp}; vLLM's TPU backend serves LoRA adapters only without data parallelism "
            "(use tensorParallel / expertParallel, or more replicas)"
        )
    out += model_problems(f, model, tp, ep)
    return out


def model_problems(f: LayoutFacts, model: str, tp: int, ep: int) -> list[str]:
    """The rules that read the model (3 to 7 of the module docstring) for tensorParallel ``tp`` x
    expertParallel ``ep``."""
    out = []
    h = tp * ep  # vLLM's --tensor-parallel-size, and the devices of tpu-inference's ATTN_HEAD axes
    # the line names spec.sampler.tensorParallel; with expert parallelism the size is their product
    size = f"{h}" if ep == 1 else f"{tp} x expertParallel {ep} = {h}"
    if f.query_heads and f.query_heads % h:
        out.append(
            f"{_TENSOR}: {size} does not divide the {f.query_heads} attention heads of {model} (vLLM refuses "
            "a tensor-parallel size that does not divide them)"
        )
    for kv in f.kv_heads:
        if kv >= h and kv % h:
            out.append(f"{_TENSOR}: {size} does not divide the {kv} KV heads of {model}")
        elif kv < h and h % kv:
            out.append(
                f"{_TENSOR}: {size} is not a multiple of the {kv} KV heads of {model} (vLLM's TPU backend "
                "replicates KV heads only a whole number of times)"
            )
        elif kv < h:
            copies = h // kv
            axis = next((width for width in (tp, ep) if width >= copies), None)
            if axis is None or axis % copies:
                out.append(
                    f"{_TENSOR}: {tp} x expertParallel {ep} cannot hold the {copies} copies of each of the "
                    f"{kv} KV heads of {model} on one of the two axes (vLLM's TPU backend puts them on "
                    "the tensor or the expert axis; make one of them a multiple of "
                    f"{copies})"
                )
    if ep > 1 and not f.experts:
        out.append(f"{_EXPERT}: {ep}, but {model} has no experts")
    elif ep > 1 and f.experts % h:
        out.append(
            f"{_TENSOR}: {size} does not divide the {f.experts} experts of {model} (with expertParallel > 1 "
            "vLLM's TPU backend splits the experts over every device of the replica)"
        )
    elif ep == 1 and f.experts and f.expert_mlp and f.expert_mlp % tp:
        out.append(
            f"{_TENSOR}: {tp} does not divide the {f.expert_mlp}-wide expert MLP of {model} (at "
            "expertParallel 1 vLLM's TPU backend splits each expert over the tensor parallelism)"
        )
    for heads in f.gdn_heads:
        if heads % h:
            out.append(
                f"{_TENSOR}: {size} does not divide the {min(f.gdn_heads)} key and {max(f.gdn_heads)} value "
                f"heads of {model}'s gated delta net layers (vLLM's TPU backend splits them over every "
                "attention device)"
            )
            break
    return out


def expert_padding(f: LayoutFacts, tp: int) -> float:
    """How many times each device's expert weights grow at expertParallel 1 and tensorParallel ``tp``
    (rule 6: a share of the expert MLP padded up to MOE_TP_ALIGN columns); 1.0 without experts."""
    if not f.experts or not f.expert_mlp or f.expert_mlp % tp:
        return 1.0
    share = f.expert_mlp // tp
    return (-(-share // MOE_TP_ALIGN) * MOE_TP_ALIGN) / share


def layouts(f: LayoutFacts, model: str, devices: int) -> list[tuple[int, int]]:
    """Every (tensorParallel, expertParallel) of ``devices`` devices the rules accept, in the order the
    plan prefers: for a dense model the most tensor parallelism; for an MoE model the default (all tensor
    parallel) unless its experts' padding reaches MAX_EXPERT_PADDING, then the most expert parallelism."""
    ok = [
        (tp, devices // tp)
        for tp in range(devices, 0, -1)
        if devices % tp == 0 and not model_problems(f, model, tp, devices // tp)
    ]
    if not f.experts:
        return ok
    all_tp = [(devices, 1)] if (devices, 1) in ok else []
    by_experts = sorted((t for t in ok if t[1] > 1), key=lambda t: -t[1])
    if all_tp and expert_padding(f, devices) < MAX_EXPERT_PADDING:
        return all_tp + by_experts
    return by_experts + all_tp


@dataclass
class Layout:
    """A replica's resolved layout, the reasons for what the plan filled, and the problems of it."""

    tp: int
    ep: int
    dp: int
    derived: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def resolve(
    model: str | None,
    devices: int,
    tpu_name: str,
    prefix: str,
    tp_set: int | None,
    ep_set: int | None,
    dp: int,
    version: str = maxtext_keys.DEFAULT_VERSION,
) -> Layout:
    """The layout of one replica: ``tp_set`` / ``ep_set`` as the spec layers set them (None: unset),
    ``dp`` the resolved dataParallel. Unset values take their defaults (tensorParallel: the devices /
    (dataParallel x expertParallel); expertParallel 1) unless the rules refuse the default or it pads an
    MoE model's experts to MAX_EXPERT_PADDING and another layout runs: then that layout, with the reason.
    ``prefix`` names the TPU generation for the hint of a slice too large for the model."""
    f = facts(model, version)
    ep = ep_set or 1
    tp = tp_set or max(1, devices // (ep * dp))
    out = Layout(tp, ep, dp)
    if f is None:  # a model MaxText does not know: refused by the plan; the devices are still checked
        out.problems = problems(LayoutFacts(None, ()), str(model), tp, ep, dp, devices, tpu_name)
        return out
    name = str(model)
    found = problems(f, name, tp, ep, dp, devices, tpu_name)
    wasteful = tp_set is None and ep_set is None and ep == 1 and expert_padding(f, tp) >= MAX_EXPERT_PADDING
    if (found or wasteful) and dp == 1 and (tp_set is None or ep_set is None):
        fits = [(t, e) for t, e in layouts(f, name, devices) if tp_set in (None, t) and ep_set in (None, e)]
        if fits and (fits[0] != (tp, ep)):
            out.tp, out.ep = fits[0]
            why = _why(f, name, tp, ep, devices, tpu_name, found)
            if tp_set is None and out.tp != tp:
                out.derived[_TENSOR] = why
            if ep_set is None and out.ep != ep:
                out.derived[_EXPERT] = why
            return out
    if found:
        found.append(hint(f, name, devices, tpu_name, prefix))
    out.problems = found
    return out


def _why(f: LayoutFacts, model: str, tp: int, ep: int, devices: int, tpu_name: str, found: list[str]) -> str:
    """Why the default layout of a replica does not run (the reason shown with a derived layout)."""
    if found:
        return f"the default would not run on a {tpu_name} replica: {found[0]}"
    share = (f.expert_mlp or 0) // tp
    return (
        f"tensorParallel {tp} at expertParallel 1 would split each {f.expert_mlp}-wide expert MLP of {model} "
        f"into {share} columns a device, which vLLM's TPU backend pads to {MOE_TP_ALIGN}: "
        f"{expert_padding(f, tp):g}x the expert weights; expert parallelism keeps each expert whole"
    )


def hint(f: LayoutFacts, model: str, devices: int, tpu_name: str, prefix: str) -> str:
    """What to set when a layout is refused: a layout of the replica's devices the rules accept, or, where
    none exists, the largest replica of the generation the model can use."""
    ok = layouts(f, model, devices)
    if ok:
        tp, ep = ok[0]
        return (
            f"{_TENSOR}: a {tpu_name} replica of {model} can be laid out as tensorParallel {tp} x "
            f"expertParallel {ep}" + (" (set both)" if ep > 1 else "")
        )
    smaller = []
    for name in tpu.type_names(prefix):
        d = tpu.plan(name).devices
        if d >= devices:
            break
        if layouts(f, model, d):
            smaller.append((d, name))
    limits = [f"{f.query_heads} attention heads"] if f.query_heads else []
    limits += [f"{kv} KV heads" for kv in f.kv_heads]
    if f.gdn_heads:
        limits.append(f"{min(f.gdn_heads)} gated delta net key heads")
    use = (
        f"use a sampler slice of at most {max(smaller)[0]} devices per replica ({max(smaller)[1]}), and more "
        "replicas"
        if smaller
        else "no replica of this generation serves it with LoRA"
    )
    return (
        f"spec.sampler.tpu: no layout of the {devices} devices of a {tpu_name} replica serves {model} "
        f"(vLLM's TPU backend splits its {', '.join(limits)} over tensorParallel x expertParallel, and "
        f"LoRA takes no dataParallel): {use}"
    )


__all__ = [
    "MAX_EXPERT_PADDING",
    "MOE_TP_ALIGN",
    "Layout",
    "LayoutFacts",
    "expert_padding",
    "facts",
    "hint",
    "layouts",
    "model_problems",
    "problems",
    "resolve",
]
