"""Generated names: JobSet, Jobs, Pod hostnames and names, coordinator label all fit 63 characters."""

from __future__ import annotations

import pytest
from rljob.recipes import naming

ROLES = {"trainer": (1, 1), "sampler": (1, 1)}


def test_names() -> None:
    assert naming.job("rl", "trainer", 3) == "rl-trainer-3"
    assert naming.hostname("rl", "sampler", 2, 7) == "rl-sampler-2-7"
    assert naming.coordinator("rl") == "rl-trainer-0-0.rl"
    assert naming.sampler_url("rl", 1, 8000) == "http://rl-sampler-1-0.rl:8000"
    assert naming.progress_configmap("rl") == "rl-progress"
    assert naming.run_configmap("rl") == "rl-run"


@pytest.mark.parametrize(
    ("roles", "longest"),
    [
        (ROLES, 25),  # the coordinator label <name>-trainer-0-0.<name> binds
        ({"trainer": (1, 64), "sampler": (256, 4)}, 25),
        ({"trainer": (1, 1), "sampler": (1000, 1000)}, 25),
    ],
)
def test_max_name_length(roles: dict[str, tuple[int, int]], longest: int) -> None:
    assert naming.max_name_length(roles) == longest
    assert naming.check("a" * longest, roles) == []
    problems = naming.check("a" * (longest + 1), roles)
    assert problems and all(p.startswith("metadata.name: too long: ") for p in problems)
    assert f"at most {longest} characters" in problems[0]


@pytest.mark.parametrize("name", ["1abc", "a_b", "Abc", "abc-"])
def test_dns1035(name: str) -> None:
    assert naming.check(name, ROLES)[0].startswith(f"metadata.name: {name!r} must start with a letter")


def test_every_generated_name_fits_at_the_limit() -> None:
    roles = {"trainer": (4, 64), "sampler": (16, 4)}
    n = naming.max_name_length(roles)
    for what, value in naming.generated("a" * n, roles).items():
        assert len(value) <= 63, what


def test_generated_names_exact() -> None:
    assert naming.generated("rl", {"trainer": (2, 4), "sampler": (3, 1)}) == {
        "JobSet": "rl",
        "coordinator label": "rl-trainer-0-0.rl",
        "run ConfigMap": "rl-run",
        "progress ConfigMap": "rl-progress",
        "credentials Secret": "rl-credentials",
        "ServiceAccount": "rl-rljob",
        "API Service": "rl-api",
        "preflight Job": "rl-compile-xxxxxxxx",
        "trainer Job": "rl-trainer-1",
        "trainer Pod hostname": "rl-trainer-1-3",
        "trainer Pod name": "rl-trainer-1-3-xxxxx",
        "sampler Job": "rl-sampler-2",
        "sampler Pod hostname": "rl-sampler-2-0",
        "sampler Pod name": "rl-sampler-2-0-xxxxx",
    }
