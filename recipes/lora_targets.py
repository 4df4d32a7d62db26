"""LoRA targets: which projections of which MaxText decoder block the trainer can wrap and export.

One check, over the rows of rljob.recipes.families (each block's targets, expert LoRA, refusal), for the
plan (``rljob validate`` and the admission webhook refuse a manifest with these problems) and the trainer
(``rljob.trainer.model.ModelSpec`` / ``Policy`` refuse the same at start, with the same field).
``spec.lora.targets`` names Hugging Face projections (``q_proj``...) or the MaxText modules they map to
(``query``...).

A target counts only where the decoder has a module of that name that qwix can wrap (or, for ``experts``,
routed experts the trainer wraps itself) and whose adapter the trainer exports to PEFT under the Hugging
Face model's names:

- qwen3 (Qwen3ForCausalLM), gemma4 (Gemma4ForConditionalGeneration), llama2 (LlamaForCausalLM: MaxText's
  block for Llama 2 and Llama 3.x), gemma3 (Gemma3ForConditionalGeneration's text tower: its local
  and global layers alike): attention and the dense MLP;
- qwen3_5 (Qwen3_5MoeForConditionalGeneration): attention (the full-attention layers; the gated delta
  net layers have no q/k/v/o projection) and the shared expert's MLP (``mlp.shared_expert.*_proj``);
  the routed experts are stacked parameters (MaxText ``routed_experts/wi_0``, Hugging Face
  ``mlp.experts.gate_up_proj``), not modules;
- gpt_oss (GptOssForCausalLM): attention only; its MLP is all experts, stacked parameters on both
  sides (MaxText ``GptOssMlp/wi_0``, Hugging Face ``mlp.experts.gate_up_proj``);
- qwen3_moe (Qwen3MoeForCausalLM): attention, and with the target ``experts`` the routed experts (its
  whole MLP, no shared expert): stacked parameters in MaxText (``moe_block/wi_0``), per expert in the
  checkpoint (``mlp.experts.{j}.gate_proj``; transformers 5.x fuses them into ``mlp.experts.gate_up_proj``
  as it loads);
- mixtral (MixtralForCausalLM): attention, and with the target ``experts`` the routed experts (its whole
  MLP, 8, top-2): stacked parameters in MaxText (``MoeBlock_0/wi_0``) converted from Hugging Face's
  per-expert ``block_sparse_moe.experts.{j}.w1`` (transformers 5.x: ``mlp.experts.gate_up_proj``);
- deepseek (DeepseekV3ForCausalLM, DeepseekV2ForCausalLM): multi-head latent attention (MLA) and the MLP
  of the first dense layers and of the MoE layers' shared experts (``mlp.shared_experts.*_proj``); MLA's
  projections are MaxText ``wq_a``, ``wq_b`` (``query`` where ``q_lora_rank`` is 0: DeepSeek-V2),
  ``wkv_a``, ``wkv_b``, ``out`` = Hugging Face ``q_a_proj``, ``q_b_proj`` (``q_proj``),
  ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj`` (:func:`mla_problems` checks which query
  projection the model has); the routed experts are stacked parameters (``MoeBlock_0/wi_0``). The plan
  refuses ``kv_b_proj`` (``SAMPLER_REFUSED``: vLLM's MLA never applies an adapter on it).

LoRA on the routed experts (an adapter per expert, the target ``experts``: gate, up and down projection of
every expert; ``EXPERT_SUPPORTED``) is trained and exported for qwen3_moe and mixtral
(rljob.trainer.expert_lora: per-expert factors merged into MaxText's stacked expert weights, exported as
``mlp.experts.{j}.gate_proj`` ..., Mixtral's ``block_sparse_moe.experts.{j}.w1`` ..., per layer and expert);
not yet gpt_oss (its checkpoint keeps the experts stacked, gate and up interleaved in ``gate_up_proj``: no
per-expert module to name) nor qwen3_5 (its ``routed_experts`` export is not written). vLLM's TPU backend
does not serve it (``SERVING_REFUSED``): ``rljob validate`` and the admission webhook refuse the target with
that reason (:func:`sampler_problems`), while the trainer accepts it (tests/trainer/test_expert_lora.py).
A decoder block outside this table is refused with the reason in ``REFUSED`` where it is known.

Sources: MaxText 0.2.5 models/{qwen3,qwen3_5,gpt_oss,gemma4,llama2,gemma3,mixtral,deepseek}.py,
layers/attention_mla.py; transformers 5.x
models/<family>/modeling_<family>.py (https://github.com/huggingface/transformers/tree/main/src/transformers/models).
tests/trainer/test_families.py builds each family's miniature and checks this table against the LoRA
parameters qwix actually creates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rljob.recipes import families

__all__ = [
    "ATTENTION",
    "EXPERTS",
    "EXPERT_SUPPORTED",
    "HF_TO_MAXTEXT",
    "MLA",
    "MLP",
    "REFUSED",
    "SAMPLER_REFUSED",
    "SERVING_REFUSED",
    "SUPPORTED",
    "mla_problems",
    "problems",
    "sampler_problems",
]

# Hugging Face projection -> MaxText module.
HF_TO_MAXTEXT: dict[str, str] = {
    "q_proj": "query",
    "k_proj": "key",
    "v_proj": "value",
    "o_proj": "out",
    "gate_proj": "wi_0",
    "up_proj": "wi_1",
    "down_proj": "wo",
    # DeepSeek's multi-head latent attention (MaxText layers/attention_mla.py MLA._init_projections)
    "q_a_proj": "wq_a",
    "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a",
    "kv_b_proj": "wkv_b",
}
ATTENTION, MLP, MLA, MLA_QUERY_LORA = families.ATTENTION, families.MLP, families.MLA, families.MLA_QUERY_LORA

# decoder_block -> the Hugging Face projections the trainer wraps and exports (rljob.recipes.families).
SUPPORTED: dict[str, tuple[str, ...]] = {
    b: f.lora_targets for b, f in families.FAMILIES.items() if not f.refused
}

# The target naming the routed experts (gate, up and down projection of each, an adapter per expert), and
# the decoder blocks whose experts the trainer wraps and exports (rljob.trainer.expert_lora).
EXPERTS = "experts"
EXPERT_SUPPORTED = frozenset(b for b, f in families.FAMILIES.items() if f.experts and not f.refused)
# Why the sampler cannot serve an expert adapter: vllm-tpu's LoRA runs on tpu-inference's vLLM (torch)
# model path (the sampler sets MODEL_IMPL_TYPE=vllm), whose punica wrapper has no fused-MoE LoRA op; its
# JAX model path loads no LoRA at all (read in the tpu-inference 0.32.0 wheel the sampler image installs).
SERVING_REFUSED = (
    "vLLM's TPU backend (vllm-tpu 0.32.0 with tpu-inference 0.32.0) does not serve LoRA on MoE experts: its "
    "PunicaWrapperTPU has LoRA ops for linear, embedding and logits layers but no add_lora_fused_moe, "
    "which vLLM's FusedMoEWithLoRA calls "
    "(https://github.com/vllm-project/tpu-inference/blob/main/tpu_inference/lora/torch_punica_tpu.py), "
    "and its JAX model path loads no LoRA (tpu_inference/models/common/model_loader.py)"
)

# decoder_block -> why the trainer does not export its LoRA adapters yet (rljob.recipes.families).
REFUSED: dict[str, str] = {b: f.refused for b, f in families.FAMILIES.items() if f.refused}

_MT_TO_HF = {mt: hf for hf, mt in HF_TO_MAXTEXT.items()}

# (decoder_block, Hugging Face projection) -> why the sampler would not apply an adapter on it though the
# trainer trains and exports it: the plan refuses these (the trainer alone, e.g. its tests, does not).
SAMPLER_REFUSED: dict[tuple[str, str], str] = {
    (b, t): why for b, f in families.FAMILIES.items() for t, why in f.sampler_refused.items()
}


def problems(block: str | None, targets: Iterable[str]) -> list[tuple[str, str]]:
    """(field, message) for each reason the trainer would refuse these LoRA targets on a model with
    decoder block ``block`` (None: the block is not known, only the names are checked)."""
    targets = list(targets)
    out: list[tuple[str, str]] = []
    unknown = [t for t in targets if t not in HF_TO_MAXTEXT and t not in _MT_TO_HF and t != EXPERTS]
    if unknown:
        out.append(
            (
                "spec.lora.targets",
                f"unknown module(s) {unknown}; known: {sorted(HF_TO_MAXTEXT)} or {sorted(_MT_TO_HF)}, "
                f"or {EXPERTS!r} (the routed experts)",
            )
        )
    if block is None:
        return out
    if block not in SUPPORTED:
        why = f"{REFUSED[block]}; " if block in REFUSED else ""
        out.append(
            (
                "spec.model.maxtextModel",
                f"decoder block {block!r}: {why}the trainer exports LoRA adapters of the decoder blocks "
                f"{', '.join(sorted(SUPPORTED))} only",
            )
        )
        return out
    if EXPERTS in targets and block not in EXPERT_SUPPORTED:
        out.append(
            (
                "spec.lora.targets",
                f"{EXPERTS}: the trainer wraps and exports the routed experts of the "
                f"{', '.join(sorted(EXPERT_SUPPORTED))} decoders only, not {block}",
            )
        )
    hf = [_MT_TO_HF.get(t, t) for t in targets if t not in unknown and t != EXPERTS]
    missing = sorted({t for t in hf if t not in SUPPORTED[block]})
    if missing:
        out.append(
            (
                "spec.lora.targets",
                f"{', '.join(missing)}: no such projection to wrap in the {block} decoder "
                f"(its LoRA targets: {', '.join(SUPPORTED[block])})",
            )
        )
    return out


# MLA projections MaxText 0.2.5 calls with slice_bounds under use_sliced_mla_proj (layers/attention_mla.py
# mla_query_projection, mla_get_key_value): layers/linears.py DenseGeneral then contracts a slice of the
# kernel, whose shape qwix's LoRA no longer recognises (the trainer fails building the model).
_SLICED = ("q_proj", "q_b_proj", "kv_b_proj")


def mla_problems(
    block: str | None, targets: Iterable[str], q_lora_rank: Any, sliced: Any = False
) -> list[tuple[str, str]]:
    """(field, message) for a DeepSeek query projection the model does not have: MaxText's MLA has
    ``wq_a``/``wq_b`` (q_a_proj, q_b_proj) where ``q_lora_rank`` > 0 (DeepSeek-V3, R1) and one ``query``
    (q_proj) where it is 0 (DeepSeek-V2, V2-Lite); ``q_lora_rank`` None: not known, not checked. And for
    a LoRA target MaxText slices with ``use_sliced_mla_proj`` (``sliced``) true."""
    if block != "deepseek":
        return []
    hf = {_MT_TO_HF.get(t, t) for t in targets}
    out: list[tuple[str, str]] = []
    if q_lora_rank is not None:
        rank = int(q_lora_rank)
        absent = sorted(hf & set(MLA_QUERY_LORA)) if rank == 0 else sorted(hf & {"q_proj"})
        has = "q_proj (q_lora_rank 0)" if rank == 0 else f"q_a_proj and q_b_proj (q_lora_rank {rank})"
        if absent:
            msg = f"{', '.join(absent)}: no such projection in this deepseek model's query: it has {has}"
            out.append(("spec.lora.targets", msg))
    cut = [t for t in _SLICED if t in hf]
    if cut and str(sliced).lower() == "true":
        out.append(
            (
                "spec.trainer.maxtext",
                f"use_sliced_mla_proj: true contracts slices of the {', '.join(cut)} kernel(s), to which "
                "qwix's LoRA does not apply (set it false, or leave them out of spec.lora.targets)",
            )
        )
    return out


def sampler_problems(block: str | None, targets: Iterable[str]) -> list[tuple[str, str]]:
    """(field, message) for each LoRA target the trainer trains and exports but the sampler would not
    serve or apply (the plan's check only: the trainer itself accepts them): the routed experts on any
    block (SERVING_REFUSED), and the block's own (SAMPLER_REFUSED; ``block`` None: not known, not checked)."""
    targets = list(targets)
    out = [("spec.lora.targets", f"{EXPERTS}: {SERVING_REFUSED}")] if EXPERTS in targets else []
    if block is None:
        return out
    hf = sorted({_MT_TO_HF.get(t, t) for t in targets})
    return out + [
        ("spec.lora.targets", f"{t}: {SAMPLER_REFUSED[(block, t)]}")
        for t in hf
        if (block, t) in SAMPLER_REFUSED
    ]
