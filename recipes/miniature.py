"""Miniatures of the catalog's models: the model's own MaxText config with only its sizes shrunk.

A miniature is what a local rehearsal builds instead of the full model: MaxText loads the model's own
config file (``model_name``, e.g. ``configs/models/gemma4-31b.yml`` of MaxText 0.2.5) and
:func:`miniature_overrides` replaces only sizes on top of it: layers, widths, heads, experts, the
vocabulary. Everything that makes the family different stays the model's own: the decoder block and its
scan grouping (Qwen3, Qwen3 MoE, Mixtral and Llama 3.1 scan single layers, gpt-oss scans blocks of
``inhomogeneous_layer_cycle_interval`` = 2 layers, Qwen3.5 blocks of 4 (three gated-delta-net layers,
then one full-attention layer), Gemma 4 blocks of six (five sliding-window layers, then one global layer:
``GEMMA4_ATTENTION_PATTERN`` in MaxText's ``models/gemma4.py``), Gemma 3 blocks of six the same way
(``GEMMA3_ATTENTION_PATTERN``) with the layers after the last whole block unscanned (``layers_remainder``:
a miniature keeps such a remainder where the full model has one)), MoE routing (top-k, routed and shared
experts, ``norm_topk_prob``, router bias), attention variants (sinks, sliding windows, gated delta nets,
shared key/value projections, partial and multi-section RoPE, yarn, Llama 3.1's interleaved RoPE), soft
caps, tied and scaled embeddings, norms and activations.

Each miniature keeps at least two scan iterations of its family's block, so that a scan axis is more
than one layer deep, and widths whose products differ (``heads x head_dim != emb_dim``), so that an
adapter exported with the wrong axis order or length cannot pass a round trip by accident.

  keys = {"model_name": "gemma4-31b", **miniature_overrides("gemma4-31b"), **CPU_KEYS}
  Policy(ModelSpec(maxtext=keys))           # builds in seconds on CPU
  describe("gemma4-31b")                    # what was kept, what was scaled (full -> miniature)

The full-size values come from the committed MaxText key list (``rljob.recipes.maxtext_keys``, which
holds each model config's keys), so this module does not import MaxText.
"""

from __future__ import annotations

from typing import Any

from rljob.recipes import families, maxtext_keys

__all__ = [
    "GROUP_ROUTING_KEYS",
    "MODELS",
    "describe",
    "miniature_overrides",
    "moe_expert_parallelism",
    "scan_block",
]

# Shared sizes: 64-wide, 4 query heads of 8 (32 != 64: the attention output projection's input width
# differs from the model width), a 256-token vocabulary (the CPU sampler's byte tokens).
_COMMON: dict[str, Any] = {
    "base_emb_dim": 64,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 2,
    "head_dim": 8,
    "vocab_size": 256,
}

