"""A refusal (rljob.recipes.problems): PlanError's bounds on the lines it carries, and pydantic's errors as
`path: message` lines with the manifest's camelCase paths."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from rljob.recipes.api import RLJob
from rljob.recipes.problems import MAX_PROBLEM_CHARS, MAX_PROBLEMS, PlanError, pydantic_problems


def test_plan_error_keeps_a_short_list_as_it_is() -> None:
    err = PlanError(["spec.a: x", "spec.b: y"])
    assert err.problems == ["spec.a: x", "spec.b: y"]
    assert str(err) == "spec.a: x\nspec.b: y"


@pytest.mark.parametrize(("count", "more"), [(MAX_PROBLEMS, None), (MAX_PROBLEMS + 1, 2), (120, 71)])
def test_plan_error_caps_the_number_of_lines(count: int, more: int | None) -> None:
    lines = [f"spec.f{i}: bad" for i in range(count)]
    got = PlanError(lines).problems
    assert len(got) == min(count, MAX_PROBLEMS)
    if more is None:
        assert got == lines
    else:
        assert got[:-1] == lines[: MAX_PROBLEMS - 1]
        assert got[-1] == f"spec: and {more} more problems (fix the ones above first)"
        assert (MAX_PROBLEMS - 1) + more == count  # every problem is shown or counted


@pytest.mark.parametrize("length", [MAX_PROBLEM_CHARS, MAX_PROBLEM_CHARS + 1, 5000])
def test_plan_error_cuts_a_long_line_to_the_limit(length: int) -> None:
    line = "spec.x: " + "y" * (length - 8)
    (got,) = PlanError([line]).problems
    assert len(got) == min(length, MAX_PROBLEM_CHARS)
    if length <= MAX_PROBLEM_CHARS:
        assert got == line
    else:
        assert got == line[: MAX_PROBLEM_CHARS - 3] + "..."


def _lines(spec: dict[str, Any], root: dict[str, Any] | None = None) -> list[str]:
    doc = {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "t"}, "spec": spec}
    doc.update(root or {})
    with pytest.raises(ValidationError) as e:
        RLJob.model_validate(doc)
    return pydantic_problems(e.value)


BASE: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen3-8B"},
    "trainer": {"tpu": "v5p-8"},
    "sampler": {"tpu": "v5p-8"},
    "storage": {"root": "gs://bucket/runs"},
}


def test_an_unknown_field_is_named_by_its_camel_case_path() -> None:
    got = _lines({**BASE, "sampler": {"tpu": "v5p-8", "maxLorasX": 1}})
    assert got == ["spec.sampler.maxLorasX: unknown field"]


def test_an_unknown_root_field_is_quoted() -> None:
    got = _lines(BASE, {"bogus": 1})
    assert len(got) == 1 and got[0].endswith(": unknown field") and "bogus" in got[0], got
    assert not got[0].startswith("spec."), got


def test_a_list_index_is_in_brackets() -> None:
    got = _lines({**BASE, "lora": {"rank": 16, "targets": ["q_proj", 3]}})
    assert any(line.startswith("spec.lora.targets[1]: ") for line in got), got


def test_a_wrong_type_names_the_field_and_the_message_is_one_line() -> None:
    got = _lines({**BASE, "algorithm": {"groupSize": "many"}})
    assert [line.split(":")[0] for line in got] == ["spec.algorithm.groupSize"], got
    assert all("\n" not in line and "Value error, " not in line for line in got)


def test_every_error_is_one_line_in_order() -> None:
    got = _lines({**BASE, "sampler": {"tpu": "v5p-8", "x": 1, "y": 2}})
    assert got == ["spec.sampler.x: unknown field", "spec.sampler.y: unknown field"]
