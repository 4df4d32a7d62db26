"""The spec's layers: rljob's defaults < recipe < profile < manifest, merged key by key (`merged_spec`), and
what each layer sets (`Layers`: the plan derives a value only where no layer set it). Pure: no I/O beyond
the catalog's own data files.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from rljob.recipes import recipe_catalog
from rljob.recipes.api import RLJob, RLJobSpec
from rljob.recipes.defaults import DEFAULTS

# The plain defaults (DEFAULTS: the one table, rljob.recipes.defaults) without spec.service's, which apply
# only to a spec that sets spec.service.
_BASE_DEFAULTS = {k: v for k, v in DEFAULTS.items() if k != "service"}


def _merge(base: dict[str, Any], over: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    """Deep merge key by key; `tpu` and lists are replaced whole; a maxtext key set to null is removed.

    Any other null is no value, as the API server prunes it from a stored RLJob (the CRD declares no
    field nullable): the lower layer's value stays, so `rljob render` of a file with `maxTokens: null`
    gives what the operator renders from the stored object."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        here = (*path, key)
        if value is None:
            if path and path[-1] in ("maxtext", "libtpuFlags"):
                out.pop(key, None)
        elif key != "tpu" and isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, here)
        else:
            out[key] = copy.deepcopy(value)
    return out


def dump(spec: RLJobSpec) -> dict[str, Any]:
    return spec.model_dump(mode="json", by_alias=True, exclude_unset=True)


class Layers:
    """The spec layers of a job and the maxtext keys each contributes."""

    def __init__(self) -> None:
        self.recipe: dict[str, Any] = {}
        self.profile: dict[str, Any] = {}
        self.recipe_name: str | None = None
        self.profile_name: str | None = None
        self.unknown_recipe = False
        # What the plan filled because the default would not run: spec path -> reason (RunConfig.derived).
        self.derived: dict[str, str] = {}

    def sets(self, job: RLJob, *path: str) -> bool:
        """Whether the recipe, its profile or the manifest sets the spec field at ``path`` (camelCase
        keys under spec): a value the plan may not replace by a derived one."""
        for layer in (self.recipe, self.profile, dump(job.spec)):
            node: Any = layer
            for key in path:
                node = node.get(key) if isinstance(node, dict) else None
            if node is not None:
                return True
        return False


def layers_of(job: RLJob, problems: list[str]) -> Layers:
    layers = Layers()
    manifest = dump(job.spec)
    name = job.spec.recipe
    if name is not None:
        try:
            recipe = recipe_catalog.load(name)
        except KeyError:
            problems.append(
                f"spec.recipe: unknown recipe {name!r}; known: {', '.join(recipe_catalog.names())}"
            )
            layers.unknown_recipe = True
            return layers
        layers.recipe_name = name
        layers.recipe = dump(recipe.spec)
        profile = (manifest.get("trainer") or {}).get("profile") or (layers.recipe.get("trainer") or {}).get(
            "profile"
        )
        if profile is not None:
            if profile not in recipe.profiles:
                known = ", ".join(recipe.profiles) or "none"
                problems.append(
                    f"spec.trainer.profile: recipe {name} has no profile {profile!r}; profiles: {known}"
                )
            else:
                layers.profile_name = profile
                layers.profile = dump(recipe.profiles[profile].spec)
    elif job.spec.trainer is not None and job.spec.trainer.profile is not None:
        problems.append("spec.trainer.profile: a profile belongs to a recipe; set spec.recipe")
    return layers


def merged_spec(job: RLJob) -> tuple[dict[str, Any], Layers, list[str]]:
    """defaults < recipe < profile < manifest, as a camelCase dict, with the problems found so far."""
    problems: list[str] = []
    layers = layers_of(job, problems)
    upper = _merge(_merge(layers.recipe, layers.profile), dump(job.spec))
    base = _BASE_DEFAULTS
    if isinstance(upper.get("service"), dict):
        # The samplers' maxLoras then defaults to one adapter per training client (each client's newest
        # sampler weights served at once).
        clients = upper["service"].get("maxTrainingClients") or DEFAULTS["service"]["maxTrainingClients"]
        base = _merge(
            _BASE_DEFAULTS,
            {
                "service": DEFAULTS["service"],
                "sampler": {"maxLoras": max(int(DEFAULTS["sampler"]["maxLoras"]), int(clients))},
            },
        )
    merged = _merge(_merge(_merge(base, layers.recipe), layers.profile), dump(job.spec))
    return merged, layers, problems
