"""The resolved spec (RunConfig.spec, contract 2) and the one defaults table (rljob.recipes.defaults).

A resolved spec holds a value in every field but the few whose absence means something; the API's
"Default N" texts are the table's values, and the plan fills exactly those values.
"""

from __future__ import annotations

import re
import typing
from typing import Any

import pytest
from fixtures.recipes import MINIMAL, catalog_cases, manifest, resolve
from pydantic import BaseModel, ValidationError
from rljob.recipes import defaults
from rljob.recipes.api import RLJobSpec
from rljob.recipes.runconfig import ResolvedSpec, RunConfig

TESTED_MODULES = (
    "rljob.recipes.defaults",
    "rljob.recipes.runconfig",
)

# The fields of a resolved spec that may be None, each because the absence means something.
OPTIONAL = {
    "recipe",  # no catalog recipe
    "model.checkpoint",  # the trainer converts spec.model.name itself (StoragePaths.converted)
    "trainer.profile",  # no profile of the recipe
    "trainer.template",  # no pod overrides
    "sampler.template",
    "dataset.path",  # task successor reads no file
    "dataset.rewardUrl",  # the task's own reward
    "packing.maxSegmentsPerRow",  # as many rollouts per row as fit
    "service",  # the RL loop, not an API service
    "queueName",  # no Kueue queue
    "priorityClassName",  # no PriorityClass
    "lora.initFrom",  # no warm start: the adapter starts at zero
}


CASES = catalog_cases()


def _model_of(annotation: Any) -> type[BaseModel] | None:
    args = typing.get_args(annotation) or (annotation,)
    return next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)


def _allows_none(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _fields(model: type[BaseModel], prefix: str = "", into: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every field of a model tree by its camelCase path -> FieldInfo (pod templates are leaves)."""
    out: dict[str, Any] = {} if into is None else into
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or name)
        out[path] = info
        sub = _model_of(info.annotation)
        if sub is not None and not path.endswith("template"):
            _fields(sub, path + ".", out)
    return out


def _nones(value: Any, prefix: str = "") -> list[str]:
    """Paths of the None values in a dumped resolved spec (pod templates are leaves)."""
    out = []
    for k, v in value.items():
        path = prefix + k
        if v is None:
            out.append(path)
        elif isinstance(v, dict) and not path.endswith("template"):
            out += _nones(v, path + ".")
    return out


def test_only_the_meaningful_fields_are_optional() -> None:
    optional = {p for p, info in _fields(ResolvedSpec).items() if _allows_none(info.annotation)}
    assert optional == OPTIONAL


@pytest.mark.parametrize(("name", "doc"), CASES, ids=[c[0] for c in CASES])
def test_every_required_field_of_a_resolved_spec_is_set(name: str, doc: dict[str, Any]) -> None:
    rc = resolve(doc)
    dumped = rc.spec.model_dump(mode="json", by_alias=True)
    assert set(_nones(dumped)) <= OPTIONAL, name
    # Through the run config's JSON (what the pods read) the spec stays the same.
    again = RunConfig.model_validate_json(rc.model_dump_json(exclude_none=True))
    assert again.spec == rc.spec


def test_a_resolved_spec_is_frozen() -> None:
    rc = resolve(manifest())
    with pytest.raises(ValidationError, match="frozen"):
        rc.spec.lora.rank = 8  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        rc.spec.algorithm = rc.spec.algorithm  # type: ignore[misc]


def test_a_resolved_spec_refuses_a_missing_value() -> None:
    rc = resolve(manifest())
    data = rc.spec.model_dump(mode="json", by_alias=True)
    del data["algorithm"]["maxTokens"]
    data["lora"]["rank"] = None
    with pytest.raises(ValidationError) as err:
        ResolvedSpec.model_validate(data)
    assert {".".join(map(str, e["loc"])) for e in err.value.errors()} == {"algorithm.maxTokens", "lora.rank"}


def _at(data: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        data = data[part]
    return data


def test_the_plan_fills_every_default_of_the_table() -> None:
    """A manifest that sets none of DEFAULTS' fields resolves to exactly the table's values."""
    plain = resolve(MINIMAL).spec.model_dump(mode="json", by_alias=True)
    served = resolve(manifest({"service": {"api": "tinker", "apiKeySecret": "keys"}})).spec.model_dump(
        mode="json", by_alias=True
    )
    for path in defaults.paths():
        got = _at(served if path.startswith("service.") else plain, path)
        assert got == defaults.value(path), path
    # With spec.service the samplers hold one adapter per training client by default.
    assert served["sampler"]["maxLoras"] == defaults.value("service.maxTrainingClients")


def test_the_api_says_every_default_of_the_table() -> None:
    """Each DEFAULTS field's description says "Default <value>" (the text built from the table); no other
    field says "Default <value>" (a derived default reads "Default: ...")."""
    fields = _fields(RLJobSpec)
    table = set(defaults.paths())
    assert table <= set(fields), table - set(fields)
    for path, info in fields.items():
        text = info.description or ""
        if path in table:
            said = f"Default {defaults.show(defaults.value(path))}"
            assert re.search(re.escape(said) + r"( \(|\.)", text), (path, text)
            assert text.count("Default") == 1, (path, text)
        else:
            assert not re.search(r"\bDefault [^:]", text.replace("Default:", "")), (path, text)


def test_default_texts() -> None:
    assert defaults.show(1e-5) == "1e-5" and defaults.show(0.0) == "0" and defaults.show(2.5) == "2.5"
    assert defaults.show(False) == "false" and defaults.show(["a", "b"]) == "[a, b]"
    assert defaults.show("a b\n") == '"a b\\n"' and defaults.show("mean") == "mean"
    assert defaults.text("lora.rank") == "Default 16."
    assert defaults.text("packing.padAlign", "why") == "Default 4096 (why)."
