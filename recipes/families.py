"""The model families: one row per MaxText decoder block (``decoder_block`` of MaxText 0.2.5's model
configs), holding every fact rljob keeps about that block. The plan, the fit check, the miniatures, the
trainer (LoRA, expert LoRA, PEFT export) and the sampler (vLLM's flags) read these rows; none keeps a
table of blocks of its own.

A block with ``refused`` set is one MaxText has but rljob does not train: the plan refuses it with that
reason (rljob.recipes.lora_targets). Adding a family is a row here, a miniature
(rljob.recipes.miniature ``_SIZES``) and its tests (tests/trainer/test_families.py trains and exports the
miniature and checks ``lora_targets`` against the LoRA parameters qwix creates); docs/architecture.md,
"Where a change goes".

Sources, per fact: MaxText 0.2.5 models/<block>.py, layers/attention_mla.py,
checkpoint_conversion/utils/param_mapping.py; transformers 5.x models/<family>/modeling_<family>.py
(https://github.com/huggingface/transformers/tree/main/src/transformers/models); the comments of
rljob.recipes.lora_targets, rljob.trainer.peft and rljob.trainer.expert_lora say which fact comes from
which file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "ATTENTION",
    "DEFAULT_HF_LAYERS_PREFIX",
    "FAMILIES",
    "MLA",
    "MLA_QUERY_LORA",
    "MLP",
    "Family",
    "blocks_where",
    "family",
]

# LoRA targets by their Hugging Face projection names (rljob.recipes.lora_targets maps them to MaxText's).
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# MLA: the query through a low-rank latent (q_a_proj, its RMS norm, q_b_proj) or, with q_lora_rank 0,
# one q_proj; keys and values through one latent (kv_a_proj_with_mqa, whose output is the latent of
# kv_lora_rank followed by the qk_rope_head_dim rotary key shared by all heads; its RMS norm;
# kv_b_proj to each head's non-rotary key and value).
MLA_QUERY_LORA = ("q_a_proj", "q_b_proj")
MLA = ("q_proj", *MLA_QUERY_LORA, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

# PEFT name prefix of the decoder layers of most Hugging Face models (XForCausalLM keeps them at
# model.layers; the PEFT model wraps it as base_model.model).
DEFAULT_HF_LAYERS_PREFIX = "base_model.model.model.layers"
# XForConditionalGeneration: ``self.model = ...Model(config)`` whose ``self.language_model`` holds
# ``self.layers``.
_LANGUAGE_MODEL_LAYERS = "base_model.model.model.language_model.layers"

_NOT_YET = "the PEFT export of the {} block{} is not written and tested yet"
_NO_CONVERSION = "MaxText 0.2.5's to_maxtext has no Hugging Face checkpoint mapping for it"
_TEST_BLOCK = "MaxText's test block, not a Hugging Face model's"


@dataclass(frozen=True)
class Family:
    """What rljob knows of one MaxText decoder block."""

    # The Hugging Face projections the trainer wraps with LoRA and exports (empty where refused).
    lora_targets: tuple[str, ...] = ()
    # Why the trainer does not train this block; None: it does.
    refused: str | None = None
    # LoRA on the routed experts (the target ``experts``): (the Hugging Face parent of the experts,
    # {MaxText expert weight: its projection inside ``experts.{j}``}); None: not trained.
    experts: tuple[str, dict[str, str]] | None = None
    # Gated delta net layers (a recurrence along the whole row): one rollout per row, context
    # parallelism without MaxText's load balancing.
    recurrent: bool = False
    # Multi-head latent attention (compressed KV).
    mla: bool = False
    # Layers per scanned block where it is not MaxText's inhomogeneous_layer_cycle_interval (a fixed
    # attention pattern: Gemma's five sliding-window layers, then a global one), else None.
    attention_cycle: int | None = None
    # The PEFT name prefix of the decoder layers of the Hugging Face model the block is converted from.
    hf_layers_prefix: str = DEFAULT_HF_LAYERS_PREFIX
    # MaxText folds 1/sqrt(head_dim) into the query kernel and its conversion divides q_proj by it: the
    # PEFT export scales the query adapter back.
    query_scale_folded: bool = False
    # (target, why) for each LoRA target the trainer trains but the sampler would not apply.
    sampler_refused: dict[str, str] = field(default_factory=dict)
    # Substrings of a model name (Hugging Face or MaxText) of this family whose LoRA punica buffers need
    # a power-of-two --max-num-batched-tokens in vLLM's TPU backend (multimodal-architecture checkpoints).
    vllm_pow2_batched_tokens: tuple[str, ...] = ()


_ROWS: dict[str, Family] = {
    # Qwen3ForCausalLM: attention and the dense MLP.
    "qwen3": Family(lora_targets=ATTENTION + MLP),
    # Gemma4ForConditionalGeneration (models/gemma4.py GEMMA4_ATTENTION_PATTERN).
    "gemma4": Family(
        lora_targets=ATTENTION + MLP,
        attention_cycle=6,
        hf_layers_prefix=_LANGUAGE_MODEL_LAYERS,
        vllm_pow2_batched_tokens=("gemma4", "gemma-4"),
    ),
    # Qwen3_5MoeForConditionalGeneration: attention (the full-attention layers; the gated delta net layers
    # have no q/k/v/o projection) and the shared expert's MLP; its routed experts' export is not written.
    "qwen3_5": Family(
        lora_targets=ATTENTION + MLP,
        recurrent=True,
        hf_layers_prefix=_LANGUAGE_MODEL_LAYERS,
        vllm_pow2_batched_tokens=("qwen3.5", "qwen3_5"),
    ),
    # GptOssForCausalLM: attention only; its MLP is all experts, stacked on both sides.
    "gpt_oss": Family(lora_targets=ATTENTION),
    # LlamaForCausalLM (MaxText's block for Llama 2 and Llama 3.x).
    "llama2": Family(lora_targets=ATTENTION + MLP, query_scale_folded=True),
    # Qwen3MoeForCausalLM (QWEN_MAXTEXT_TO_HF_PARAM_MAPPING: moe_block-wi_0 -> mlp.experts.{e}.gate_proj).
    "qwen3_moe": Family(
        lora_targets=ATTENTION,
        experts=("mlp.experts", {"wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}),
    ),
    # Gemma3ForConditionalGeneration's text tower (models/gemma3.py GEMMA3_ATTENTION_PATTERN).
    "gemma3": Family(
        lora_targets=ATTENTION + MLP, attention_cycle=6, hf_layers_prefix=_LANGUAGE_MODEL_LAYERS
    ),
    # MixtralForCausalLM (MIXTRAL_MAXTEXT_TO_HF_PARAM_MAPPING: MoeBlock_0-wi_0 ->
    # block_sparse_moe.experts.{j}.w1, wi_1 -> w3, wo -> w2).
    "mixtral": Family(
        lora_targets=ATTENTION,
        experts=("block_sparse_moe.experts", {"wi_0": "w1", "wi_1": "w3", "wo": "w2"}),
        query_scale_folded=True,
    ),
    # DeepseekV3ForCausalLM, DeepseekV2ForCausalLM: MLA and the MLP of the dense layers and shared experts.
    "deepseek": Family(
        lora_targets=MLA + MLP,
        mla=True,
        sampler_refused={
            "kv_b_proj": "vLLM's MLA attention uses kv_b_proj's base weight outside the LoRA-wrapped layer "
            "(absorbed into its key and value up-projections at load; prefill calls the unwrapped layer), "
            "so a kv_b_proj adapter loads and is applied nowhere "
            "(https://github.com/vllm-project/vllm/issues/48974): the sampler would not sample the policy "
            "the trainer trains",
        },
    ),
    # Blocks MaxText has that rljob does not train.
    "deepseek4": Family(
        refused="its attention (MLA with compressed KV) has no PEFT layout exported yet", mla=True
    ),
    "mistral": Family(refused=f"{_NO_CONVERSION}, and " + _NOT_YET.format("mistral", "")),
    "gemma2": Family(refused=_NOT_YET.format("gemma2", "")),
    "gemma": Family(refused=f"{_NO_CONVERSION}, and " + _NOT_YET.format("gemma", "")),
    "gemma4_small": Family(refused=_NOT_YET.format("gemma4_small", "")),
    "qwen2": Family(refused=_NOT_YET.format("qwen2", " (q/k/v biases)")),
    # MaxText 0.2.5 configs/types.py QWEN3_NEXT: gated delta net layers, as qwen3_5.
    "qwen3_next": Family(refused=_NOT_YET.format("qwen3_next", " (gated delta net blocks)"), recurrent=True),
    "qwen3_custom_moe": Family(refused=_NOT_YET.format("qwen3_custom_moe", "")),
    "olmo3": Family(refused=_NOT_YET.format("olmo3", "")),
    "llama4": Family(
        refused=f"{_NO_CONVERSION}, and " + _NOT_YET.format("llama4", " (interleaved MoE and NoPE layers)")
    ),
    "gpt3": Family(refused=_NO_CONVERSION),
    "envy": Family(refused=_NO_CONVERSION),
    "default": Family(refused=_TEST_BLOCK),
    "simple": Family(refused=_TEST_BLOCK),
    "simple_mlp": Family(refused=_TEST_BLOCK),
}
# decoder_block (lower case, as MaxText's config files spell it) -> its row.
FAMILIES: MappingProxyType[str, Family] = MappingProxyType(_ROWS)


def family(decoder_block: str | None) -> Family | None:
    """The row of a decoder block (any case); None: a block rljob knows nothing of."""
    return FAMILIES.get((decoder_block or "").lower())


def blocks_where(has: str) -> frozenset[str]:
    """The decoder blocks whose row's attribute ``has`` is true (``recurrent``, ``mla``, ...)."""
    return frozenset(b for b, f in FAMILIES.items() if getattr(f, has))
