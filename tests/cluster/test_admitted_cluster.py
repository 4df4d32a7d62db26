"""Accepted means admitted, against the real API server: every object rendered from a generated table of
pod templates and service settings is either refused by the plan (`rljob validate`) or admitted by a
server-side dry run (dryRun=All) of the object and of the Jobs its JobSet will create; the hostile values of
tests/fixtures/hostile.py are each refused by the plan, and the pod-template ones would also be refused by
the API server (the plan's rules are Kubernetes' own, not stricter guesses)."""

from __future__ import annotations

import random
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest
import yaml
from fixtures.cluster import REPO, Cluster
from fixtures.hostile import HOSTILE
from fixtures.recipes import manifest
from kubernetes import client
from rljob.operator.reconcile import jobs_of
from rljob.recipes import k8s_rules, plan, render
from rljob.recipes.api import RLJob

pytestmark = pytest.mark.cluster


@pytest.fixture
def ns(cluster: Cluster) -> Iterator[str]:
    """A namespace of its own; unlike the shared `namespace` fixture it does not wait for the default
    ServiceAccount (dry runs of Jobs and JobSets do not need it; pods do)."""
    name = f"t-admitted-{uuid.uuid4().hex[:8]}"
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        yield name
    finally:
        cluster.core.delete_namespace(name)


CASES = 120
NEVER_EXISTS = frozenset({"secret-name", "secret-volume-name"})
"""Hostile values the API server admits but that name an object no namespace can hold."""
KUBECTL = REPO / "hack" / "bin" / "kubectl"


def _dry_run(c: Cluster, ns: str, objs: list[dict[str, Any]]) -> str | None:
    """None when the API server admits every object and the Jobs of its JobSet (kubectl create
    --dry-run=server: validation and admission, nothing persisted), else kubectl's errors."""
    docs = []
    for obj in objs:
        obj = {**obj, "metadata": {**obj["metadata"], "namespace": ns}}
        docs.append(obj)
        if obj["kind"] == "JobSet":
            docs += [job for _, job in jobs_of(obj)]
    out = subprocess.run(
        [
            str(KUBECTL),
            "--kubeconfig",
            str(c.kubeconfig),
            "create",
            "--dry-run=server",
            "-o",
            "name",
            "-f",
            "-",
        ],
        input=yaml.safe_dump_all(docs),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return None if out.returncode == 0 else out.stderr.strip()[:2000]


def _outcome(c: Cluster, ns: str, doc: dict[str, Any]) -> tuple[str, list[str]]:
    try:
        objs = render.render(RLJob.model_validate(doc))
    except plan.PlanError as e:
        return "refused", e.problems
    except pydantic.ValidationError as e:  # the API's own patterns (the CRD refuses the same)
        return "refused", [str(e)]
    error = _dry_run(c, ns, objs)
    return ("admitted", []) if error is None else ("refused-by-api-server", [error])


# ------------------------------------------------------------------------------ the generated table

_NAMES = ["hf-token", "a.b-c", "Bad_Name", "", "x" * 254, "-lead"]
_KEYS = ["token", "a.b_c-D", "..", "..x", "a/b", "k" * 254, ".hidden"]
_SUBPATHS = [None, "a/b", "a..b", "../etc", "a/../b", "/abs"]
_QUANTITIES = ["1", "500m", "64Gi", "-1", "-5Gi", "0", "1e3", "1.5"]
_RESOURCES = ["cpu", "memory", "ephemeral-storage", "example.com/foo", "gpus", "kubernetes.io/x"]
_TOL_KEYS = ["cloud.google.com/gke-spot", None, "a key", "a/b/c", "x" * 64]
_OPERATORS = ["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt", "Bogus"]
_VALUES: list[list[str]] = [["a"], [], ["1"], ["a", "b"], ["bad value"]]
_FIELD_PATHS = ["metadata.name", "status.podIP", "spec.containers[0].image", "metadata.labels['a']"]
_PORTS = [8080, 9000, 8482, 8000, 8001, 6379, 8476, 65535]
_QUEUES = [None, "team-a", "a.b", "a..b", "a-", "A"]
_MODES = [None, 0o644, 0o777, 4096, -1]


def _case(rng: random.Random) -> dict[str, Any]:
    def pick(pool: list[Any]) -> Any:
        """The first (valid) value of a pool most of the time, so that some cases are valid throughout."""
        return pool[0] if rng.random() < 0.8 else rng.choice(pool)

    volumes: list[dict[str, Any]] = [{"name": "scratch", "emptyDir": {"sizeLimit": pick(_QUANTITIES)}}]
    kind = rng.choice(["secret", "configMap", "persistentVolumeClaim"])
    if kind == "secret":
        src: dict[str, Any] = {
            "secretName": pick(_NAMES),
            "items": [{"key": pick(_KEYS), "path": pick(["a", "../a", "a/b"])}],
        }
        if (mode := pick(_MODES)) is not None:
            src["defaultMode"] = mode
        volumes.append({"name": "extra", "secret": src})
    elif kind == "configMap":
        volumes.append({"name": "extra", "configMap": {"name": pick(_NAMES)}})
    else:
        volumes.append({"name": "extra", "persistentVolumeClaim": {"claimName": pick(_NAMES)}})
    mount: dict[str, Any] = {"name": pick(["scratch", "extra"]), "mountPath": "/data"}
    if (sub := pick(_SUBPATHS)) is not None:
        mount["subPath"] = sub
    res = pick(_RESOURCES)
    resources: dict[str, Any] = {pick(["requests", "limits"]): {res: pick(_QUANTITIES)}}
    if rng.random() < 0.5:
        resources.setdefault("limits", {})[res] = pick(_QUANTITIES)
    tol: dict[str, Any] = {"operator": pick(["Equal", "Exists"]), "effect": "NoSchedule"}
    if (key := pick(_TOL_KEYS)) is not None:
        tol["key"] = key
    if tol["operator"] == "Equal":
        tol["value"] = pick(["true", "bad value"])
    expr: dict[str, Any] = {"key": pick(["a", "example.com/b", "bad key"]), "operator": pick(_OPERATORS)}
    if values := pick(_VALUES):
        expr["values"] = values
    env = [
        {"name": "S", "valueFrom": {"secretKeyRef": {"name": pick(_NAMES), "key": pick(_KEYS)}}},
        {"name": "F", "valueFrom": {"fieldRef": {"fieldPath": pick(_FIELD_PATHS)}}},
    ]
    template = {
        "spec": {
            "env": env,
            "envFrom": [{"prefix": "APP_", "configMapRef": {"name": pick(_NAMES)}}],
            "volumes": volumes,
            "volumeMounts": [mount],
            "resources": resources,
            "tolerations": [tol],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [expr]}]
                    }
                }
            },
        }
    }
    spec: dict[str, Any] = {rng.choice(["trainer", "sampler"]): {"template": template}}
    if rng.random() < 0.5:
        spec["service"] = {"api": "tinker", "port": pick(_PORTS)}
    if (queue := pick(_QUEUES)) is not None:
        spec["queueName"] = queue
    return spec


