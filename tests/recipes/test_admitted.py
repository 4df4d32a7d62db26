"""Accepted means admitted: values the API server, Kueue or Cloud Storage would refuse are refused by the
plan with the field named (tests/fixtures/hostile.py), and Kubernetes' own rules (rljob.recipes.k8s_rules)
agree with apimachinery's on the edge cases (tests/recipes/test_k8s_rules.py)."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.hostile import HOSTILE
from fixtures.recipes import manifest, problems


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
