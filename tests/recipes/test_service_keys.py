"""spec.service.apiKeySecret (rljob.recipes.service_keys): a service-mode job without it is refused, one
line naming the field and the Secret's key; a job without spec.service is not concerned."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.recipes import manifest, problems
from rljob.recipes import service_keys
from rljob.recipes.api import RLJob
from rljob.recipes.runconfig import API_KEYS_SECRET_KEY


def _spec(spec: dict[str, Any]) -> Any:
    return RLJob.model_validate(manifest(spec)).spec


@pytest.mark.parametrize(
    ("spec", "refused"),
    [
        ({}, False),
        ({"service": {"api": "tinker"}}, True),
        ({"service": {"api": "tinker", "apiKeySecret": "keys"}}, False),
    ],
)
def test_problems(spec: dict[str, Any], refused: bool) -> None:
    got = service_keys.problems(_spec(spec))
    if not refused:
        assert got == []
        return
    assert len(got) == 1, got
    assert got[0].startswith("spec.service.apiKeySecret: required: ")
    assert f"`{API_KEYS_SECRET_KEY}`" in got[0] and f"--from-literal={API_KEYS_SECRET_KEY}=tml-" in got[0]


def test_the_plan_makes_the_check() -> None:
    refusal = service_keys.problems(_spec({"service": {"api": "tinker"}}))[0]
    assert refusal in problems(manifest({"service": {"api": "tinker"}}))
    assert not any(
        p.startswith("spec.service.apiKeySecret")
        for p in problems(manifest({"service": {"api": "tinker", "apiKeySecret": "keys"}}))
    )
