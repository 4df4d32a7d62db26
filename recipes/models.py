"""Facts about models that the plan checks a spec against.

``MODELS``: what the sampler plan checks its parallelism against. ``num_kv_heads`` and ``num_experts``
are MaxText 0.2.5's own values (``base_num_kv_heads``, ``num_experts`` in
``maxtext/configs/models/<maxtextModel>.yml``; tests/recipes/test_models.py reads the installed MaxText
and compares). Any other MaxText model's facts are read from the same keys in the MaxText key table the
plan checks keys against (``rljob.recipes.maxtext_keys``, generated from MaxText 0.2.5's model configs), so
a Qwen3 size the catalog has no recipe for is checked too. A model MaxText does not know is not checked
(the plan refuses its name).

``RECURRENT_DECODER_BLOCKS``: the decoder blocks whose rollouts the trainer packs one per row (the plan's
spec.packing, which the trainer follows).
"""

from __future__ import annotations

from dataclasses import dataclass

from rljob.recipes import maxtext_keys


@dataclass(frozen=True)
class ModelFacts:
    num_kv_heads: int
    num_experts: int = 0  # 0: a dense model


# Keyed by spec.model.maxtextModel.
MODELS: dict[str, ModelFacts] = {
    "qwen3-0.6b": ModelFacts(num_kv_heads=8),
    "qwen3-8b": ModelFacts(num_kv_heads=8),
    "gemma4-31b": ModelFacts(num_kv_heads=16),
    "gpt-oss-20b": ModelFacts(num_kv_heads=8, num_experts=32),
    "qwen3.5-397b-a17b": ModelFacts(num_kv_heads=2, num_experts=512),
    "llama3.1-8b": ModelFacts(num_kv_heads=8),
    "llama3.1-70b": ModelFacts(num_kv_heads=8),
    "qwen3-30b-a3b": ModelFacts(num_kv_heads=4, num_experts=128),
    "gemma3-4b": ModelFacts(num_kv_heads=4),
    "gemma3-12b": ModelFacts(num_kv_heads=8),
    "gemma3-27b": ModelFacts(num_kv_heads=16),
    "mixtral-8x7b": ModelFacts(num_kv_heads=8, num_experts=8),
    "mixtral-8x22b": ModelFacts(num_kv_heads=8, num_experts=8),
    # DeepSeek (MaxText's deepseek block, multi-head latent attention: as many key/value heads as query
    # heads, MaxText's base_num_kv_heads). MaxText's to_maxtext converts DeepSeek-V3 (also R1, the same
    # architecture) and DeepSeek-V2-Lite (checkpoint_conversion/utils/param_mapping.py
    # DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING, utils/hf_model_configs.py deepseek3_671b_config and
    # deepseek2_16b_config). vLLM's TPU backend (tpu-inference) has a JAX DeepSeek-V3 model
    # (tpu_inference/models/jax/deepseek_v3.py); with LoRA the sampler runs vLLM's own DeepseekV3 model
    # (MODEL_IMPL_TYPE=vllm), and tpu-inference's support matrices list DeepSeek-R1 as passing on v7x.
    "deepseek3-671b": ModelFacts(num_kv_heads=128, num_experts=256),
    "deepseek2-16b": ModelFacts(num_kv_heads=16, num_experts=64),
}


def facts(maxtext_model: str | None) -> ModelFacts | None:
    """The model's facts: this table's, else MaxText's model config in the key table; None: unknown."""
    name = maxtext_model or ""
    if name in MODELS:
        return MODELS[name]
    cfg = maxtext_keys.load(maxtext_keys.DEFAULT_VERSION).models.get(name)
    kv = maxtext_keys.number(cfg.get("base_num_kv_heads")) if cfg else None
    if not kv:
        return None
    experts = int(maxtext_keys.number(cfg.get("num_experts")) or 0) if cfg else 0
    return ModelFacts(num_kv_heads=int(kv), num_experts=experts if experts > 1 else 0)


# MaxText decoder blocks with gated delta net layers (MaxText 0.2.5 models/qwen3.py
# Qwen3NextGatedDeltaNet, also Qwen3.5's): their causal depthwise convolution and their delta-rule
# recurrence run along the whole row, reading the segment ids only as a padding mask (segment id 0), so
# a rollout packed after another starts from the other's state, and one after leading padding convolves
# the padding's projections into its first tokens. Such a model trains one rollout per row, starting the
# row (spec.packing.maxSegmentsPerRow 1, padPosition end), so each rollout is scored exactly as the
# sampler scores it alone.
RECURRENT_DECODER_BLOCKS = frozenset({"qwen3_5", "qwen3_next"})


def recurrent(decoder_block: str | None) -> bool:
    """Whether a decoder block has gated delta net layers (RECURRENT_DECODER_BLOCKS)."""
    return (decoder_block or "").lower() in RECURRENT_DECODER_BLOCKS


__all__ = ["MODELS", "RECURRENT_DECODER_BLOCKS", "ModelFacts", "facts", "recurrent"]