def _cases() -> Iterator[tuple[int, dict[str, Any]]]:
    rng = random.Random(20261205)
    for i in range(CASES):
        yield i, _case(rng)


def test_every_rendered_object_is_refused_by_validate_or_admitted(cluster: Cluster, ns: str) -> None:
    counts = {"refused": 0, "admitted": 0, "refused-by-api-server": 0}
    escaped: list[str] = []
    for i, spec in _cases():
        outcome, detail = _outcome(cluster, ns, manifest(spec, name=f"f{i}"))
        counts[outcome] += 1
        if outcome == "refused-by-api-server":
            escaped.append(f"case {i}: {spec}\n  " + "\n  ".join(detail))
    print(f"\nfuzz: {CASES} cases: {counts}")
    assert not escaped, "\n".join(escaped[:5])
    assert counts["admitted"] >= 5 and counts["refused"] >= 5, counts  # the table exercises both sides


def test_hostile_values_are_refused_and_the_api_server_agrees(
    cluster: Cluster, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each hostile value is refused by the plan; with the Kubernetes rules switched off, the pod-template
    ones render and the API server's dry run refuses the Jobs (so the rules are not stricter than it)."""
    tried = refused = 0
    for _name, spec, field in HOSTILE:
        tried += 1
        try:
            plan.resolve(RLJob.model_validate(manifest(spec, name="h")))
        except plan.PlanError as e:
            refused += any(p.startswith(field) for p in e.problems)
    print(f"\nhostile: tried {tried}, refused {refused}, admitted {tried - refused}")
    assert refused == tried

    for fn in ("env_value_from", "env_from", "volume", "resources", "toleration", "affinity"):
        monkeypatch.setattr(k8s_rules, fn, lambda *a, **k: [])
    monkeypatch.setattr(k8s_rules, "sub_path", lambda *a, **k: [])
    outcomes: dict[str, str] = {}
    for name, spec, field in HOSTILE:
        if ".template." in field:
            outcomes[name] = _outcome(cluster, ns, manifest(spec, name="h"))[0]
    admitted = sorted(n for n, o in outcomes.items() if o == "admitted")
    refused_too = len(outcomes) - len(admitted)
    print(f"pod-template hostile values the API server also refuses: {refused_too} of {len(outcomes)}")
    print(f"admitted by it (the plan refuses them): {admitted}")
    # Kubernetes checks only that a volume's or a key selector's Secret name is set; the plan also refuses
    # names no Secret can have (the pod would never start). Every other value the API server refuses too.
    assert set(admitted) <= NEVER_EXISTS, admitted