_SIZES: dict[str, dict[str, Any]] = {
    # Qwen3 dense: one scan axis of layers.
    "qwen3-8b": {**_COMMON, "base_mlp_dim": 96, "base_num_decoder_layers": 2},
    # gpt-oss: MoE (8 experts of 32, top-4 as the full model; router and expert biases kept), attention
    # sinks, sliding window on every other layer (MaxText scans the pair: 2 blocks here), yarn RoPE.
    "gpt-oss-20b": {
        **_COMMON,
        "base_mlp_dim": 32,
        "base_moe_mlp_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 4,
        "base_num_decoder_layers": 4,
        "sliding_window_size": 16,
    },
    # Qwen3.5: blocks of 3 gated-delta-net layers + 1 gated full-attention layer (2 blocks here), MoE of
    # 16 routed experts (top-4, normalized) and one shared expert; the full-attention query keeps its
    # output gate (twice head_dim wide), the GDN 4 value heads per key head as the full model (64:16);
    # partial RoPE (0.25 of head_dim 32 = 8 rotary dims, multi-section [2, 1, 1]
    # summing to half of them, as [11, 11, 10] sums to half of 0.25 x 256).
    "qwen3.5-397b-a17b": {
        **_COMMON,
        "head_dim": 32,
        "base_mlp_dim": 32,
        "base_moe_mlp_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "base_num_decoder_layers": 8,
        "gdn_key_head_dim": 16,
        "gdn_value_head_dim": 16,
        "gdn_num_key_heads": 2,
        "gdn_num_value_heads": 8,
        "mrope_section": [2, 1, 1],
    },
    # Llama 3.1 (MaxText's llama2 block): one scan axis of layers; kept: the llama3.1 RoPE (interleaved
    # pairs, MaxText LLaMARotaryEmbedding, with its frequency scaling) and the query's 1/sqrt(head_dim)
    # folded into the query weights (no qk norm, no query_pre_attn_scalar), which the PEFT export undoes;
    # grouped-query attention 4:1 as the full model's 32:8 (8 heads of 16: 128 != 64).
    "llama3.1-8b": {
        **_COMMON,
        "base_num_query_heads": 8,
        "head_dim": 16,
        "base_mlp_dim": 96,
        "base_num_decoder_layers": 2,
    },
    # Qwen3 MoE: routed experts only (16 of 32 wide, top-8 normalized as the full model's 8 of 128), qk norm.
    "qwen3-30b-a3b": {
        **_COMMON,
        "base_mlp_dim": 32,
        "base_moe_mlp_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 8,
        "base_num_decoder_layers": 2,
    },
    # Mixtral 8x7B: all routed experts, 8 of them, top-2 as the full model (only their width shrunk);
    # kept: the query's 1/sqrt(head_dim) folded into the query weights (no qk norm), which the PEFT export
    # undoes, RoPE base 1M; grouped-query attention 4:1 as the full model's 32:8 (8 heads of 16: 128 != 64).
    "mixtral-8x7b": {
        **_COMMON,
        "base_num_query_heads": 8,
        "head_dim": 16,
        "base_mlp_dim": 32,
        "base_moe_mlp_dim": 32,
        "base_num_decoder_layers": 2,
    },
    # DeepSeek-V3 (MaxText's deepseek block): multi-head latent attention with its query latent
    # (q_lora_rank) and key/value latent (kv_lora_rank), each RMS-normed, the rotary and non-rotary head
    # dims split (qk_rope_head_dim 4 of qk_nope_head_dim 8, v_head_dim 12: three widths that differ, so a
    # wrong split of kv_b_proj's per-head output cannot round-trip), yarn RoPE on interleaved pairs with its
    # mscale; the first dense layers, then MoE layers (2 of each here, as the full model's 3 then 58) with
    # one shared expert, 16 routed experts top-4 scored by sigmoid with the score-correction bias and
    # routed_scaling_factor 2.5, group-limited: 4 groups of 4 experts, the top 2 groups (as the full
    # model's n_group 8, topk_group 4 of its Hugging Face config.json, which MaxText's deepseek3-671b.yml
    # leaves to the command line: n_routing_groups, topk_routing_group; GROUP_ROUTING_KEYS). Query and
    # key/value heads are equal in MLA.
    "deepseek3-671b": {
        **_COMMON,
        "base_num_kv_heads": 4,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 12,
        "base_mlp_dim": 96,
        "base_moe_mlp_dim": 16,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "n_routing_groups": 4,
        "topk_routing_group": 2,
        "base_num_decoder_layers": 4,
        "first_num_dense_layers": 2,
    },
    # DeepSeek-V2-Lite (the same block): its query without a latent (q_lora_rank 0: one q_proj), the
    # key/value latent and RoPE split as above; experts scored by softmax without a bias, two shared
    # experts (its n_shared_experts 2), no routing groups; 1 dense then 3 MoE layers (the full model's 1
    # then 26).
    "deepseek2-16b": {
        **_COMMON,
        "base_num_kv_heads": 4,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 12,
        "base_mlp_dim": 96,
        "base_moe_mlp_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 4,
        "base_num_decoder_layers": 4,
        "first_num_dense_layers": 1,
    },
    # Gemma 3 (27B): blocks of 5 sliding-window layers + 1 global layer (2 blocks here) and a remainder
    # of 2 sliding-window layers after them, as the full model's 62 = 10 x 6 + 2; kept: query and key
    # RMS norms, the query scaled by (emb_dim / heads)^-0.5 (MaxText models/gemma3.py
    # get_query_pre_attn_scalar for gemma3-27b: 16 here, not head_dim 8), local RoPE base 10k and global 1M
    # with linear scaling 8, tied embeddings scaled by sqrt(emb_dim), post-attention and post-FFW norms,
    # GELU; no soft caps (Gemma 3 has none: attn_logits_soft_cap and final_logits_soft_cap stay 0).
    "gemma3-27b": {
        **_COMMON,
        "base_mlp_dim": 96,
        "base_num_decoder_layers": 14,
        "sliding_window_size": 16,
    },
    # Gemma 4: blocks of 5 sliding-window layers + 1 global layer (2 blocks here) with its own head_dim
    # and KV head count and keys shared as values; tied embeddings scaled by sqrt(emb_dim), the final
    # logits soft cap of 30, post-attention and post-FFW norms, GELU.
    "gemma4-31b": {
        **_COMMON,
        "global_head_dim": 16,
        "global_num_kv_heads": 1,
        "base_mlp_dim": 96,
        "base_num_decoder_layers": 12,
        "sliding_window_size": 16,
    },
}

