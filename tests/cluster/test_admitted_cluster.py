"""Accepted means admitted, against the real API server: every object rendered from a generated table of
pod templates and service settings is either refused by the plan (`rljob validate`) or admitted by a
server-side dry run (dryRun=All) of the object and of the Jobs its JobSet will create; the hostile values of
tests/fixtures/hostile.py are each refused by the plan, and the pod-template ones would also be refused by
the API server (the plan's rules are Kubernetes' own, not stricter guesses)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from fixtures.cluster import Cluster
from fixtures.hostile import HOSTILE
from fixtures.recipes import manifest
from kubernetes import client, utils
from kubernetes.client.exceptions import ApiException
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


def _dry_run(c: Cluster, ns: str, obj: dict[str, Any]) -> str | None:
    """None when the API server admits `obj` (dry run), else its message."""
    obj = {**obj, "metadata": {**obj["metadata"], "namespace": ns}}
    try:
        if obj["kind"] == "JobSet":
            group, version = obj["apiVersion"].split("/")
            c.custom.create_namespaced_custom_object(group, version, ns, "jobsets", obj, dry_run="All")
            for _, job in jobs_of(obj):
                c.batch.create_namespaced_job(ns, job, dry_run="All")
        else:
            utils.create_from_dict(c.api, obj, namespace=ns, dry_run="All")
    except ApiException as e:
        return f"{obj['kind']}: {e.status} {e.body}"[:600]
    except utils.FailToCreateError as e:
        return f"{obj['kind']}: " + "; ".join(f"{x.status} {x.body}"[:600] for x in e.api_exceptions)
    return None


def _outcome(c: Cluster, ns: str, doc: dict[str, Any]) -> tuple[str, list[str]]:
    try:
        objs = render.render(RLJob.model_validate(doc))
    except plan.PlanError as e:
        return "refused", e.problems
    errors = [m for o in objs if (m := _dry_run(c, ns, o)) is not None]
    return ("admitted", []) if not errors else ("refused-by-api-server", errors)


# ------------------------------------------------------------------------------ the generated table

_NAMES = ["hf-token", "a.b-c", "Bad_Name", "", "x" * 254, "-lead"]
_KEYS = ["token", "a.b_c-D", "..", "..x", "a/b", "k" * 254, ".hidden"]
_SUBPATHS = [None, "a/b", "a..b", "../etc", "a/../b", "/abs"]
_QUANTITIES = ["1", "500m", "64Gi", "-1", "-5Gi", "0", "1e3", "1.5"]
_RESOURCES = ["cpu", "memory", "ephemeral-storage", "example.com/foo", "gpus", "kubernetes.io/x"]
_TOL_KEYS = [None, "cloud.google.com/gke-spot", "a key", "a/b/c", "x" * 64]
_OPERATORS = ["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt", "Bogus"]
_VALUES: list[list[str]] = [[], ["a"], ["1"], ["a", "b"], ["bad value"]]
_FIELD_PATHS = ["metadata.name", "status.podIP", "spec.containers[0].image", "metadata.labels['a']"]
_PORTS = [8080, 9000, 8482, 8000, 8001, 6379, 8476, 65535]
_QUEUES = [None, "team-a", "a.b", "a..b", "a-", "A"]
_MODES = [None, 0o644, 0o777, 4096, -1]


def _case(rng: random.Random) -> dict[str, Any]:
    pick = rng.choice
    volumes: list[dict[str, Any]] = [{"name": "scratch", "emptyDir": {"sizeLimit": pick(_QUANTITIES)}}]
    kind = pick(["secret", "configMap", "persistentVolumeClaim"])
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
    tol: dict[str, Any] = {"operator": pick(["Exists", "Equal"]), "effect": "NoSchedule"}
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
    spec: dict[str, Any] = {pick(["trainer", "sampler"]): {"template": template}}
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
    api_refused, pod_template = 0, 0
    for name, spec, field in HOSTILE:
        if ".template." not in field:
            continue
        pod_template += 1
        outcome, _ = _outcome(cluster, ns, manifest(spec, name="h"))
        api_refused += outcome == "refused-by-api-server"
        assert outcome != "admitted", f"{name}: the API server admits it; the plan's rule is stricter"
    print(f"pod-template hostile values the API server also refuses: {api_refused} of {pod_template}")
