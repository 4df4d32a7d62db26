"""JobSets on the local cluster's simulated GKE TPU node pools (hack/cluster.sh, tests/fixtures/cluster.py).

Needs the cluster (marker `cluster`): the session fixture builds and starts it when it is not running.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from fixtures.cluster import (
    Cluster,
    deleted_node,
    evict_pod,
    fail_pod,
    jobset_condition,
    wait_for,
)
from fixtures.k8s import labels_of, meta, name_of, status_of
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster

EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"
NODEPOOL = "cloud.google.com/gke-nodepool"
ACCEL = "cloud.google.com/gke-tpu-accelerator"
TOPO = "cloud.google.com/gke-tpu-topology"

# The failure rules under test (docs/architecture.md, contract 3): exit 2 = bad configuration, the JobSet
# fails at once; another non-zero exit = a restart counted against maxRestarts; a disruption (pod condition
# DisruptionTarget: eviction, node deleted) = a restart NOT counted.
POD_FAILURE_POLICY: dict[str, Any] = {
    "rules": [
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [2]}},
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
    ]
}
JOBSET_FAILURE_POLICY: dict[str, Any] = {
    "maxRestarts": 2,
    "rules": [
        {
            "name": "badConfig",
            "action": "FailJobSet",
            "onJobFailureReasons": ["PodFailurePolicy"],
            "onJobFailureMessagePatterns": ["failed with exit code 2 matching FailJob rule"],
        },
        {
            "name": "disruption",
            "action": "RestartJobSetAndIgnoreMaxRestarts",
            "onJobFailureReasons": ["PodFailurePolicy"],
            "onJobFailureMessagePatterns": ["has condition DisruptionTarget matching FailJob rule"],
        },
    ],
}


def tpu_jobset(
    name: str, accelerator: str, topology: str, hosts: int, slices: int, failure_policy: bool = True
) -> dict[str, Any]:
    """A JobSet shaped like the ones rljob renders: one Job per slice, one pod per TPU VM."""
    job_spec: dict[str, Any] = {
        "parallelism": hosts,
        "completions": hosts,
        "backoffLimit": 0,
        "template": {
            "spec": {
                "restartPolicy": "Never",
                "nodeSelector": {ACCEL: accelerator, TOPO: topology},
                "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [
                    {
                        "name": "worker",
                        "image": "example.invalid/worker:0",
                        "resources": {"limits": {"google.com/tpu": "4"}, "requests": {"google.com/tpu": "4"}},
                    }
                ],
            }
        },
    }
    spec: dict[str, Any] = {
        "replicatedJobs": [
            {"name": "slice", "replicas": slices, "template": {"spec": job_spec}},
        ]
    }
    if failure_policy:
        job_spec["podFailurePolicy"] = POD_FAILURE_POLICY
        spec["failurePolicy"] = JOBSET_FAILURE_POLICY
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "annotations": {EXCLUSIVE: NODEPOOL}},
        "spec": spec,
    }


def running_pods(c: Cluster, ns: str, js: str, want: int, attempt: int = 0) -> list[Any] | None:
    """The JobSet's pods of restart attempt `attempt` once `want` of them are Running, else None."""
    pods = [
        p
        for p in c.jobset_pods(ns, js)
        if labels_of(p).get("jobset.sigs.k8s.io/restart-attempt") == str(attempt)
        and meta(p).deletion_timestamp is None
    ]
    running = [p for p in pods if status_of(p).phase == "Running"]
    return running if len(running) == want else None