MODELS: tuple[str, ...] = tuple(sorted(_SIZES))

# Keys a miniature sets that are not sizes: DeepSeek-V3's group-limited routing, which its Hugging Face
# config has (n_group 8, topk_group 4) and MaxText 0.2.5's deepseek3-671b.yml asks to be set on the
# command line; its miniature routes within groups as the full model does.
GROUP_ROUTING_KEYS = frozenset({"n_routing_groups", "topk_routing_group"})

# Layers per scanned block where it is not inhomogeneous_layer_cycle_interval (rljob.recipes.families
# ``attention_cycle``: MaxText 0.2.5 models/gemma4.py GEMMA4_ATTENTION_PATTERN and models/gemma3.py
# GEMMA3_ATTENTION_PATTERN: five LOCAL_SLIDING then one GLOBAL).
_BLOCK_OVERRIDE = {b: f.attention_cycle for b, f in families.FAMILIES.items() if f.attention_cycle}


def _model_config(model_name: str) -> dict[str, Any]:
    if model_name not in _SIZES:
        raise ValueError(f"no miniature of model {model_name!r}; known: {', '.join(MODELS)}")
    keyset = maxtext_keys.load(maxtext_keys.DEFAULT_VERSION)
    return dict(keyset.models[model_name])


def miniature_overrides(model_name: str) -> dict[str, object]:
    """MaxText config overrides that shrink ``model_name`` (a MaxText model name as
    ``spec.model.maxtextModel`` names it) to a miniature; add them to the model's own config (they
    include ``override_model_config: true``, without which MaxText refuses to override a key of the
    model's config file). ValueError naming the model if there is no miniature of it."""
    _model_config(model_name)
    return {"override_model_config": True, **{k: _copy(v) for k, v in _SIZES[model_name].items()}}


def scan_block(model_name: str) -> int:
    """Layers per scanned block of the model's decoder (1: one scan axis of layers)."""
    cfg = _model_config(model_name)
    block = str(cfg.get("decoder_block"))
    return int(_BLOCK_OVERRIDE.get(block, cfg.get("inhomogeneous_layer_cycle_interval", 1)))


def describe(model_name: str) -> dict[str, object]:
    """What the miniature of ``model_name`` kept and what it scaled, for a report: ``scaled`` maps each
    key the miniature changes to ``[full, miniature]``, ``kept`` the model config's other keys (vision-encoder
    keys left out: the trainer builds the text decoder only), plus the decoder block, the layers per
    scanned block, the number of scanned blocks and of layers after the last whole block (Gemma 3's
    ``layers_remainder``) of both sizes."""
    cfg = _model_config(model_name)
    sizes = _SIZES[model_name]
    keyset = maxtext_keys.load(maxtext_keys.DEFAULT_VERSION)
    get = maxtext_keys.effective({}, keyset, model_name)
    full = {k: get(k) for k in sizes}
    scaled = {k: [full[k], _copy(v)] for k, v in sorted(sizes.items()) if full[k] != v}
    kept = {k: v for k, v in sorted(cfg.items()) if k not in scaled and not _vision(k)}
    block = scan_block(model_name)
    full_layers = int(cfg["base_num_decoder_layers"])
    mini_layers = int(sizes["base_num_decoder_layers"])
    return {
        "model": model_name,
        "decoder_block": cfg["decoder_block"],
        "layers_per_scan_block": block,
        "scan_blocks": [full_layers // block, mini_layers // block],
        "remainder_layers": [full_layers % block, mini_layers % block],
        "scaled": scaled,
        "kept": kept,
    }


def _vision(key: str) -> bool:
    return key.endswith("_for_vit") or key in (
        "vision_encoder_block",
        "image_placeholder",
        "vision_output_length",
        "use_mrope_for_vit",
    )


def _copy(v: Any) -> Any:
    return list(v) if isinstance(v, list) else v


def moe_expert_parallelism(mesh: dict[str, int], custom_mesh_and_rule: object = None) -> int:
    """Devices an MoE layer's experts are split over on ``mesh`` (axis name -> size): the expert axis, and
    with MaxText's ``custom_mesh_and_rule: cp-as-ep`` the context axis too (MaxText 0.2.5 layers/moe.py:
    the MoE's expert parallelism is then ("context", "expert")). Above 1, the sparse dispatch exchanges
    tokens between devices with ragged-all-to-all."""
    n = int(mesh.get("expert", 1))
    if str(custom_mesh_and_rule or "") == "cp-as-ep":
        n *= int(mesh.get("context", 1))
    return n
