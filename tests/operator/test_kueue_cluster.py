"""spec.queueName under Kueue on the local cluster: admission, quota, queueing, release.

The operator runs as in test_operator_cluster.py; the `kueue` fixture starts the Kueue manager on the
session's cluster on demand (hack/cluster.sh kueue-up) and `tpu_queue` gives the test's namespace a
LocalQueue whose ClusterQueue holds google.com/tpu quota for exactly one run of
examples/qwen3-8b-v5p.yaml (v5p-8 trainer + v5p-8 sampler: 8 chips).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
from fixtures.cluster import Cluster, wait_for
from fixtures.k8s import spec_of
from fixtures.kueue import QUEUE_LABEL, QUEUE_TPU_CHIPS, Kueue, TpuQueue
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
from kubernetes.client.exceptions import ApiException

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900, func_only=True)]


def _jobset(c: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    try:
        return c.get_jobset(ns, name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _workload_of(k: Kueue, ns: str, jobset: dict[str, Any]) -> dict[str, Any] | None:
    uid = jobset["metadata"]["uid"]
    for wl in k.workloads(ns):
        if any(ref.get("uid") == uid for ref in wl["metadata"].get("ownerReferences") or []):
            return wl
    return None


def _cond(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((x for x in (obj.get("status") or {}).get("conditions") or [] if x["type"] == ctype), None)


def _admitted(wl: dict[str, Any] | None) -> bool:
    cond = _cond(wl or {}, "Admitted")
    return cond is not None and cond["status"] == "True"


def _admitted_workload(k: Kueue, ns: str, jobset: dict[str, Any]) -> dict[str, Any] | None:
    wl = _workload_of(k, ns, jobset)
    return wl if _admitted(wl) else None


def _jobset_patches(op: OperatorProcess) -> float:
    """How many JobSet patches (merge: spec.suspend / queue label) the operator has sent."""
    return sum(
        v
        for k, v in op.metrics().items()
        if k.startswith("rljob_operator_api_requests_total")
        and 'verb="PATCH"' in k
        and 'resource="jobsets"' in k
    )


def _assert_on_v5p_nodes(c: Cluster, ns: str, name: str) -> None:
    for role in ("trainer", "sampler"):
        pods = wait_for(
            functools.partial(running_pods, c, ns, name, role), 120, f"a Running {role} pod of {name}"
        )
        for pod in pods:
            node_name = spec_of(pod).node_name
            assert node_name is not None and node_name.startswith("gke-tpu-v5p-8-"), (role, node_name)


def _queued(status: dict[str, Any]) -> bool:
    cond = next((x for x in status.get("conditions") or [] if x["type"] == "Suspended"), None)
    return (
        status.get("phase") == "Suspended"
        and cond is not None
        and cond["status"] == "True"
        and cond["reason"] == "WaitingForQueue"
    )


def test_queue_admits_within_quota_queues_beyond_it_and_frees_on_delete(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess, kueue: Kueue, tpu_queue: TpuQueue
) -> None:
    started = time.monotonic()
    # 1. Within quota: labelled, admitted, unsuspended by Kueue, pods on the v5p-8 pools, Running.
    create_rljob(cluster, manifest("first", namespace, queueName=tpu_queue.name))
    js = wait_for(lambda: _jobset(cluster, namespace, "first"), 60, "JobSet first")
    assert js["metadata"]["labels"][QUEUE_LABEL] == tpu_queue.name
    wl = wait_for(
        lambda: _admitted_workload(kueue, namespace, js), 120, "Kueue to admit the Workload of JobSet first"
    )
    assert wl["spec"]["queueName"] == tpu_queue.name
    assert wl["status"]["admission"]["clusterQueue"] == tpu_queue.cluster_queue
    tpu = sum(
        int(ps["resourceUsage"]["google.com/tpu"]) for ps in wl["status"]["admission"]["podSetAssignments"]
    )
    assert tpu == QUEUE_TPU_CHIPS
    status = wait_phase(cluster, namespace, "first", "Running", timeout=180)["status"]
    assert status["roles"]["trainer"]["ready"] == status["roles"]["trainer"]["total"] == 1
    assert status["roles"]["sampler"]["ready"] == status["roles"]["sampler"]["total"] == 1
    assert (
        wait_for(lambda: _jobset(cluster, namespace, "first"), 10, "JobSet first")["spec"]["suspend"] is False
    )
    _assert_on_v5p_nodes(cluster, namespace, "first")
    print(f"\nfirst Running under Kueue after {time.monotonic() - started:.0f}s")

    # 2. Beyond quota: Kueue holds the second JobSet suspended; the RLJob says it waits for its queue,
    # and the operator leaves spec.suspend to Kueue (no JobSet patch at all).
    patches = _jobset_patches(rljob_operator)
    create_rljob(cluster, manifest("second", namespace, queueName=tpu_queue.name))
    status = wait_rljob(cluster, namespace, "second", 60, "Suspended, WaitingForQueue", _queued)["status"]
    suspended = next(x for x in status["conditions"] if x["type"] == "Suspended")
    assert tpu_queue.name in suspended["message"]
    ready = next(x for x in status["conditions"] if x["type"] == "Ready")
    assert ready["status"] == "False"
    js2: dict[str, Any] | None = wait_for(lambda: _jobset(cluster, namespace, "second"), 10, "JobSet second")
    assert js2 is not None
    wl2: dict[str, Any] | None = wait_for(
        functools.partial(_workload_of, kueue, namespace, js2), 60, "the Workload of JobSet second"
    )
    time.sleep(10)  # long enough for a fight over spec.suspend to show
    js2 = _jobset(cluster, namespace, "second")
    assert js2 is not None and js2["spec"]["suspend"] is True
    wl2 = _workload_of(kueue, namespace, js2)
    assert not _admitted(wl2), wl2
    quota = _cond(wl2 or {}, "QuotaReserved")
    assert quota is not None and quota["status"] == "False", wl2
    assert not pods_of(cluster, namespace, "second")
    assert _queued(get_rljob(cluster, namespace, "second")["status"])
    first = get_rljob(cluster, namespace, "first")["status"]
    assert first["phase"] == "Running"
    assert _jobset(cluster, namespace, "first")["spec"]["suspend"] is False  # type: ignore[index]
    assert _jobset_patches(rljob_operator) == patches

    # 3. Deleting the first frees its quota: Kueue admits the second, which runs on the same pools.
    freed = time.monotonic()
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "first")
    wait_for(
        functools.partial(_admitted_workload, kueue, namespace, js2),
        120,
        "Kueue to admit the Workload of JobSet second after first was deleted",
    )
    status = wait_phase(cluster, namespace, "second", "Running", timeout=180)["status"]
    assert all(x["status"] == "False" for x in status["conditions"] if x["type"] == "Suspended")
    assert _jobset(cluster, namespace, "second")["spec"]["suspend"] is False  # type: ignore[index]
    _assert_on_v5p_nodes(cluster, namespace, "second")
    assert _jobset_patches(rljob_operator) == patches
    print(f"second Running {time.monotonic() - freed:.0f}s after first was deleted")


def test_user_suspend_and_resume_under_a_queue_without_a_fight(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess, kueue: Kueue, tpu_queue: TpuQueue
) -> None:
    """spec.suspend with a queue goes through Kueue (the Workload's spec.active): Kueue evicts and
    suspends the JobSet and keeps it so; resuming hands it back to Kueue, which admits it again."""
    create_rljob(cluster, manifest("pausable", namespace, queueName=tpu_queue.name))
    wait_phase(cluster, namespace, "pausable", "Running", timeout=180)
    js = wait_for(lambda: _jobset(cluster, namespace, "pausable"), 10, "JobSet pausable")
    patch_rljob(cluster, namespace, "pausable", {"spec": {"suspend": True}})
    status = wait_phase(cluster, namespace, "pausable", "Suspended", timeout=90)["status"]
    suspended = next(x for x in status["conditions"] if x["type"] == "Suspended")
    assert suspended["reason"] == "SuspendedByUser"
    wait_for(lambda: not pods_of(cluster, namespace, "pausable"), 90, "the pods to go away")
    patches = _jobset_patches(rljob_operator)
    time.sleep(10)  # a fight over spec.suspend would show as JobSet patches and flapping
    assert _jobset_patches(rljob_operator) == patches
    assert _jobset(cluster, namespace, "pausable")["spec"]["suspend"] is True  # type: ignore[index]
    wl = _workload_of(kueue, namespace, js)
    assert wl is not None and wl["spec"]["active"] is False and not _admitted(wl)
    assert get_rljob(cluster, namespace, "pausable")["status"]["phase"] == "Suspended"
    assert not pods_of(cluster, namespace, "pausable")

    patch_rljob(cluster, namespace, "pausable", {"spec": {"suspend": False}})
    wait_phase(cluster, namespace, "pausable", "Running", timeout=180)
    wl = _workload_of(kueue, namespace, js)
    assert wl is not None and wl["spec"].get("active", True) is True and _admitted(wl)
    assert _jobset(cluster, namespace, "pausable")["spec"]["suspend"] is False  # type: ignore[index]
    _assert_on_v5p_nodes(cluster, namespace, "pausable")
