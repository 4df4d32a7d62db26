"""The compile preflight (spec.trainer.preflight.compile) in the reconcile: its Job first and no JobSet; the
JobSet once the Job succeeded; a refusal (exit 2) or a failure as a condition and a Warning event, never a
JobSet. Real RLJob bodies, the real render and status logic, an in-memory API (fixtures.memkube); the
Job controller's status is written by the test as the controller writes it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fixtures.memkube import MemoryKube, run, setup
from fixtures.operator import stored_rljob
from rljob.operator import conditions as c
from rljob.operator.reconcile import Reconciler
from rljob.operator.status.preflight import PreflightPod, PreflightView, preflight_outcome, preflight_pod
from rljob.recipes.api import PreflightState

KEY = ("ns", "demo")
REFUSAL = [
    "compile: accumulate needs 120.0 GiB per device of a v5p-8 device's 95 GiB HBM "
    "(spec.packing.tokenBudget, spec.trainer.microBatchSize); about spec.packing.tokenBudget 4096 (now 8192) "
    "would fit",
    "compile: parity_logprobs needs 99.0 GiB per device of a v5p-8 device's 95 GiB HBM (spec.trainer.tpu)",
]


def rljob(**spec: Any) -> dict[str, Any]:
    body = stored_rljob(**spec)
    body["spec"]["trainer"]["preflight"] = {"compile": True}
    return body


def kinds(kube: MemoryKube, verbs: tuple[str, ...] = ("create", "apply")) -> list[str]:
    return [w[1] for w in kube.writes if w[0] in verbs]


def preflight_job(kube: MemoryKube) -> dict[str, Any]:
    (job,) = [o for (kind, _, _), o in kube.objects.items() if kind == "Job"]
    return job


def status(kube: MemoryKube) -> dict[str, Any]:
    return dict(kube.objects[("RLJob", *KEY)]["status"])


def ready(kube: MemoryKube) -> dict[str, Any]:
    return next(x for x in status(kube)["conditions"] if x["type"] == c.READY)


def finish(rec: Reconciler, kube: MemoryKube, condition: dict[str, str]) -> None:
    """The Job controller's last status write of the preflight Job, seen by the operator's watch."""
    job = preflight_job(kube)
    job["status"] = {"conditions": [{"status": "True", **condition}]}
    job["metadata"]["resourceVersion"] = str(int(job["metadata"]["resourceVersion"]) + 1000)
    rec.observe_preflight("MODIFIED", copy.deepcopy(job))


def failed_pod(job: str, code: int, message: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{job}-abcde",
            "namespace": "ns",
            "labels": {c.LABEL_NAME: "demo", c.PREFLIGHT_LABEL: "true", c.JOB_NAME_LABEL: job},
        },
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"name": "compile", "state": {"terminated": {"exitCode": code, "message": message}}}
            ],
        },
    }


def exit_condition(job: str, code: int) -> dict[str, str]:
    """The Failed condition of the pod failure policy's FailJob rule (exit 2), or of backoffLimit 0."""
    if code == 2:
        message = (
            f"Container compile for pod ns/{job}-abcde failed with exit code 2 matching FailJob rule at "
        )
        message += "index 0"
        return {"type": "Failed", "reason": "PodFailurePolicy", "message": message}
    return {
        "type": "Failed",
        "reason": "BackoffLimitExceeded",
        "message": "Job has reached the specified backoff limit",
    }


def started() -> tuple[Reconciler, MemoryKube, str]:
    rec, kube = setup(rljob())
    run(rec.reconcile(KEY))
    return rec, kube, preflight_job(kube)["metadata"]["name"]


