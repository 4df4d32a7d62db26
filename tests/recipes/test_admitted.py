"""Accepted means admitted: values the API server, Kueue or Cloud Storage would refuse are refused by the
plan with the field named (tests/fixtures/hostile.py), and Kubernetes' own rules (rljob.recipes.k8s_rules)
agree with apimachinery's on the edge cases."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.hostile import HOSTILE
from fixtures.recipes import manifest, problems
from rljob.recipes import k8s_rules, run_checks


@pytest.mark.parametrize(("name", "spec", "field"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_each_hostile_value_is_refused_with_its_field(name: str, spec: dict[str, Any], field: str) -> None:
    got = problems(manifest(spec))
    assert any(line.startswith(field) for line in got), got
    assert all(line.startswith("spec.") and "\n" not in line for line in got), got


def test_the_good_values_stay_accepted() -> None:
    good = {
        "trainer": {
            "template": {
                "spec": {
                    "env": [
                        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "tok.en_1"}}}
                    ],
                    "volumes": [
                        {"name": "v", "emptyDir": {"sizeLimit": "10Gi"}},
                        {
                            "name": "s",
                            "secret": {"secretName": "s.a-b", "items": [{"key": "k", "path": "a/b"}]},
                        },
                    ],
                    "volumeMounts": [{"name": "v", "mountPath": "/data/v", "subPath": "a..b/c"}],
                    "resources": {"requests": {"example.com/foo": "2"}, "limits": {"example.com/foo": 2}},
                    "tolerations": [{"key": "a.b/c", "operator": "Exists"}],
                }
            }
        },
        "queueName": "team-a.gpu",
        "storage": {"root": "gs://my_bucket-1.example/runs"},
    }
    assert problems(manifest(good)) == []


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("a", True),
        ("example.com/a_b.c", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("a key", False),
        ("/a", False),
        ("A.com/x", False),
        ("a/b/c", False),
        ("-a", False),
        ("", False),
    ],
)
def test_qualified_name(value: str, ok: bool) -> None:
    assert (k8s_rules.qualified_name(value) is None) is ok


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("k", True),
        ("a.b-c_D", True),
        (".x", True),
        ("..x", False),
        ("..", False),
        ("a/b", False),
        ("k" * 254, False),
    ],
)
def test_config_key(value: str, ok: bool) -> None:
    assert (k8s_rules.config_key(value) is None) is ok


@pytest.mark.parametrize(
    ("value", "ok"),
    [("a/b", True), ("a..b", True), ("..", False), ("a/../b", False), ("/abs", False), ("a/..", False)],
)
def test_descending_path(value: str, ok: bool) -> None:
    assert (k8s_rules.descending_path(value) is None) is ok


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
