"""The run's own checks (rljob.recipes.run_checks): bucket names, the object-name budget of the storage root
and the service port against the run's own ports."""

from __future__ import annotations

import pytest
from fixtures.recipes import manifest, problems
from rljob.recipes import run_checks


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("abc", True),
        ("my_bucket.example.com", True),
        ("ab", False),
        ("goog-x", False),
        ("my-google-x", False),
        ("g00gle", False),
        ("a..b", False),
        ("a.-b", False),
        ("10.0.0.1", False),
        ("Upper", False),
        ("a" * 64, False),
    ],
)
def test_bucket_names(name: str, ok: bool) -> None:
    assert (run_checks.bucket(name) is None) is ok


def test_object_name_budget_is_exact() -> None:
    """The longest prefix accepted makes names of exactly 1,024 bytes; one byte more is refused."""
    ns, name, uid = "ns", "t", "0" * 36
    fixed = len(f"{ns}/{name}/{uid}") + 2 + run_checks.RUN_SUFFIX_MAX  # the two '/' around the prefix parts
    room = run_checks.OBJECT_NAME_MAX - fixed
    assert run_checks.storage_root("gs://bucket/" + "p" * room, ns, name, uid) == []
    assert run_checks.storage_root("gs://bucket/" + "p" * (room + 1), ns, name, uid)


@pytest.mark.parametrize("port", sorted(run_checks.RUN_PORTS))
def test_every_run_port_is_refused_as_the_service_port(port: int) -> None:
    got = problems(manifest({"service": {"api": "tinker", "port": port}}))
    assert any(line.startswith("spec.service.port:") for line in got), got