@pytest.mark.parametrize(
    ("accelerator", "topology", "hosts", "pool_prefix"),
    [
        ("tpu-v5p-slice", "2x2x1", 1, "v5p-8-"),
        ("tpu-v5p-slice", "2x2x2", 2, "v5p-16-"),
        ("tpu7x", "2x2x1", 1, "tpu7x-8-"),
    ],
    ids=["v5p-8", "v5p-16", "tpu7x-8"],
)
def test_two_slices_run_on_their_own_tpu_pools(
    cluster: Cluster, namespace: str, accelerator: str, topology: str, hosts: int, pool_prefix: str
) -> None:
    cluster.create_jobset(namespace, tpu_jobset("place", accelerator, topology, hosts, slices=2))
    pods = wait_for(lambda: running_pods(cluster, namespace, "place", 2 * hosts), 60, "pods Running")

    jobs = cluster.batch.list_namespaced_job(namespace).items
    assert sorted(name_of(j) for j in jobs) == ["place-slice-0", "place-slice-1"]
    pool_of_job: dict[str, set[str]] = {}
    for pod in pods:
        labels = labels_of(cluster.core.read_node(pod.spec.node_name))
        assert labels[ACCEL] == accelerator
        assert labels[TOPO] == topology
        assert labels[NODEPOOL].startswith(pool_prefix), (pod.metadata.name, labels[NODEPOOL])
        job = pod.metadata.labels["job-name"]
        pool_of_job.setdefault(job, set()).add(labels[NODEPOOL])
    # Exclusive placement: each slice (Job) fills exactly one node pool, and no pool is shared.
    assert all(len(pools) == 1 for pools in pool_of_job.values()), pool_of_job
    assert len({next(iter(p)) for p in pool_of_job.values()}) == 2, pool_of_job


