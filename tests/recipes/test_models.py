"""rljob.recipes.models: a model's facts are its MaxText config's (the key table of the manifest's
MaxText version), checked against the installed MaxText's model configs and the published values."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml
from rljob.recipes import families, maxtext_keys, models, recipe_catalog

VERSION = maxtext_keys.DEFAULT_VERSION
# maxtextModel -> (KV heads, routed experts; 0: dense), as the models' cards publish them.
PUBLISHED = {
    "qwen3-0.6b": (8, 0),
    "qwen3-8b": (8, 0),
    "gemma4-31b": (16, 0),
    "gpt-oss-20b": (8, 32),
    "qwen3.5-397b-a17b": (2, 512),
    "llama3.1-8b": (8, 0),
    "llama3.1-70b": (8, 0),
    "qwen3-30b-a3b": (4, 128),
    "gemma3-4b": (4, 0),
    "gemma3-12b": (8, 0),
    "gemma3-27b": (16, 0),
    "mixtral-8x7b": (8, 8),
    "mixtral-8x22b": (8, 8),
    # DeepSeek's MLA: as many key/value heads as query heads (MaxText's base_num_kv_heads)
    "deepseek3-671b": (128, 256),
    "deepseek2-16b": (16, 64),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_facts_are_maxtexts(name: str) -> None:
    path = resources.files("maxtext").joinpath("configs", "models", f"{name}.yml")
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    f = models.facts(name, VERSION)
    assert f is not None
    assert (f.num_kv_heads, f.num_experts) == PUBLISHED[name]
    assert f.num_kv_heads == cfg["base_num_kv_heads"]
    assert f.num_experts == cfg.get("num_experts", 0) or (f.num_experts == 0 and cfg.get("num_experts") == 1)


def test_an_unknown_version_or_model_has_no_facts() -> None:
    assert models.facts("qwen3-8b", "0.0.0-not-a-maxtext") is None
    assert models.facts("not-a-model", VERSION) is None
    assert models.facts(None, VERSION) is None


def test_every_catalog_model_has_facts() -> None:
    for name in recipe_catalog.names():
        model = recipe_catalog.load(name).spec.model
        assert model is not None and models.facts(model.maxtext_model, VERSION) is not None, name


def test_recurrent_blocks_are_the_families_with_gated_delta_nets() -> None:
    assert models.RECURRENT_DECODER_BLOCKS == maxtext_keys.GATED_DELTA_NET_BLOCKS == {"qwen3_5", "qwen3_next"}
    assert families.blocks_where("mla") == {"deepseek", "deepseek4"}
    assert models.recurrent("Qwen3_5") and not models.recurrent("qwen3") and not models.recurrent(None)
