"""The recipe catalog: recipes/catalog/<name>.yaml, read from the package's own data.

A recipe is a partial RLJob spec whose values are defaults a manifest overrides key by key, plus
named profiles (partial specs too, typically tuned MaxText keys and a mesh) that sit between the
recipe and the manifest: recipe < profile < manifest.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from pydantic import Field
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
    """The recipe file's text; KeyError when there is no such recipe."""
    res = _dir().joinpath(f"{name}.yaml")
    if not res.is_file():
        raise KeyError(name)
    return res.read_text(encoding="utf-8")


@cache
def load(name: str) -> Recipe:
    import yaml

    recipe = Recipe.model_validate(yaml.safe_load(source(name)))
    if recipe.name != name:
        raise ValueError(f"catalog/{name}.yaml names itself {recipe.name!r}")
    return recipe
