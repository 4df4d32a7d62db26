"""The spec's layers (rljob.recipes.spec_layers): defaults < recipe < profile < manifest, merged key by key,
which layer sets a field, and the refusals of an unknown recipe or profile."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.recipes import manifest
from rljob.recipes import spec_layers
from rljob.recipes.api import RLJob
from rljob.recipes.defaults import DEFAULTS


def _job(spec: dict[str, Any]) -> RLJob:
    return RLJob.model_validate(manifest(spec))


@pytest.mark.parametrize(
    ("base", "over", "want"),
    [
        ({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}, {"a": {"b": 1, "c": 3}}),  # key by key
        ({"a": [1, 2]}, {"a": [3]}, {"a": [3]}),  # a list is replaced whole
        ({"tpu": {"type": "v5p", "x": 1}}, {"tpu": {"type": "v6e"}}, {"tpu": {"type": "v6e"}}),  # tpu too
        ({"a": {"b": 1}}, {"a": {"b": None}}, {"a": {"b": 1}}),  # null is no value
        ({"maxtext": {"k": 1, "j": 2}}, {"maxtext": {"k": None}}, {"maxtext": {"j": 2}}),  # but removes a key
        ({"libtpuFlags": {"f": "1"}}, {"libtpuFlags": {"f": None}}, {"libtpuFlags": {}}),
        ({"maxtext": 1}, {"maxtext": None}, {"maxtext": 1}),  # at the root it is no value
        ({}, {"a": {"b": 1}}, {"a": {"b": 1}}),
    ],
)
def test_merge(base: dict[str, Any], over: dict[str, Any], want: dict[str, Any]) -> None:
    before = repr(base)
    assert spec_layers._merge(base, over) == want
    assert repr(base) == before  # the layers are not changed


def test_the_manifest_wins_over_the_profile_over_the_recipe_over_the_defaults() -> None:
    job = _job(
        {
            "recipe": "qwen3-8b-v5p",
            "trainer": {"profile": "long-context"},
            "algorithm": {"groupsPerBatch": 4},
        }
    )
    merged, layers, problems = spec_layers.merged_spec(job)
    assert problems == []
    assert (layers.recipe_name, layers.profile_name) == ("qwen3-8b-v5p", "long-context")
    assert merged["algorithm"]["groupsPerBatch"] == 4  # manifest (profile 8, recipe 16)
    assert merged["algorithm"]["maxTokens"] == 16384  # profile (recipe 4096)
    assert merged["algorithm"]["groupSize"] == 8  # recipe
    assert merged["sampler"]["maxLoras"] == DEFAULTS["sampler"]["maxLoras"]  # default
    assert "service" not in merged  # spec.service's defaults apply only to a service-mode spec


def test_sets_says_which_layer_set_a_field() -> None:
    job = _job({"recipe": "qwen3-8b-v5p", "trainer": {"profile": "long-context"}})
    _, layers, _ = spec_layers.merged_spec(job)
    assert layers.sets(job, "algorithm", "groupSize")  # the recipe
    assert layers.sets(job, "packing", "tokenBudget")  # the profile
    assert layers.sets(job, "storage", "root")  # the manifest
    assert not layers.sets(job, "sampler", "maxLoras")  # only a default
    assert not layers.sets(job, "no", "such", "field")


def test_a_service_spec_gets_the_service_defaults_and_a_lora_slot_per_client() -> None:
    merged, _, _ = spec_layers.merged_spec(_job({"service": {"api": "tinker", "maxTrainingClients": 5}}))
    assert merged["service"]["maxTrainingClients"] == 5
    assert merged["service"]["port"] == DEFAULTS["service"]["port"]
    assert merged["sampler"]["maxLoras"] == max(DEFAULTS["sampler"]["maxLoras"], 5)
    merged, _, _ = spec_layers.merged_spec(_job({"service": {"api": "tinker"}}))
    clients = DEFAULTS["service"]["maxTrainingClients"]
    assert merged["sampler"]["maxLoras"] == max(DEFAULTS["sampler"]["maxLoras"], clients)


@pytest.mark.parametrize(
    ("spec", "line"),
    [
        ({"recipe": "no-such"}, "spec.recipe: unknown recipe 'no-such'; known: "),
        (
            {"recipe": "qwen3-8b-v5p", "trainer": {"profile": "nope"}},
            "spec.trainer.profile: recipe qwen3-8b-v5p has no profile 'nope'; profiles: long-context",
        ),
        (
            {"recipe": "qwen3-8b-v6e", "trainer": {"profile": "nope"}},
            "spec.trainer.profile: recipe qwen3-8b-v6e has no profile 'nope'; profiles: none",
        ),
        (
            {"trainer": {"profile": "long-context"}},
            "spec.trainer.profile: a profile belongs to a recipe; set spec.recipe",
        ),
    ],
)
def test_an_unknown_recipe_or_profile_is_refused(spec: dict[str, Any], line: str) -> None:
    _, layers, problems = spec_layers.merged_spec(_job(spec))
    assert len(problems) == 1 and problems[0].startswith(line), problems
    assert layers.profile_name is None
    assert layers.unknown_recipe is (spec.get("recipe") == "no-such")
