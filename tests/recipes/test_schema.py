"""The JobSet CRD schema: extracted from the Go module sigs.k8s.io/jobset at JOBSET_VERSION, and it
catches broken JobSets. Regenerate: `.venv/bin/python hack/extract_jobset_schema.py` (needs go)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import MINIMAL, objects
from rljob.recipes import schema

REPO = Path(__file__).resolve().parents[2]


def test_version_pin_matches_versions_env() -> None:
    env = (REPO / "hack" / "versions.env").read_text(encoding="utf-8")
    assert f"JOBSET_VERSION={schema.JOBSET_VERSION}\n" in env
    assert schema.schema_document()["jobset"] == schema.JOBSET_VERSION


@pytest.mark.skipif(shutil.which("go") is None, reason="go is not installed")
def test_committed_schema_matches_module() -> None:
    try:
        out = subprocess.run(
            ["go", "mod", "download", "-json", f"sigs.k8s.io/jobset@{schema.JOBSET_VERSION}"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/tmp",
        )
    except subprocess.TimeoutExpired:
        pytest.skip("go mod download timed out")
    if out.returncode != 0:
        pytest.skip(f"module not downloadable here: {out.stderr.strip()[:200]}")
    crd = Path(json.loads(out.stdout)["Dir"]) / "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "extract_jobset_schema.py"), "--check", "--crd", str(crd)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _jobset() -> dict[str, Any]:
    return objects(MINIMAL)[-1]


def test_render_is_valid() -> None:
    assert schema.validate_jobset(_jobset()) == []


def _set(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    *parents, last = path.split(".")
    node: Any = obj
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is _DELETE:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return obj


_DELETE = object()

# Deliberately broken JobSets the schema must catch: (path, value, expected error path)
BROKEN = [
    ("spec.replicatedJobs.0.replicas", "one", "spec.replicatedJobs[0].replicas"),
    ("spec.failurePolicy.restartStrategy", "Sometimes", "spec.failurePolicy.restartStrategy"),
    ("spec.failurePolicy.rules.0.action", "RestartEverything", "spec.failurePolicy.rules[0].action"),
    ("spec.failurePolicy.rules.0.name", _DELETE, "spec.failurePolicy.rules[0]"),
    ("spec.successPolicy.operator", "Most", "spec.successPolicy.operator"),
    ("spec.replicatedJobs.0.name", _DELETE, "spec.replicatedJobs[0]"),
    (
        "spec.replicatedJobs.0.template.spec.template.spec.containers",
        _DELETE,
        "spec.replicatedJobs[0].template.spec.template.spec",
    ),
    (
        "spec.replicatedJobs.0.template.spec.template.spec.containers.0.name",
        _DELETE,
        "spec.replicatedJobs[0].template.spec.template.spec.containers[0]",
    ),
    (
        "spec.replicatedJobs.0.template.spec.parallelism",
        "4",
        "spec.replicatedJobs[0].template.spec.parallelism",
    ),
    ("spec.network.enableDNSHostnames", "yes", "spec.network.enableDNSHostnames"),
    ("spec.coordinator.jobIndex", "0", "spec.coordinator.jobIndex"),
    (
        "spec.replicatedJobs.0.template.spec.podFailurePolicy.rules.1.onExitCodes.values",
        2,
        "spec.replicatedJobs[0].template.spec.podFailurePolicy.rules[1].onExitCodes.values",
    ),
    # fields the API server would prune silently: typos and fields of another version
    (
        "spec.replicatedJobs.0.template.spec.template.spec.nodeSelectors",
        {},
        "spec.replicatedJobs[0].template.spec.template.spec",
    ),
    ("spec.failurePolicy.onJobFailureReason", [], "spec.failurePolicy"),
    ("spec.replicatedJob", [], "spec"),
    ("spec.startupPolicy.startupPolicyOrder", "Random", "spec.startupPolicy.startupPolicyOrder"),
]


@pytest.mark.parametrize(("path", "value", "where"), BROKEN)
def test_broken_jobsets_are_caught(path: str, value: Any, where: str) -> None:
    problems = schema.validate_jobset(_set(_jobset(), path, value))
    assert problems, f"{path}={value!r} passed the schema"
    assert any(p.startswith(where + ":") for p in problems), problems


def _cel_rules(node: Any, path: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if isinstance(node, dict):
        out += [(path, r["rule"]) for r in node.get("x-kubernetes-validations", [])]
        for k, v in node.items():
            out += _cel_rules(v, path if k in ("properties", "items") else f"{path}.{k}")
    elif isinstance(node, list):
        for v in node:
            out += _cel_rules(v, path)
    return out


def test_cel_rules_known_and_kept() -> None:
    """The schema's CEL rules are not evaluated by jsonschema: pin the set (a JobSet upgrade that adds one
    fails here) and check the create-time ones on our render by hand."""
    rules = _cel_rules(schema.schema_document()["schema"])
    transition = [r for r in rules if r[1] == "self == oldSelf"]
    create = [r for r in rules if r not in transition]
    assert len(transition) == 6
    assert [p for p, _ in create] == [".spec", ".spec.volumeClaimPolicies"]
    js = _jobset()
    in_order = js["spec"]["startupPolicy"]["startupPolicyOrder"] == "InOrder"
    assert not (in_order and any("dependsOn" in rj for rj in js["spec"]["replicatedJobs"]))
    assert "volumeClaimPolicies" not in js["spec"]
