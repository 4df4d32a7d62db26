"""The miniatures of the catalog's models (rljob.recipes.miniature): only sizes are overridden, the
family's own config keys are kept, every miniature keeps at least two scanned blocks of its family's
block, and an unknown model is refused by name. tests/trainer/test_families.py builds them."""

from __future__ import annotations

import pytest
from rljob.recipes import maxtext_keys, miniature

# Keys a miniature may override: sizes only (and MaxText's permission to override the model config).
SIZE_KEYS = {
    "override_model_config",
    "base_emb_dim",
    "base_num_query_heads",
    "base_num_kv_heads",
    "head_dim",
    "global_head_dim",
    "global_num_kv_heads",
    "base_mlp_dim",
    "base_moe_mlp_dim",
    "num_experts",
    "num_experts_per_tok",
    "base_num_decoder_layers",
    "vocab_size",
    "sliding_window_size",
    "gdn_key_head_dim",
    "gdn_value_head_dim",
    "gdn_num_key_heads",
    "gdn_num_value_heads",
    "mrope_section",
    # DeepSeek's multi-head latent attention and its dense first layers
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_num_dense_layers",
}


@pytest.mark.parametrize("model", miniature.MODELS)
def test_miniature_scales_only_sizes(model: str) -> None:
    keyset = maxtext_keys.load(maxtext_keys.DEFAULT_VERSION)
    over = miniature.miniature_overrides(model)
    assert over["override_model_config"] is True
    assert set(over) <= SIZE_KEYS | miniature.GROUP_ROUTING_KEYS and all(k in keyset for k in over)
    desc = miniature.describe(model)
    full = keyset.models[model]
    assert desc["decoder_block"] == full["decoder_block"]
    kept = desc["kept"]
    assert isinstance(kept, dict) and not set(kept) & set(desc["scaled"])  # type: ignore[call-overload]
    assert all(kept.get(k, v) == v for k, v in over.items())  # an override equal to the full value is kept
    # what makes the family: kept as the model's config has it
    for k in (
        "decoder_block",
        "inhomogeneous_layer_cycle_interval",
        "final_logits_soft_cap",
        "logits_via_embedding",
    ):
        if k in full:
            assert kept[k] == full[k]
    scaled = desc["scaled"]
    assert isinstance(scaled, dict)
    for k, (big, small) in scaled.items():
        if k in miniature.GROUP_ROUTING_KEYS:  # set where the model config leaves them to the command line
            assert big == keyset.defaults[k] == -1 and small > 0, k
            continue
        if isinstance(small, int) and not isinstance(small, bool):
            assert 0 < small <= big, k
    # at least two scanned blocks of the family's block, and the full model's block divides its layers
    blocks = desc["scan_blocks"]
    assert isinstance(blocks, list) and blocks[1] >= 2
    block = miniature.scan_block(model)
    # ... and layers after the last whole block (Gemma 3's layers_remainder) where the full model has them
    rest = desc["remainder_layers"]
    assert isinstance(rest, list) and bool(rest[0]) == bool(rest[1])
    assert int(over["base_num_decoder_layers"]) == blocks[1] * block + rest[1]  # type: ignore[call-overload]
    assert int(full["base_num_decoder_layers"]) == blocks[0] * block + rest[0]


@pytest.mark.jax
def test_scan_blocks_are_maxtexts() -> None:
    from maxtext.models import gemma4

    assert miniature.scan_block("gemma4-31b") == len(gemma4.GEMMA4_ATTENTION_PATTERN)
    assert miniature.scan_block("gpt-oss-20b") == 2
    assert miniature.scan_block("qwen3.5-397b-a17b") == 4
    assert miniature.scan_block("qwen3-8b") == 1
    assert miniature.scan_block("llama3.1-8b") == 1
    assert miniature.scan_block("qwen3-30b-a3b") == 1
    assert miniature.scan_block("mixtral-8x7b") == 1
    assert miniature.scan_block("deepseek3-671b") == 1
    from maxtext.models import gemma3

    assert miniature.scan_block("gemma3-27b") == len(gemma3.GEMMA3_ATTENTION_PATTERN)


def test_unknown_model_is_named() -> None:
    with pytest.raises(ValueError, match="'llama3-8b'"):
        miniature.miniature_overrides("llama3-8b")
    with pytest.raises(ValueError, match="'llama3-8b'"):
        miniature.describe("llama3-8b")


@pytest.mark.jax
@pytest.mark.parametrize("profile", [None, "256-chips-ep2", "256-chips-ep1"])
def test_the_qwen35_drill_dispatches_experts_densely_where_the_moe_is_split(profile: str | None) -> None:
    """Qwen3.5's recipe maps its MoE's experts over context x expert (cp-as-ep): the ep1 profile (no expert
    axis) still splits them over the context axis, whose sparse dispatch needs ragged-all-to-all, which
    XLA:CPU lacks. The trainer's miniature takes the dense dispatch there; the one-device sampler keeps
    the model's own."""
    from rljob.cli import drill
    from rljob.trainer.tinypolicy import CPU_EXPERT_PARALLEL_KEYS, miniature_keys

    doc = drill.recipe_doc("qwen3.5-397b-a17b-tpu7x", profile)
    small = drill.resolve_doc(drill.scaled_doc(doc, drill.resolve_doc(doc), 2)[0], fit_check=False)
    trainer = miniature_keys(small, mesh=True)
    assert trainer["custom_mesh_and_rule"] == "cp-as-ep" and trainer["ici_context_parallelism"] == 2
    assert all(trainer.get(k) == v for k, v in CPU_EXPERT_PARALLEL_KEYS.items())
    assert not set(CPU_EXPERT_PARALLEL_KEYS) & set(miniature_keys(small, mesh=False))


def test_moe_expert_parallelism_counts_the_context_axis_only_under_cp_as_ep() -> None:
    mesh = {"fsdp": 8, "context": 2, "expert": 1}
    assert miniature.moe_expert_parallelism(mesh) == 1
    assert miniature.moe_expert_parallelism(mesh, "cp-as-ep") == 2
    assert miniature.moe_expert_parallelism({**mesh, "expert": 2}, "cp-as-ep") == 4
    assert miniature.moe_expert_parallelism({"fsdp": 4, "expert": 2}) == 2