def test_jobset_webhooks_default_and_validate(cluster: Cluster, namespace: str) -> None:
    body = tpu_jobset("hooks", "tpu-v5p-slice", "2x2x1", 1, slices=1, failure_policy=False)
    body["spec"]["failurePolicy"] = {"maxRestarts": 1, "rules": [{"action": "FailJobSet"}]}
    del body["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["restartPolicy"]
    created = cluster.create_jobset(namespace, body)
    # Set by JobSet's mutating webhook (the CRD schema cannot default these).
    assert created["spec"]["failurePolicy"]["rules"][0]["name"] == "failurePolicyRule0"
    pod_spec = created["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod_spec["restartPolicy"] == "OnFailure"
    assert created["spec"]["network"]["enableDNSHostnames"] is True

    bad = tpu_jobset("hooks-bad", "tpu-v5p-slice", "2x2x1", 1, slices=1, failure_policy=False)
    bad["spec"]["failurePolicy"] = {
        "rules": [{"name": "r", "action": "FailJobSet", "targetReplicatedJobs": ["no-such-job"]}]
    }
    with pytest.raises(ApiException) as err:
        cluster.create_jobset(namespace, bad)
    assert err.value.status == 403 or err.value.status == 422, err.value
    assert "vjobset.kb.io" in str(err.value.body) or "no-such-job" in str(err.value.body), err.value.body


@pytest.mark.parametrize(("how", "counted"), [("exit-1", True), ("evict", False)])
def test_failure_restarts_the_jobset(cluster: Cluster, namespace: str, how: str, counted: bool) -> None:
    cluster.create_jobset(namespace, tpu_jobset("crash", "tpu-v5p-slice", "2x2x2", 2, slices=1))
    pods = wait_for(lambda: running_pods(cluster, namespace, "crash", 2), 60, "pods Running")
    victim = pods[0].metadata.name
    if how == "exit-1":
        fail_pod(cluster, namespace, victim, 1)
    else:
        evict_pod(cluster, namespace, victim)

    def restarted() -> dict[str, Any] | None:
        js = cluster.get_jobset(namespace, "crash")
        return js if js.get("status", {}).get("restarts") == 1 else None

    js = wait_for(restarted, 60, "JobSet restart 1")
    assert js["status"].get("restartsCountTowardsMax", 0) == (1 if counted else 0)
    assert jobset_condition(js, "Failed") is None
    wait_for(lambda: running_pods(cluster, namespace, "crash", 2, attempt=1), 60, "restarted pods Running")


def test_exit_code_2_fails_the_jobset_without_restart(cluster: Cluster, namespace: str) -> None:
    cluster.create_jobset(namespace, tpu_jobset("badcfg", "tpu7x", "2x2x1", 1, slices=2))
    pods = wait_for(lambda: running_pods(cluster, namespace, "badcfg", 2), 60, "pods Running")
    victim = pods[0].metadata.name
    fail_pod(cluster, namespace, victim, 2, message="spec.trainer.mesh: bad")

    failed = wait_for(
        lambda: jobset_condition(cluster.get_jobset(namespace, "badcfg"), "Failed"), 60, "JobSet Failed"
    )
    # The fault happened (exit code 2), and it was not restarted: restarts 0, no second attempt's pods.
    pod = cluster.core.read_namespaced_pod(victim, namespace)
    statuses = status_of(pod).container_statuses or []
    assert [
        cs.state.terminated.exit_code if cs.state and cs.state.terminated else None for cs in statuses
    ] == [2]
    js = cluster.get_jobset(namespace, "badcfg")
    assert js["status"].get("restarts", 0) == 0
    assert failed["reason"] == "FailJobSetFailurePolicyAction", failed
    attempts = {
        labels_of(p).get("jobset.sigs.k8s.io/restart-attempt")
        for p in cluster.jobset_pods(namespace, "badcfg")
    }
    assert attempts == {"0"}, attempts


def test_counted_restarts_stop_at_max_restarts(cluster: Cluster, namespace: str) -> None:
    cluster.create_jobset(namespace, tpu_jobset("budget", "tpu-v5p-slice", "2x2x1", 1, slices=1))
    for attempt in range(JOBSET_FAILURE_POLICY["maxRestarts"] + 1):
        pods = wait_for(
            functools.partial(running_pods, cluster, namespace, "budget", 1, attempt),
            60,
            f"attempt {attempt} Running",
        )
        fail_pod(cluster, namespace, pods[0].metadata.name, 1)
    failed = wait_for(
        lambda: jobset_condition(cluster.get_jobset(namespace, "budget"), "Failed"),
        60,
        "JobSet Failed after the restart budget",
    )
    js = cluster.get_jobset(namespace, "budget")
    assert js["status"]["restarts"] == JOBSET_FAILURE_POLICY["maxRestarts"]
    assert failed["reason"] == "ReachedMaxRestarts", failed


@pytest.mark.slow
# make test-long (66 s): make test keeps the same through the operator, on the JobSet it renders
# (tests/operator/test_operator_cluster.py::test_preemption_drill_node_deleted_restart_not_counted).
@pytest.mark.long
def test_deleting_a_node_restarts_the_jobset_without_counting(cluster: Cluster, namespace: str) -> None:
    cluster.create_jobset(namespace, tpu_jobset("preempt", "tpu-v5p-slice", "2x2x1", 1, slices=1))
    pods = wait_for(lambda: running_pods(cluster, namespace, "preempt", 1), 60, "pods Running")
    node = pods[0].spec.node_name
    with deleted_node(cluster, node):
        # The pod GC marks pods of a vanished node DisruptionTarget after a 40 s quarantine.
        js = wait_for(
            lambda: (lambda j: j if j.get("status", {}).get("restarts") == 1 else None)(
                cluster.get_jobset(namespace, "preempt")
            ),
            120,
            "JobSet restart after node deletion",
        )
        assert js["status"].get("restartsCountTowardsMax", 0) == 0
        assert jobset_condition(js, "Failed") is None
    # The replacement runs on a v5p-8 pool (the other one, or the deleted node once it is back).
    new = wait_for(
        lambda: running_pods(cluster, namespace, "preempt", 1, attempt=1), 60, "restarted pod Running"
    )
    node_labels = labels_of(cluster.core.read_node(new[0].spec.node_name))
    assert node_labels[NODEPOOL].startswith("v5p-8-"), node_labels


# ------------------------------------------------------------ rljob's role-scoped failure policy


def two_role_jobset(name: str, max_restarts: int = 1, max_sampler_restarts: int = 2) -> dict[str, Any]:
    """A trainer and a sampler replicatedJob with the failure rules rljob renders (recipes/failure.py)."""
    from rljob.recipes import failure

    def job(role: str) -> dict[str, Any]:
        spec = tpu_jobset(role, "tpu-v5p-slice", "2x2x1", 1, slices=1, failure_policy=False)
        rj = spec["spec"]["replicatedJobs"][0]
        rj["name"] = role
        rj["template"]["spec"]["podFailurePolicy"] = failure.pod_failure_policy()
        return dict(rj)

    body = tpu_jobset(name, "tpu-v5p-slice", "2x2x1", 1, slices=1, failure_policy=False)
    body["spec"]["replicatedJobs"] = [job("trainer"), job("sampler")]
    body["spec"]["failurePolicy"] = failure.jobset_failure_policy(max_restarts, max_sampler_restarts)
    return body


def role_pods(c: Cluster, ns: str, js: str, role: str) -> list[Any]:
    return [
        p
        for p in c.jobset_pods(ns, js)
        if labels_of(p).get("jobset.sigs.k8s.io/replicatedjob-name") == role
        and meta(p).deletion_timestamp is None
        and status_of(p).phase == "Running"
    ]


def sampler_counters(js: dict[str, Any]) -> tuple[list[int], list[int]]:
    for rjs in js.get("status", {}).get("replicatedJobsStatus") or []:
        if rjs["name"] == "sampler":
            return list(rjs.get("jobRestarts") or [0]), list(rjs.get("jobRestartsCountTowardsMax") or [0])
    return [0], [0]


def test_a_failed_sampler_restarts_alone_the_trainer_runs_on(cluster: Cluster, namespace: str) -> None:
    """JobSet v0.12.0 with rljob's rules: a sampler crash restarts only the sampler Job (counted for the
    samplers), a sampler eviction the same without counting; the trainer pod is never replaced; then a
    trainer crash restarts the whole JobSet, counted as before."""
    cluster.create_jobset(namespace, two_role_jobset("roles"))

    def both() -> tuple[Any, Any] | None:
        t, s = (
            role_pods(cluster, namespace, "roles", "trainer"),
            role_pods(cluster, namespace, "roles", "sampler"),
        )
        return (t[0], s[0]) if len(t) == 1 and len(s) == 1 else None

    trainer, sampler = wait_for(both, 60, "trainer and sampler Running")
    trainer_uid = meta(trainer).uid
    for step, (how, counted) in enumerate([("exit-1", 1), ("evict", 1)], start=1):
        if how == "exit-1":
            fail_pod(cluster, namespace, sampler.metadata.name, 1)
        else:
            evict_pod(cluster, namespace, sampler.metadata.name)

        def sampler_back(step: int = step) -> Any:
            js = cluster.get_jobset(namespace, "roles")
            pods = role_pods(cluster, namespace, "roles", "sampler")
            new = [p for p in pods if labels_of(p).get("jobset.sigs.k8s.io/job-restart-attempt") == str(step)]
            return (js, new[0]) if sampler_counters(js)[0] == [step] and new else None

        js, sampler = wait_for(sampler_back, 90, f"sampler restart {step} ({how})")
        assert sampler_counters(js) == ([step], [counted]), js["status"]
        assert js["status"].get("restarts", 0) == 0 and js["status"].get("restartsCountTowardsMax", 0) == 0
        assert jobset_condition(js, "Failed") is None
        [still] = role_pods(cluster, namespace, "roles", "trainer")
        assert meta(still).uid == trainer_uid, "the trainer pod was replaced by a sampler restart"
        assert labels_of(sampler).get("jobset.sigs.k8s.io/restart-attempt") == "0"
    # A trainer crash restarts the run (every Job), counted in restartsCountTowardsMax.
    fail_pod(cluster, namespace, trainer.metadata.name, 1)
    js = wait_for(
        lambda: (lambda j: j if j.get("status", {}).get("restarts") == 1 else None)(
            cluster.get_jobset(namespace, "roles")
        ),
        90,
        "JobSet restart after a trainer crash",
    )
    assert js["status"].get("restartsCountTowardsMax", 0) == 1
    wait_for(lambda: running_pods(cluster, namespace, "roles", 2, attempt=1), 90, "restarted pods Running")