def test_preflight_on_creates_the_job_and_no_jobset() -> None:
    rec, kube, name = started()
    assert name.startswith("demo-compile-") and len(name) == len("demo-compile-") + 8
    # The run's objects first (the Job's pod mounts the run ConfigMap), the Job last; no JobSet. The JobSet's
    # Jobs were dry-run before anything was created (a refused pod is known before 20 CPU-minutes are spent).
    assert kinds(kube)[-1] == "Job" and "JobSet" not in kinds(kube) and "ConfigMap" in kinds(kube)
    assert kinds(kube, ("dry-run",)) == ["Job", "Job"]
    job = preflight_job(kube)
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    pod = job["spec"]["template"]["spec"]
    # No TPU, no TPU node: the nodes the pod policy names (by default those running the GKE metadata server,
    # where 169.254.169.254 answers as the run's ServiceAccount, never as the node's).
    assert "google.com/tpu" not in str(pod) and "tolerations" not in pod
    assert pod["nodeSelector"] == {"iam.gke.io/gke-metadata-server-enabled": "true"}
    assert pod["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    st = status(kube)
    assert st["phase"] == "Pending" and st["preflight"] == {"job": name, "state": "Running"}
    assert (ready(kube)["status"], ready(kube)["reason"]) == ("False", c.REASON_PREFLIGHT_RUNNING)
    assert kube.posted == [("Normal", c.EVENT_PREFLIGHT_CREATED, kube.posted[0][2])]
    # Nothing changed: the next reconcile writes nothing (the Job is not created twice).
    before = len(kube.writes)
    run(rec.reconcile(KEY))
    assert kube.writes[before:] == []


def test_the_jobset_is_created_once_the_job_succeeded() -> None:
    rec, kube, _ = started()
    finish(rec, kube, {"type": "Complete"})
    run(rec.reconcile(KEY))
    assert kinds(kube).count("JobSet") == 1 and kinds(kube).count("Job") == 1
    assert status(kube)["preflight"]["state"] == "Succeeded"
    assert kube.posted[-1][:2] == ("Normal", c.EVENT_JOBSET_CREATED)


@pytest.mark.parametrize("with_pod", [True, False], ids=["pod seen", "Job only"])
def test_a_refusal_is_a_condition_and_a_warning_and_never_a_jobset(with_pod: bool) -> None:
    rec, kube, name = started()
    if with_pod:
        rec.observe_pod("MODIFIED", failed_pod(name, 2, "\n".join(REFUSAL) + "\n"))
    finish(rec, kube, exit_condition(name, 2))
    run(rec.reconcile(KEY))
    assert "JobSet" not in kinds(kube)
    st = status(kube)
    assert st["phase"] == "Pending" and st["preflight"]["state"] == "DoesNotFit"
    cond = ready(kube)
    assert (cond["status"], cond["reason"]) == ("False", c.REASON_COMPILE_DOES_NOT_FIT)
    want = "\n".join(REFUSAL) if with_pod else f"Job {name}: {exit_condition(name, 2)['message']}"
    assert cond["message"] == want[:1024] and st["preflight"]["message"] == want
    assert kube.posted[-1] == ("Warning", c.REASON_COMPILE_DOES_NOT_FIT, want[:1024])
    assert "demo" not in {k[1] for k in rec.caches.failures}  # the pod is not a failure of a JobSet
    # Once: the next reconcile posts nothing and creates nothing.
    before = len(kube.writes)
    run(rec.reconcile(KEY))
    assert kube.writes[before:] == []


def test_another_failure_has_its_own_reason_and_the_log_tail() -> None:
    rec, kube, name = started()
    rec.observe_pod("MODIFIED", failed_pod(name, 1, "Traceback (most recent call last):\nValueError: boom\n"))
    finish(rec, kube, exit_condition(name, 1))
    run(rec.reconcile(KEY))
    assert "JobSet" not in kinds(kube)
    cond = ready(kube)
    assert (cond["status"], cond["reason"]) == ("False", c.REASON_PREFLIGHT_FAILED)
    assert cond["message"].startswith(f"Job {name} failed with exit code 1 (BackoffLimitExceeded: ")
    assert cond["message"].endswith("ValueError: boom")
    assert kube.posted[-1][:2] == ("Warning", c.REASON_PREFLIGHT_FAILED)


def test_a_finished_job_deleted_by_its_ttl_is_not_run_again_a_running_one_is() -> None:
    rec, kube, name = started()
    finish(rec, kube, exit_condition(name, 2))
    run(rec.reconcile(KEY))
    job = kube.objects.pop(("Job", "ns", name))
    rec.observe_preflight("DELETED", job)
    run(rec.reconcile(KEY))
    assert kinds(kube).count("Job") == 1 and status(kube)["preflight"]["state"] == "DoesNotFit"

    rec, kube, name = started()  # a running Job deleted (by hand): the reconcile creates it again
    job = kube.objects.pop(("Job", "ns", name))
    rec.observe_preflight("DELETED", job)
    run(rec.reconcile(KEY))
    assert kinds(kube).count("Job") == 2 and "JobSet" not in kinds(kube)


def test_what_is_compiled_names_the_job_suspend_does_not() -> None:
    rec, kube, name = started()
    finish(rec, kube, exit_condition(name, 2))
    run(rec.reconcile(KEY))
    body = copy.deepcopy(kube.objects[("RLJob", *KEY)])
    body["metadata"].update(generation=2, resourceVersion="5000")
    body["spec"]["suspend"] = True  # compiles nothing: the refusal stands
    kube.objects[("RLJob", *KEY)] = copy.deepcopy(body)
    rec.observe_rljob("MODIFIED", body)
    run(rec.reconcile(KEY))
    assert kinds(kube).count("Job") == 1 and ready(kube)["reason"] == c.REASON_COMPILE_DOES_NOT_FIT
    body = copy.deepcopy(kube.objects[("RLJob", *KEY)])
    body["metadata"].update(generation=3, resourceVersion="6000")
    body["spec"]["trainer"]["maxtext"] = {"remat_policy": "full"}  # another program: a new preflight Job
    kube.objects[("RLJob", *KEY)] = copy.deepcopy(body)
    rec.observe_rljob("MODIFIED", body)
    run(rec.reconcile(KEY))
    jobs = [w[3] for w in kube.writes if w[:2] == ("create", "Job")]
    assert len(jobs) == 2 and jobs[0] == name and jobs[1] != name
    assert status(kube)["preflight"] == {"job": jobs[1], "state": "Running"}
    assert ready(kube)["reason"] == c.REASON_PREFLIGHT_RUNNING


def test_off_creates_no_job() -> None:
    rec, kube = setup(stored_rljob())
    run(rec.reconcile(KEY))
    assert "Job" not in kinds(kube) and kinds(kube)[-1] == "JobSet"
    assert "preflight" not in status(kube)


VIEW = PreflightView(name="j", uid="u", resource_version="1")


@pytest.mark.parametrize(
    ("view", "pod", "state", "message"),
    [
        (VIEW, None, PreflightState.RUNNING, None),
        (PreflightView("j", "u", "2", succeeded=True), None, PreflightState.SUCCEEDED, "every program fits"),
        (
            PreflightView("j", "u", "2", failed=True, reason="PodFailurePolicy", message="m", exit_code=2),
            PreflightPod("j", 2, "a\n\nb\n"),
            PreflightState.DOES_NOT_FIT,
            "a\nb",
        ),
        # Another Job's pod (an earlier preflight of the run) does not speak for this one.
        (
            PreflightView("j", "u", "2", failed=True, reason="PodFailurePolicy", message="m", exit_code=2),
            PreflightPod("old", 2, "a"),
            PreflightState.DOES_NOT_FIT,
            "Job j: m",
        ),
        (
            PreflightView("j", "u", "2", failed=True, reason="DeadlineExceeded", message="m"),
            None,
            PreflightState.FAILED,
            "Job j failed (DeadlineExceeded: m)",
        ),
        (
            PreflightView("j", "u", "2", failed=True, reason="BackoffLimitExceeded", message="m"),
            PreflightPod("j", 137, "", "8Gi"),
            PreflightState.FAILED,
            "spec.trainer.preflight.memory: Job j's compile ran out of the pod's memory of 8Gi (OOMKilled): "
            'give a new RLJob more (the spec is immutable; docs/operator.md, "The compile preflight", says '
            "what a compile uses)",
        ),
        (
            PreflightView("j", "u", "2", failed=True, reason="BackoffLimitExceeded", message="m"),
            PreflightPod("j", 137, "killed"),
            PreflightState.FAILED,
            "Job j failed with exit code 137 (BackoffLimitExceeded: m): killed",
        ),
    ],
    ids=["running", "succeeded", "refused", "another job's pod", "no exit code", "out of memory", "killed"],
)
def test_preflight_outcome(
    view: PreflightView, pod: PreflightPod | None, state: str, message: str | None
) -> None:
    got = preflight_outcome(view, pod)
    assert (got.job, got.state, got.message) == ("j", state, message)


def test_preflight_pod_and_job_views_read_what_the_controllers_write() -> None:
    assert preflight_pod({"status": {"phase": "Running"}}) is None
    evicted = {
        "metadata": {"name": "p", "labels": {c.JOB_NAME_LABEL: "j"}},
        "status": {"phase": "Failed", "reason": "Evicted", "message": "low memory"},
    }
    assert preflight_pod(evicted) == PreflightPod("j", None, "pod p: Evicted: low memory")
    oom = {
        "metadata": {"name": "p", "labels": {c.JOB_NAME_LABEL: "j"}},
        "spec": {"containers": [{"name": "preflight", "resources": {"limits": {"memory": "8Gi"}}}]},
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}],
        },
    }
    assert preflight_pod(oom) == PreflightPod("j", 137, "", "8Gi")
    error = {
        **oom,
        "status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 1}}}]},
    }
    assert preflight_pod(error) == PreflightPod("j", 1, "", None)
    view = PreflightView.from_body(
        {"metadata": {"name": "j"}, "status": {"conditions": [{"status": "True", **exit_condition("j", 2)}]}}
    )
    assert (view.failed, view.exit_code, view.succeeded) == (True, 2, False)
    view = PreflightView.from_body(
        {"metadata": {"name": "j"}, "status": {"conditions": [{"status": "False", "type": "Failed"}]}}
    )
    assert not view.failed
