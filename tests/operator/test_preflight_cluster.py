"""The compile preflight (spec.trainer.preflight.compile) through the real API server, Job controller and
chart RBAC: the operator creates the preflight Job and no JobSet; the kwok stand-in kubelet runs its pod,
and the test ends the pod as compilecheck would (exit 2 with the refusal lines as its termination message,
or exit 0); the Job controller's pod failure policy fails the Job. No compile runs here: the pod's image
is not pulled (tests/trainer/test_compilecheck.py compiles)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fixtures.cluster import Cluster, fail_pod, wait_for
from fixtures.k8s import as_dict
from fixtures.operator import OperatorProcess, create_rljob, get_rljob, manifest, wait_rljob
from rljob.operator import conditions as c
from rljob.recipes import podpolicy

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600, func_only=True)]

REFUSAL = (
    "compile: accumulate needs 120.0 GiB per device of a v5p-8 device's 95 GiB HBM (spec.trainer.tpu)\n"
    "compile: parity_logprobs needs 99.0 GiB per device of a v5p-8 device's 95 GiB HBM (spec.trainer.tpu)"
)


def _with_preflight(name: str, namespace: str) -> dict[str, Any]:
    body = manifest(name, namespace)
    body["spec"]["trainer"]["preflight"] = {"compile": True}
    return body


def _jobset(cl: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    found = as_dict(cl.custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", ns, "jobsets"))
    return next((j for j in found["items"] if j["metadata"]["name"] == name), None)


def _json(cl: Cluster, obj: object) -> dict[str, Any]:
    """A typed client object as the API's JSON (camelCase keys)."""
    return as_dict(cl.api.sanitize_for_serialization(obj))  # type: ignore[no-untyped-call]


def _preflight_pod(cl: Cluster, ns: str, name: str) -> dict[str, Any]:
    """The preflight Job's pod once kwok runs it."""

    def running() -> dict[str, Any] | None:
        selector = f"{c.PREFLIGHT_LABEL}=true,{c.LABEL_NAME}={name}"
        found = [_json(cl, p) for p in cl.core.list_namespaced_pod(ns, label_selector=selector).items]
        return next((p for p in found if p["status"].get("phase") == "Running"), None)

    got: dict[str, Any] = wait_for(running, 90, "a Running preflight pod")
    return got


def _ready(status: dict[str, Any]) -> dict[str, Any]:
    return next((x for x in status.get("conditions") or [] if x["type"] == c.READY), {})


def test_a_refusal_creates_no_jobset_and_says_why(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    create_rljob(cluster, _with_preflight("pfno", namespace))
    pod = _preflight_pod(cluster, namespace, "pfno")
    # The pod: CPU only, the trainer image, owned by the preflight Job the RLJob owns, on the nodes the pod
    # policy names (by default those that run GKE's metadata server: the node's own identity stays out).
    container = pod["spec"]["containers"][0]
    assert "google.com/tpu" not in container["resources"]["requests"]
    assert pod["spec"]["nodeSelector"] == {podpolicy.METADATA_SERVER_LABEL: "true"}
    job_name = pod["metadata"]["labels"][c.JOB_NAME_LABEL]
    job = _json(cluster, cluster.batch.read_namespaced_job(job_name, namespace))
    assert job["metadata"]["ownerReferences"][0]["name"] == "pfno"
    status = wait_rljob(
        cluster,
        namespace,
        "pfno",
        60,
        "PreflightCompiling",
        lambda s: _ready(s).get("reason") == c.REASON_PREFLIGHT_RUNNING,
    )["status"]
    assert status["phase"] == "Pending" and _jobset(cluster, namespace, "pfno") is None

    fail_pod(cluster, namespace, pod["metadata"]["name"], 2, message=REFUSAL)
    status = wait_rljob(
        cluster,
        namespace,
        "pfno",
        90,
        "CompileDoesNotFit",
        lambda s: (
            _ready(s).get("reason") == c.REASON_COMPILE_DOES_NOT_FIT
            and "parity_logprobs" in _ready(s)["message"]
        ),
    )["status"]
    assert _ready(status)["message"] == REFUSAL and status["preflight"]["state"] == "DoesNotFit"
    # The Job controller failed the Job by its pod failure policy (exit 2), not by a retry.
    job = _json(cluster, cluster.batch.read_namespaced_job(job_name, namespace))
    failed = next(x for x in job["status"]["conditions"] if x["type"] == "Failed" and x["status"] == "True")
    assert failed["reason"] == "PodFailurePolicy" and "exit code 2" in failed["message"]
    events = cluster.core.list_namespaced_event(namespace, field_selector="involvedObject.name=pfno").items
    assert any(e.reason == c.REASON_COMPILE_DOES_NOT_FIT and e.type == "Warning" for e in events), [
        e.reason for e in events
    ]
    time.sleep(5)  # a few reconciles later: still no JobSet, no second Job
    assert _jobset(cluster, namespace, "pfno") is None
    jobs = cluster.batch.list_namespaced_job(namespace, label_selector=f"{c.LABEL_NAME}=pfno").items
    assert len(jobs) == 1
    assert get_rljob(cluster, namespace, "pfno")["status"]["phase"] == "Pending"


def test_the_jobset_comes_after_the_preflight_succeeded(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    create_rljob(cluster, _with_preflight("pfok", namespace))
    pod = _preflight_pod(cluster, namespace, "pfok")
    assert _jobset(cluster, namespace, "pfok") is None
    fail_pod(cluster, namespace, pod["metadata"]["name"], 0)
    js = wait_for(lambda: _jobset(cluster, namespace, "pfok"), 90, "the JobSet")
    assert js["metadata"]["ownerReferences"][0]["name"] == "pfok"
    status = wait_rljob(
        cluster,
        namespace,
        "pfok",
        30,
        "preflight Succeeded",
        lambda s: (s.get("preflight") or {}).get("state") == "Succeeded",
    )["status"]
    assert status["jobSetName"] == "pfok"
