"""The recipe catalog: recipes/catalog/<name>.yaml, read from the package's own data.

A recipe is a partial RLJob spec whose values are defaults a manifest overrides key by key, plus
named profiles (partial specs too, typically tuned MaxText keys and a mesh) that sit between the
recipe and the manifest: recipe < profile < manifest.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from pydantic import Field
from rljob.recipes import manifest
from rljob.recipes.api import ApiModel, RLJobSpec


class Profile(ApiModel):
    """A tuned variant of a recipe."""

    description: str = Field(description="What the profile is for and where its values were measured.")
    spec: RLJobSpec = Field(description="Partial spec applied over the recipe's.")


class Recipe(ApiModel):
    """A catalog recipe."""

    name: str = Field(description="Recipe name (spec.recipe).")
    description: str = Field(description="One paragraph on the recipe.")
    spec: RLJobSpec = Field(description="Partial spec: defaults the manifest overrides key by key.")
    profiles: dict[str, Profile] = Field(default_factory=dict, description="Named tuned variants.")


def _dir() -> resources.abc.Traversable:
    return resources.files("rljob.recipes").joinpath("catalog")


def names() -> list[str]:
    return sorted(p.name[: -len(".yaml")] for p in _dir().iterdir() if p.name.endswith(".yaml"))


def source(name: str) -> str:
    """The recipe file's text; KeyError when there is no such recipe. The name is looked up among the
    catalog's files, never joined into a path (`../x` names no recipe)."""
    if name not in names():
        raise KeyError(name)
    return _dir().joinpath(f"{name}.yaml").read_text(encoding="utf-8")


@cache
def load(name: str) -> Recipe:
    """A catalog recipe, read as a manifest is (rljob.recipes.manifest: bounded, duplicate keys refused,
    strict types)."""
    docs, problems = manifest.load_yaml(source(name))
    if problems or len(docs) != 1:
        raise ValueError(f"catalog/{name}.yaml: {'; '.join(problems) or 'not one YAML document'}")
    data, problems, _ = manifest.clean(docs[0])
    if problems:
        raise ValueError(f"catalog/{name}.yaml: {'; '.join(problems)}")
    recipe = Recipe.model_validate_json(json.dumps(data), strict=True)
    if recipe.name != name:
        raise ValueError(f"catalog/{name}.yaml names itself {recipe.name!r}")
    return recipe
