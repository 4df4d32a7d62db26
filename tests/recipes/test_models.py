"""rljob.recipes.models against the installed MaxText's model configs (the values it cites)."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml
from rljob.recipes import models, recipe_catalog


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_facts_are_maxtexts(name: str) -> None:
    path = resources.files("maxtext").joinpath("configs", "models", f"{name}.yml")
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    f = models.MODELS[name]
    assert f.num_kv_heads == cfg["base_num_kv_heads"]
    assert f.num_experts == cfg.get("num_experts", 0) or (f.num_experts == 0 and cfg.get("num_experts") == 1)


def test_every_catalog_model_has_facts() -> None:
    for name in recipe_catalog.names():
        model = recipe_catalog.load(name).spec.model
        assert model is not None and models.facts(model.maxtext_model) is not None, name
