"""The operator on the local cluster: chart installed by helm, operator running as the chart's ServiceAccount.

Every test gets its own namespace; the operator (tests/fixtures/operator.py) is shared by the session.
"""

from __future__ import annotations

import functools
import random
import signal
import threading
import time
from typing import Any

import pytest
from fixtures.cluster import Cluster, deleted_node, fail_pod, wait_for
from fixtures.k8s import as_dict, error_body, exit_codes, labels_of, name_of, owners_of, spec_of
from fixtures.operator import (
    GROUP,
    PLURAL,
    VERSION,
    OperatorProcess,
    create_rljob,
    get_rljob,
    manifest,
    patch_rljob,
    pods_of,
    running_pods,
    wait_phase,
    wait_rljob,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600, func_only=True)]


def _running(c: Cluster, ns: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = wait_phase(c, ns, name, "Running", timeout=120)["status"]
    assert status["roles"]["trainer"]["ready"] == status["roles"]["trainer"]["total"] >= 1
    assert status["roles"]["sampler"]["ready"] == status["roles"]["sampler"]["total"] >= 1
    return status


def _wait_ready_reason(c: Cluster, ns: str, name: str, reason: str, timeout: float) -> dict[str, Any]:
    """The RLJob's Ready condition once its reason is ``reason``."""

    def ready() -> dict[str, Any] | None:
        status = (get_rljob(c, ns, name) or {}).get("status") or {}
        cond = next((x for x in status.get("conditions") or [] if x["type"] == "Ready"), None)
        return cond if cond and cond.get("reason") == reason else None

    got: dict[str, Any] = wait_for(ready, timeout, f"Ready=False {reason}")
    return got


def _trainer_pod(c: Cluster, ns: str, name: str) -> Any:
    return wait_for(
        lambda: next(iter(running_pods(c, ns, name, "trainer")), None), 60, "a Running trainer pod"
    )


def test_lifecycle_to_succeeded_and_latched(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    create_rljob(cluster, manifest("life", namespace))
    js = wait_for(lambda: _get_jobset(cluster, namespace, "life"), 60, "the JobSet")
    owner = js["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("RLJob", "life", True)
    managers = {m["manager"] for m in js["metadata"]["managedFields"]}
    assert "rljob-operator" in managers
    for cm in ("life-run", "life-progress"):
        assert owners_of(cluster.core.read_namespaced_config_map(cm, namespace))[0].name == "life"
    # The run's token: a Secret the operator created (as the chart's ServiceAccount), owned by the RLJob.
    secret = cluster.core.read_namespaced_secret("life-credentials", namespace)
    assert owners_of(secret)[0].name == "life" and set(secret.data or {}) == {"token"}
    status = _running(cluster, namespace, "life")
    assert status["jobSetName"] == "life" and status["restarts"] == {
        "used": 0,
        "left": 3,
        "trainer": {"used": 0, "left": 3},
        "sampler": {"used": 0, "left": 10},
    }

    # The trainer reports progress through its ConfigMap (contract 4).
    report = '{"step": 12, "lastCheckpointStep": 10, "rewardMean": 0.5, "adapterVersion": 2}'
    cluster.core.patch_namespaced_config_map("life-progress", namespace, {"data": {"progress.json": report}})
    wait_rljob(
        cluster,
        namespace,
        "life",
        60,
        "progress step 12",
        lambda s: (s.get("progress") or {}).get("step") == 12,
    )

    fail_pod(cluster, namespace, _trainer_pod(cluster, namespace, "life").metadata.name, 0)
    status = wait_phase(cluster, namespace, "life", "Succeeded", timeout=120)["status"]
    assert any(x["type"] == "Succeeded" and x["status"] == "True" for x in status["conditions"])

    # Latched: the JobSet going away (TTL) never brings a new one.
    cluster.custom.delete_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", "life"
    )
    wait_for(lambda: _get_jobset(cluster, namespace, "life") is None, 60, "the JobSet to be deleted")
    time.sleep(5)
    assert _get_jobset(cluster, namespace, "life") is None
    assert get_rljob(cluster, namespace, "life")["status"]["phase"] == "Succeeded"

    # Deleting the RLJob garbage-collects its children through owner references.
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "life")
    wait_for(lambda: not _configmaps(cluster, namespace), 90, "the ConfigMaps to be garbage-collected")
    wait_for(
        lambda: (
            not cluster.core.list_namespaced_secret(namespace, label_selector="rljob.dev/rljob=life").items
        ),
        90,
        "the credentials Secret to be garbage-collected",
    )


def test_exit_2_fails_at_once_as_bad_configuration(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    create_rljob(cluster, manifest("badcfg", namespace))
    _running(cluster, namespace, "badcfg")
    victim = _trainer_pod(cluster, namespace, "badcfg").metadata.name
    fail_pod(cluster, namespace, victim, 2, message="spec.trainer.mesh: product 3 != 4 devices")
    status = wait_phase(cluster, namespace, "badcfg", "Failed", timeout=90)["status"]
    # The fault happened: the pod's container terminated with exit code 2.
    pod = cluster.core.read_namespaced_pod(victim, namespace)
    assert exit_codes(pod) == [2]
    assert status["lastFailure"]["class"] == "badConfiguration"
    assert status["restarts"]["used"] == 0
    failed = next(x for x in status["conditions"] if x["type"] == "Failed")
    assert failed["reason"] == "BadConfiguration" and "exited with code 2" in failed["message"]
    # The entrypoint's line (its termination message) says why.
    assert "spec.trainer.mesh: product 3 != 4 devices" in status["lastFailure"]["message"]
    # Not restarted at all: the JobSet's own restart count stayed 0 (restarts.used only counts the
    # restarts charged to maxRestarts), and no pod of a second attempt was ever made.
    js = _get_jobset(cluster, namespace, "badcfg")
    assert js is not None and js["status"].get("restarts", 0) == 0
    attempts = {
        labels_of(p).get("jobset.sigs.k8s.io/restart-attempt") for p in pods_of(cluster, namespace, "badcfg")
    }
    assert attempts == {"0"}


def test_crash_is_a_counted_restart_then_exhausted(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    create_rljob(cluster, manifest("crash", namespace, failurePolicy={"maxRestarts": 1}))
    _running(cluster, namespace, "crash")
    fail_pod(cluster, namespace, _trainer_pod(cluster, namespace, "crash").metadata.name, 1)
    wait_rljob(
        cluster,
        namespace,
        "crash",
        120,
        "one counted restart",
        lambda s: (s.get("restarts") or {}).get("used") == 1,
    )
    status = _running(cluster, namespace, "crash")
    assert status["lastFailure"]["class"] == "crash" and status["lastFailure"]["role"] == "trainer"
    assert (status["restarts"]["used"], status["restarts"]["left"]) == (1, 0)

    fail_pod(cluster, namespace, _trainer_pod(cluster, namespace, "crash").metadata.name, 1)
    status = wait_phase(cluster, namespace, "crash", "Failed", timeout=120)["status"]
    failed = next(x for x in status["conditions"] if x["type"] == "Failed")
    assert failed["reason"] == "RestartsExhausted"


def test_preemption_drill_node_deleted_restart_not_counted(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    create_rljob(cluster, manifest("preempt", namespace))
    _running(cluster, namespace, "preempt")
    node = _trainer_pod(cluster, namespace, "preempt").spec.node_name
    with deleted_node(cluster, node):
        status = wait_rljob(
            cluster,
            namespace,
            "preempt",
            180,
            "a preemption recorded",
            lambda s: (s.get("lastFailure") or {}).get("class") == "preemption",
        )["status"]
    assert status["restarts"]["used"] == 0
    status = _running(cluster, namespace, "preempt")
    assert (status["restarts"]["used"], status["restarts"]["left"]) == (0, 3)
    assert status["lastFailure"]["reason"] == "Preempted" and status["lastFailure"]["role"] == "trainer"


def test_a_sampler_crash_restarts_the_sampler_alone_then_its_budget_stops_the_run(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    """Role-scoped restarts through the real operator and JobSet v0.12.0: a sampler pod that exits 1
    restarts only the sampler Job (the trainer pod keeps its uid), counted for the samplers; past
    spec.failurePolicy.maxSamplerRestarts the run is Failed naming the field and its JobSet suspended."""
    create_rljob(cluster, manifest("samp", namespace, failurePolicy={"maxSamplerRestarts": 1}))
    _running(cluster, namespace, "samp")
    trainer_uid = _trainer_pod(cluster, namespace, "samp").metadata.uid

    def sampler_pod() -> Any:
        return wait_for(
            lambda: next(iter(running_pods(cluster, namespace, "samp", "sampler")), None),
            90,
            "a Running sampler pod",
        )

    fail_pod(cluster, namespace, sampler_pod().metadata.name, 1)
    status = wait_rljob(
        cluster,
        namespace,
        "samp",
        120,
        "one counted sampler restart",
        lambda s: ((s.get("restarts") or {}).get("sampler") or {}).get("used") == 1,
    )["status"]
    status = _running(cluster, namespace, "samp")
    assert status["restarts"]["sampler"] == {"used": 1, "left": 0}
    assert (status["restarts"]["used"], status["restarts"]["left"]) == (0, 3)
    assert status["lastFailure"]["class"] == "crash" and status["lastFailure"]["role"] == "sampler"
    assert _trainer_pod(cluster, namespace, "samp").metadata.uid == trainer_uid
    js = _get_jobset(cluster, namespace, "samp")
    assert js is not None and js["status"].get("restarts", 0) == 0

    fail_pod(cluster, namespace, sampler_pod().metadata.name, 1)
    status = wait_phase(cluster, namespace, "samp", "Failed", timeout=120)["status"]
    failed = next(x for x in status["conditions"] if x["type"] == "Failed")
    assert (
        failed["reason"] == "RestartsExhausted"
        and "spec.failurePolicy.maxSamplerRestarts" in failed["message"]
    )
    assert status["lastFailure"]["role"] == "sampler"
    wait_for(
        lambda: (_get_jobset(cluster, namespace, "samp") or {}).get("spec", {}).get("suspend") is True,
        60,
        "the JobSet suspended",
    )


def test_suspend_and_resume(cluster: Cluster, namespace: str, rljob_operator: OperatorProcess) -> None:
    create_rljob(cluster, manifest("susp", namespace))
    _running(cluster, namespace, "susp")
    patch_rljob(cluster, namespace, "susp", {"spec": {"suspend": True}})
    status = wait_phase(cluster, namespace, "susp", "Suspended", timeout=90)["status"]
    assert _jobset(cluster, namespace, "susp")["spec"]["suspend"] is True
    assert status["observedGeneration"] == 2
    wait_for(lambda: not pods_of(cluster, namespace, "susp"), 90, "the pods to go away")
    patch_rljob(cluster, namespace, "susp", {"spec": {"suspend": False}})
    _running(cluster, namespace, "susp")
    assert _jobset(cluster, namespace, "susp")["spec"]["suspend"] is False


def test_admission_refuses_bad_manifests_naming_the_field(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    bad = [
        (manifest("bad1", namespace, trainer={"tpu": "v5p-8", "mesh": {"fsdp": 3}}), "spec.trainer.mesh"),
        (manifest("bad2", namespace, lora={"rank": 7}), "spec.lora.rank"),
        (manifest("bad3", namespace, trainer={"tpu": "v9-8"}), "spec.trainer.tpu"),
    ]
    for body, field in bad:
        with pytest.raises(ApiException) as err:
            create_rljob(cluster, body)
        assert err.value.status in (400, 422), err.value.body
        assert field in error_body(err.value), err.value.body
    # Immutable fields are refused by the CRD's CEL rules; suspend may change.
    create_rljob(cluster, manifest("immut", namespace, suspend=True))
    with pytest.raises(ApiException) as err:
        patch_rljob(cluster, namespace, "immut", {"spec": {"algorithm": {"steps": 7}}})
    assert "spec.algorithm" in error_body(err.value) and "immutable" in error_body(err.value), err.value.body
    patch_rljob(cluster, namespace, "immut", {"spec": {"suspend": False}})


@pytest.mark.slow
def test_operator_sigkilled_while_50_rljobs_are_created(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    """A thread SIGKILLs the operator at random moments (mid-reconcile, mid-write) and restarts it,
    while the main thread creates 50 RLJobs (retrying while the webhook is down with the operator)."""
    rng = random.Random(4)
    names = [f"k{i:02d}" for i in range(50)]
    done = threading.Event()
    killed = threading.Condition()
    kills = 0

    def killer() -> None:
        nonlocal kills
        while not done.is_set():
            time.sleep(0.2 + rng.random() * 1.5)
            rljob_operator.kill(signal.SIGKILL)
            with killed:
                kills += 1
                killed.notify_all()
            rljob_operator.start()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        for i, name in enumerate(names):
            if i and i % 10 == 0:
                # Paced by the kills: each batch of ten starts after one more kill, so the kills land
                # while RLJobs are being created however fast the API server answers.
                with killed:
                    while kills < i // 10:
                        assert killed.wait(timeout=60), (i, kills)
            wait_for(
                functools.partial(_create_tolerating_webhook_outage, cluster, namespace, name),
                120,
                f"create {name}",
            )
    finally:
        done.set()
        thread.join(timeout=120)
    if not rljob_operator.alive():
        rljob_operator.start()
    assert kills >= 4

    def converged() -> bool:
        items = as_dict(cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL))[
            "items"
        ]
        return len(items) == 50 and all(
            (x.get("status") or {}).get("phase") == "Suspended"
            and x["status"].get("observedGeneration") == x["metadata"]["generation"]
            for x in items
        )

    wait_for(converged, 240, "every RLJob status to converge to Suspended")
    jobsets = as_dict(
        cluster.custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets")
    )["items"]
    assert sorted(j["metadata"]["name"] for j in jobsets) == names
    assert all(len(j["metadata"]["ownerReferences"]) == 1 for j in jobsets)


# ------------------------------------------------------------------------------------------ helpers


def _create_tolerating_webhook_outage(c: Cluster, ns: str, name: str) -> bool:
    try:
        create_rljob(c, manifest(name, ns, suspend=True))
    except ApiException as e:
        if e.status == 409:  # created by an earlier try whose answer was lost
            return True
        if e.status >= 500 or "failed calling webhook" in str(e.body):
            return False
        raise
    return True


def _get_jobset(c: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    try:
        return c.get_jobset(ns, name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _jobset(c: Cluster, ns: str, name: str) -> dict[str, Any]:
    """The JobSet, which the test expects to exist."""
    js = _get_jobset(c, ns, name)
    assert js is not None, f"no JobSet {ns}/{name}"
    return js


def _configmaps(c: Cluster, ns: str) -> list[Any]:
    return [x for x in c.core.list_namespaced_config_map(ns).items if name_of(x).startswith("life-")]


@pytest.mark.slow
def test_operator_recovers_after_the_api_server_restarts(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    create_rljob(cluster, manifest("before", namespace, suspend=True))
    wait_phase(cluster, namespace, "before", "Suspended", timeout=60)
    cluster.restart_control_plane(pause_s=5)
    wait_for(lambda: _api_up(cluster, namespace), 120, "the API server to serve RLJobs again")
    assert rljob_operator.alive(), rljob_operator.log_tail()
    wait_for(lambda: _create_tolerating_webhook_outage(cluster, namespace, "after"), 60, "create RLJob after")
    wait_phase(cluster, namespace, "after", "Suspended", timeout=120)
    patch_rljob(cluster, namespace, "before", {"spec": {"suspend": False}})
    # Running, not just Pending: the whole chain works again (JobSet controller, scheduler, kwok,
    # the operator's watches), so the next test does not inherit a half-recovered cluster.
    _running(cluster, namespace, "before")
    assert rljob_operator.alive()


def _api_up(c: Cluster, namespace: str) -> bool:
    try:
        c.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        c.custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets")
    except Exception:
        return False
    return True


def test_queue_name_and_priority_class_reach_the_jobset(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    body = manifest("queued", namespace, suspend=True, queueName="team-a", priorityClassName="rl-high")
    create_rljob(cluster, body)
    js = wait_for(lambda: _get_jobset(cluster, namespace, "queued"), 60, "the JobSet")
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    for rj in js["spec"]["replicatedJobs"]:
        assert rj["template"]["spec"]["template"]["spec"]["priorityClassName"] == "rl-high"
    status = wait_phase(cluster, namespace, "queued", "Suspended", timeout=60)["status"]
    suspended = next(x for x in status["conditions"] if x["type"] == "Suspended")
    assert suspended["reason"] == "SuspendedByUser"
    # queueName may change while suspended, not once running.
    patch_rljob(cluster, namespace, "queued", {"spec": {"queueName": "team-b"}})
    wait_for(
        lambda: (
            _jobset(cluster, namespace, "queued")["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
            == "team-b"
        ),
        60,
        "the JobSet's queue label to follow",
    )
    with pytest.raises(ApiException) as err:
        patch_rljob(cluster, namespace, "queued", {"spec": {"queueName": "team-c", "suspend": False}})
    assert "queueName may only change while spec.suspend is true" in error_body(err.value)


def test_service_mode_gets_a_service_and_its_url(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    """spec.service: the operator creates the Service in front of the first trainer pod and shows its URL."""
    create_rljob(
        cluster, manifest("tk", namespace, service={"api": "tinker", "port": 9090, "apiKeySecret": "tk-keys"})
    )
    status = _running(cluster, namespace, "tk")
    assert status["url"] == f"http://tk-api.{namespace}.svc:9090"
    svc = cluster.core.read_namespaced_service("tk-api", namespace)
    assert [(p.port, p.target_port) for p in spec_of(svc).ports or []] == [(9090, "api")]
    assert owners_of(svc)[0].kind == "RLJob"
    selected = spec_of(svc).selector
    assert selected is not None, svc
    selector = ",".join(f"{k}={v}" for k, v in selected.items())
    pods = cluster.core.list_namespaced_pod(namespace, label_selector=selector).items
    assert [labels_of(p)["rljob.dev/role"] for p in pods] == ["trainer"]
    ports = {p.name: p.container_port for c in spec_of(pods[0]).containers for p in c.ports or []}
    assert ports["api"] == 9090


def test_a_job_the_api_server_refuses_shows_in_the_status(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    """A refusal the plan cannot foresee (a ResourceQuota of zero Jobs): the reconcile's dry run of the
    JobSet's Jobs puts the API server's message in the RLJob's status and creates nothing, instead of a
    JobSet whose controller only posts an event and a run Pending forever."""
    quota = client.V1ResourceQuota(
        metadata=client.V1ObjectMeta(name="no-jobs"),
        spec=client.V1ResourceQuotaSpec(hard={"count/jobs.batch": "0"}),
    )
    cluster.core.create_namespaced_resource_quota(namespace, quota)
    create_rljob(cluster, manifest("refused", namespace))

    ready = _wait_ready_reason(cluster, namespace, "refused", "CreateFailed", 60)
    assert "refuses the Jobs of replicated job" in ready["message"] and "quota" in ready["message"], ready
    assert get_rljob(cluster, namespace, "refused")["status"]["phase"] == "Pending"
    assert _get_jobset(cluster, namespace, "refused") is None  # nothing created
    events = cluster.core.list_namespaced_event(namespace, field_selector="reason=CreateFailed").items
    assert events and any("quota" in (e.message or "") for e in events)


def test_pods_the_api_server_refuses_show_in_the_status(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    """A refusal of the pods, not the Jobs (Pod Security admission enforcing `restricted` in the
    namespace): the JobSet and its Jobs are created, the Job controller's pod creates are refused and it
    records FailedCreate events that the JobSet does not report. The reconcile reads them while the run
    waits: Ready=False PodCreateFailed with the API server's message, and a Warning event on the RLJob."""
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    cluster.core.patch_namespace(namespace, {"metadata": {"labels": labels}})
    create_rljob(cluster, manifest("psa", namespace))

    ready = _wait_ready_reason(cluster, namespace, "psa", "PodCreateFailed", 120)
    assert ready["message"].startswith("Job psa-") and "PodSecurity" in ready["message"], ready
    assert get_rljob(cluster, namespace, "psa")["status"]["phase"] == "Pending"
    assert _get_jobset(cluster, namespace, "psa") is not None  # the JobSet exists; its pods do not
    events = cluster.core.list_namespaced_event(namespace, field_selector="reason=PodCreateFailed").items
    assert any(e.involved_object.kind == "RLJob" and "PodSecurity" in (e.message or "") for e in events)
