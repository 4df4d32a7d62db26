"""rljob.recipes.families: one row per MaxText decoder block, and the tables the plan, the fit check, the
trainer and the sampler read are that registry's (the values below are the ones those tables held)."""

from __future__ import annotations

from rljob.recipes import families, fit, lora_targets, maxtext_keys, miniature

A, M = families.ATTENTION, families.MLP


def test_every_block_maxtext_names_has_a_row() -> None:
    keyset = maxtext_keys.load(maxtext_keys.DEFAULT_VERSION)
    blocks = {str(maxtext_keys.effective({}, keyset, m)("decoder_block")).lower() for m in keyset.models}
    assert blocks - set(families.FAMILIES) == set()


def test_lora_tables_are_the_registrys() -> None:
    assert lora_targets.SUPPORTED == {
        "qwen3": A + M,
        "gemma4": A + M,
        "qwen3_5": A + M,
        "gpt_oss": A,
        "llama2": A + M,
        "qwen3_moe": A,
        "gemma3": A + M,
        "mixtral": A,
        "deepseek": families.MLA + M,
    }
    assert {"qwen3_moe", "mixtral"} == lora_targets.EXPERT_SUPPORTED
    assert set(lora_targets.REFUSED) == {b for b, f in families.FAMILIES.items() if f.refused}
    assert set(lora_targets.REFUSED).isdisjoint(lora_targets.SUPPORTED)
    assert list(lora_targets.SAMPLER_REFUSED) == [("deepseek", "kv_b_proj")]


def test_a_refused_row_trains_nothing() -> None:
    for block, f in families.FAMILIES.items():
        if f.refused:
            assert (f.lora_targets, f.experts, f.sampler_refused) == ((), None, {}), block


def test_layer_cycles_are_the_registrys() -> None:
    assert miniature.scan_block("gemma3-27b") == miniature.scan_block("gemma4-31b") == 6
    shapes = fit.shapes("gemma4-31b", {})
    assert shapes is not None and shapes.global_layers == shapes.layers // 6


def test_family_lookup_ignores_case() -> None:
    assert families.family("Gemma3") is families.FAMILIES["gemma3"]
    assert families.family(None) is None and families.family("no-such-block") is None


def test_the_samplers_pow2_families_are_the_registrys() -> None:
    from rljob.sampler import vllm

    assert sorted(vllm.POW2_BATCHED_TOKENS_FAMILIES) == sorted(("qwen3.5", "qwen3_5", "gemma4", "gemma-4"))
    assert vllm.needs_pow2_batched_tokens(["Qwen/Qwen3.5-397B-A17B"]) and vllm.needs_pow2_batched_tokens(
        ["google/gemma-4-31b"]
    )
    assert not vllm.needs_pow2_batched_tokens(["Qwen/Qwen3-8B", "qwen3-8b"])
