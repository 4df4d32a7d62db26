"""`rljob doctor`'s checks as pure functions over listed objects: table-driven, no cluster.

The cluster tests (tests/doctor/test_doctor_cluster.py) run the same checks on objects read from the
local control plane with pieces removed.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml
from rljob.cli.doctor import EXIT_OK, EXIT_PROBLEMS
from rljob.cli.doctor.cluster import ClusterState, run_checks
from rljob.cli.doctor.common import parse_version
from rljob.cli.doctor.findings import Finding, Status, exit_code, ok, problem, render_text, warning
from rljob.cli.doctor.jobset import (
    JOBSET_CRD,
    JOBSET_FIELDS,
    MIN_JOBSET_VERSION,
    TESTED_JOBSET_VERSION,
    Probe,
    check_jobset_controller,
    check_jobset_crd,
    check_jobset_webhook_configs,
    probe_object,
    probe_result,
    probe_rljob,
)
from rljob.cli.doctor.kueue import KUEUE_CONFIG_KEY, LOCALQUEUE_CRD, TESTED_KUEUE_VERSION, check_queue
from rljob.cli.doctor.needs import Needs, RoleNeed
from rljob.cli.doctor.nodepools import check_node_pools, create_pool_command
from rljob.cli.doctor.operator_checks import (
    RLJOB_CRD,
    check_operator,
    find_operator,
)
from rljob.cli.doctor.operator_rules import OPERATOR_PERMISSIONS, Permission
from rljob.recipes import tpu as tpu_catalog

TESTED_MODULES = (
    "rljob.cli.doctor.common",
    "rljob.cli.doctor.findings",
    "rljob.cli.doctor.needs",
    "rljob.cli.doctor.nodepools",
    "rljob.cli.doctor.operator_checks",
    "rljob.cli.doctor.operator_rules",
    "rljob.cli.doctor.podsecurity",
)

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- builders


def schema_with(*paths: tuple[str, ...]) -> dict[str, Any]:
    """An openAPIV3Schema holding exactly these property paths (arrays where JobSet has them)."""
    arrays = {"rules", "replicatedJobs"}
    root: dict[str, Any] = {"type": "object", "properties": {}}
    for path in paths:
        node = root
        for name in path:
            props = node.setdefault("properties", {})
            child = props.setdefault(name, {"type": "object"})
            if name in arrays:
                child["type"] = "array"
                child = child.setdefault("items", {"type": "object"})
            node = child
    return root


def crd(
    name: str, version: str = "v1alpha2", schema: dict[str, Any] | None = None, served: bool = True
) -> Any:
    return {
        "metadata": {"name": name},
        "spec": {
            "versions": [
                {
                    "name": version,
                    "served": served,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema or {}},
                }
            ]
        },
    }


FULL_JOBSET = crd(JOBSET_CRD, schema=schema_with(*JOBSET_FIELDS))


def deployment(
    name: str, namespace: str, image: str, available: int = 1, sa: str = "default"
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "template": {"spec": {"serviceAccountName": sa, "containers": [{"name": "c", "image": image}]}}
        },
        "status": {"availableReplicas": available},
    }


def node(
    name: str,
    pool: str,
    accelerator: str,
    topology: str,
    tpu: int = 4,
    ready: bool = True,
    policy: str | None = None,
) -> Any:
    labels = {
        "cloud.google.com/gke-nodepool": pool,
        "cloud.google.com/gke-tpu-accelerator": accelerator,
        "cloud.google.com/gke-tpu-topology": topology,
    }
    if policy:  # a pool created with --placement-policy (multi-host tpu7x)
        labels["cloud.google.com/placement-policy-name"] = policy
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {
            "allocatable": {"google.com/tpu": str(tpu), "cpu": "200"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pool(name: str, accelerator: str, topology: str, hosts: int, **kw: Any) -> list[Any]:
    if accelerator == "tpu7x" and hosts > 1:
        kw.setdefault("policy", f"tpu7x-{hosts * 8}-{topology}-placement-policy")
    return [node(f"{name}-{i}", name, accelerator, topology, **kw) for i in range(hosts)]


def needs(
    trainer: str = "v5p-8",
    slices: int = 1,
    sampler: str = "v5p-8",
    replicas: int = 1,
    queue: str | None = None,
) -> Needs:
    return Needs(
        "demo",
        "team-a",
        (
            RoleNeed("trainer", tpu_catalog.plan(trainer), slices),
            RoleNeed("sampler", tpu_catalog.plan(sampler), replicas),
        ),
        queue,
    )


def statuses(findings: list[Finding]) -> list[tuple[str, Status]]:
    return [(f.check, f.status) for f in findings]


def worst(findings: list[Finding]) -> Status:
    order = [Status.OK, Status.WARNING, Status.PROBLEM]
    return max((f.status for f in findings), key=order.index, default=Status.OK)


# --------------------------------------------------------------------------------------- JobSet CRD


def _without(path: tuple[str, ...]) -> Any:
    return crd(JOBSET_CRD, schema=schema_with(*[p for p in JOBSET_FIELDS if p != path]))


@pytest.mark.parametrize(
    ("crds", "status", "needle"),
    [
        pytest.param({}, Status.PROBLEM, "not installed", id="missing"),
        pytest.param({JOBSET_CRD: FULL_JOBSET}, Status.OK, "every field", id="complete"),
        pytest.param(
            {JOBSET_CRD: crd(JOBSET_CRD, version="v1alpha1", schema=schema_with(*JOBSET_FIELDS))},
            Status.PROBLEM,
            "does not serve v1alpha2",
            id="old-version",
        ),
        pytest.param(
            {JOBSET_CRD: crd(JOBSET_CRD, schema=schema_with(*JOBSET_FIELDS), served=False)},
            Status.PROBLEM,
            "does not serve v1alpha2",
            id="not-served",
        ),
        *[
            pytest.param({JOBSET_CRD: _without(path)}, Status.PROBLEM, ".".join(path), id="lacks-" + path[-1])
            for path in JOBSET_FIELDS
        ],
    ],
)
def test_jobset_crd(crds: dict[str, Any], status: Status, needle: str) -> None:
    [finding] = check_jobset_crd(crds)
    assert finding.status is status
    assert needle in finding.message
    if status is Status.PROBLEM:
        assert TESTED_JOBSET_VERSION in finding.fix


def _real_jobset_crd() -> dict[str, Any] | None:
    """The JobSet CRD schema the renderer validates against (from the sigs.k8s.io/jobset module)."""
    path = resources.files("rljob.recipes") / "data" / f"jobset-{TESTED_JOBSET_VERSION}-schema.json"
    if not path.is_file():
        return None
    schema = json.loads(path.read_text())["schema"]
    out: dict[str, Any] = crd(JOBSET_CRD, schema=schema)
    return out


def test_real_jobset_crd_passes_and_a_stripped_copy_fails() -> None:
    real = _real_jobset_crd()
    assert real is not None, "recipes/data/jobset-<version>-schema.json is committed"
    assert statuses(check_jobset_crd({JOBSET_CRD: real})) == [("jobset.crd", Status.OK)]
    broken = copy.deepcopy(real)
    rules = broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "failurePolicy"
    ]["properties"]["rules"]["items"]["properties"]
    del rules["onJobFailureMessagePatterns"]  # what a JobSet older than v0.10.1 serves
    [finding] = check_jobset_crd({JOBSET_CRD: broken})
    assert finding.status is Status.PROBLEM
    assert "onJobFailureMessagePatterns" in finding.message
    older = copy.deepcopy(real)  # a v0.11 CRD: no per-Job restart counters
    rjs = older["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "replicatedJobsStatus"
    ]["items"]["properties"]
    del rjs["jobRestartsCountTowardsMax"]
    [finding] = check_jobset_crd({JOBSET_CRD: older})
    assert finding.status is Status.PROBLEM and "jobRestartsCountTowardsMax" in finding.message


def test_tested_jobset_version_is_the_pinned_one() -> None:
    pins = dict(
        line.split("=", 1)
        for line in (REPO / "hack" / "versions.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert pins["JOBSET_VERSION"] == TESTED_JOBSET_VERSION
    assert pins["KUEUE_VERSION"] == TESTED_KUEUE_VERSION
    assert parse_version(pins["JOBSET_VERSION"]) >= MIN_JOBSET_VERSION  # type: ignore[operator]


# --------------------------------------------------------------------------------- JobSet controller

JS_IMAGE = "registry.k8s.io/jobset/jobset:v0.12.0"
SERVING = Probe(allowed=True, defaulted=True)


@pytest.mark.parametrize(
    ("deployments", "probe", "expected"),
    [
        pytest.param([], None, [("jobset.controller", Status.PROBLEM)], id="nothing"),
        pytest.param(
            [deployment("jobset-controller-manager", "jobset-system", JS_IMAGE)],
            SERVING,
            [("jobset.controller", Status.OK), ("jobset.webhook", Status.OK)],
            id="healthy",
        ),
        pytest.param(
            [deployment("jobset-controller-manager", "jobset-system", JS_IMAGE, available=0)],
            Probe(False, False, error='Internal error occurred: failed calling webhook "mjobset.kb.io"'),
            [("jobset.controller", Status.PROBLEM), ("jobset.webhook", Status.PROBLEM)],
            id="down",
        ),
        pytest.param(
            [
                deployment(
                    "jobset-controller-manager", "jobset-system", "registry.k8s.io/jobset/jobset:v0.8.0"
                )
            ],
            SERVING,
            [("jobset.controller", Status.PROBLEM), ("jobset.webhook", Status.OK)],
            id="too-old",
        ),
        pytest.param(
            [
                deployment(
                    "jobset-controller-manager", "jobset-system", "registry.k8s.io/jobset/jobset:v0.13.1"
                )
            ],
            SERVING,
            [("jobset.controller", Status.OK), ("jobset.webhook", Status.OK)],
            id="newer-than-tested",
        ),
        pytest.param(
            [
                deployment(
                    "jobset-controller-manager", "jobset-system", "registry.k8s.io/jobset/jobset:v0.11.0"
                )
            ],
            SERVING,
            [("jobset.controller", Status.PROBLEM), ("jobset.webhook", Status.OK)],
            id="v0.11-lacks-restart-job",
        ),
        pytest.param(
            [deployment("jobset", "js", "registry.k8s.io/jobset/jobset@sha256:" + "a" * 64)],
            SERVING,
            [("jobset.controller", Status.WARNING), ("jobset.webhook", Status.OK)],
            id="digest-only",
        ),
        pytest.param(
            [deployment("jobset", "js", JS_IMAGE)],
            Probe(True, False),
            [("jobset.controller", Status.OK), ("jobset.webhook", Status.PROBLEM)],
            id="no-mutating-webhook",
        ),
        pytest.param(
            [],
            SERVING,
            [("jobset.webhook", Status.OK), ("jobset.controller", Status.WARNING)],
            id="out-of-cluster",
        ),
        pytest.param(
            [deployment("other", "x", "nginx:1.27")],
            Probe(False, False, forbidden=True),
            [("jobset.controller", Status.PROBLEM)],
            id="unrelated-deployment-probe-forbidden",
        ),
    ],
)
def test_jobset_controller(deployments: list[Any], probe: Probe | None, expected: list[Any]) -> None:
    assert statuses(check_jobset_controller(deployments, probe)) == expected


def test_jobset_controller_names_the_newer_tested_version() -> None:
    dep = deployment("j", "js", "registry.k8s.io/jobset/jobset:v0.13.1")
    [finding] = check_jobset_controller([dep], None)
    assert "v0.13.1" in finding.message and f"tested: {TESTED_JOBSET_VERSION}" in finding.message


def test_probe_result_reads_the_webhook_default() -> None:
    assert probe_result({"spec": {"network": {"enableDNSHostnames": True}}}) == Probe(True, True)
    assert probe_result({"spec": {}}) == Probe(True, False)
    body = probe_object("ns1")
    assert body["metadata"]["namespace"] == "ns1" and "network" not in body["spec"]
    assert [r["action"] for r in body["spec"]["failurePolicy"]["rules"]] == ["RestartJob"]


# ----------------------------------------------------------------------------------------- node pools

V5P8 = ("tpu-v5p-slice", "2x2x1", 1)
V5P16 = ("tpu-v5p-slice", "2x2x2", 2)
T7X8 = ("tpu7x", "2x2x1", 1)
T7X128 = ("tpu7x", "4x4x4", 16)


def pools(*specs: tuple[str, tuple[str, str, int]]) -> list[Any]:
    out: list[Any] = []
    for name, (acc, topo, hosts) in specs:
        out += pool(name, acc, topo, hosts)
    return out


@pytest.mark.parametrize(
    ("nodes", "need", "expected"),
    [
        pytest.param(
            pools(("a", V5P8), ("b", V5P8)),
            needs("v5p-8", 1, "v5p-8", 1),
            [("nodepools.trainer+sampler", Status.OK)],
            id="shared-shape-enough",
        ),
        pytest.param(
            pools(("a", V5P8)),
            needs("v5p-8", 1, "v5p-8", 1),
            [("nodepools.trainer+sampler", Status.PROBLEM)],
            id="shared-shape-one-short",
        ),
        pytest.param(
            pools(("t0", V5P16), ("t1", V5P16), ("s0", V5P8)),
            needs("v5p-16", 2, "v5p-8", 1),
            [("nodepools.trainer", Status.OK), ("nodepools.sampler", Status.OK)],
            id="multislice-trainer",
        ),
        pytest.param(
            pools(("t0", V5P16), ("s0", V5P8)),
            needs("v5p-16", 2, "v5p-8", 1),
            [("nodepools.trainer", Status.PROBLEM), ("nodepools.sampler", Status.OK)],
            id="one-slice-short",
        ),
        pytest.param(
            pool("t0", "tpu-v5p-slice", "2x2x2", 1) + pools(("s0", V5P8)),
            needs("v5p-16", 1, "v5p-8", 1),
            [("nodepools.trainer", Status.PROBLEM), ("nodepools.sampler", Status.OK)],
            id="pool-with-too-few-nodes",
        ),
        pytest.param(
            pools(("t0", V5P16), ("s0", V5P8)),
            needs("v5p-16", 1, "tpu7x-8", 1),
            [("nodepools.trainer", Status.OK), ("nodepools.sampler", Status.PROBLEM)],
            id="wrong-generation",
        ),
        pytest.param(
            pools(("t0", V5P16)) + pool("s0", "tpu-v5p-slice", "2x2x1", 1, tpu=0),
            needs("v5p-16", 1, "v5p-8", 1),
            [
                ("nodepools.trainer", Status.OK),
                ("nodepools.sampler", Status.OK),
                ("nodepools.sampler", Status.PROBLEM),
            ],
            id="device-plugin-not-ready",
        ),
        pytest.param(
            pools(("t0", V5P16)) + pool("s0", "tpu-v5p-slice", "2x2x1", 1, ready=False),
            needs("v5p-16", 1, "v5p-8", 1),
            [
                ("nodepools.trainer", Status.OK),
                ("nodepools.sampler", Status.OK),
                ("nodepools.sampler", Status.WARNING),
            ],
            id="node-not-ready",
        ),
        pytest.param(
            pools(("t0", T7X128), ("s0", T7X8), ("s1", T7X8)),
            needs("tpu7x-128", 1, "tpu7x-8", 2),
            [("nodepools.trainer", Status.OK), ("nodepools.sampler", Status.OK)],
            id="ironwood",
        ),
        pytest.param(
            pool("t0", *T7X128, policy="my-own-policy") + pools(("s0", T7X8), ("s1", T7X8)),
            needs("tpu7x-128", 1, "tpu7x-8", 2),
            [("nodepools.trainer", Status.PROBLEM), ("nodepools.sampler", Status.OK)],
            id="ironwood-pool-of-another-workload-policy",  # the pods select tpu7x-128-4x4x4-placement-policy
        ),
        pytest.param([], None, [("nodepools", Status.WARNING)], id="no-manifest-no-tpus"),
        pytest.param(pools(("a", V5P8)), None, [("nodepools", Status.OK)], id="no-manifest"),
    ],
)
def test_node_pools(nodes: list[Any], need: Needs | None, expected: list[Any]) -> None:
    assert statuses(check_node_pools(nodes, need)) == expected


def test_missing_pool_message_counts_and_fix_is_a_gcloud_command() -> None:
    [trainer, _] = check_node_pools(pools(("t0", V5P16), ("s0", V5P8)), needs("v5p-16", 3, "v5p-8", 1))
    assert "need 3 node pools of tpu-v5p-slice 2x2x2 (v5p-16, 2 nodes each); found 1: t0" in trainer.message
    assert trainer.fix.startswith("create 2 more, e.g. gcloud container node-pools create")
    assert (
        "--machine-type=ct5p-hightpu-4t --num-nodes=2 --tpu-topology=2x2x2 --placement-type=COMPACT"
        in trainer.fix
    )


@pytest.mark.parametrize(
    ("tpu", "fragments"),
    [
        ("v5p-8", ["--machine-type=ct5p-hightpu-4t", "--num-nodes=1"]),
        ("v5p-128", ["--num-nodes=16", "--tpu-topology=4x4x4", "--placement-type=COMPACT"]),
        ("tpu7x-8", ["--machine-type=tpu7x-standard-4t", "--num-nodes=1"]),
        ("tpu7x-2", ["--machine-type=tpu7x-standard-1t", "--num-nodes=1"]),
        (
            "tpu7x-128",
            [
                "create workload-policy tpu7x-128-4x4x4-placement-policy --type=HIGH_THROUGHPUT",
                "--accelerator-topology=4x4x4",
                "--num-nodes=16 --placement-policy=tpu7x-128-4x4x4-placement-policy",
            ],
        ),
    ],
)
def test_create_pool_command(tpu: str, fragments: list[str]) -> None:
    cmd = create_pool_command(tpu_catalog.plan(tpu), "p")
    for fragment in fragments:
        assert fragment in cmd
    if tpu.startswith("tpu7x") and "128" in tpu:
        assert "--tpu-topology" not in cmd  # the workload policy replaces it on multi-host Ironwood
    if tpu_catalog.plan(tpu).hosts == 1:  # a single-host pool names no topology (as xpk creates it)
        assert "--tpu-topology" not in cmd and "--placement" not in cmd


@pytest.mark.parametrize(("disk_gb", "flag"), [(None, None), (100, None), (130, "--disk-size=130")])
def test_create_pool_command_asks_for_the_caches_boot_disk(disk_gb: int | None, flag: str | None) -> None:
    cmd = create_pool_command(tpu_catalog.plan("v5p-8"), "p", disk_gb)
    assert ("--disk-size" in cmd) == (flag is not None) and (flag is None or flag in cmd)


def test_pools_whose_nodes_cannot_hold_the_caches_are_a_problem_with_the_disk_to_use() -> None:
    """A sampler pod's cache emptyDir asks the plan's ephemeral storage: nodes that offer less (GKE's default
    100 GB boot disk leaves about 44 GiB) cannot run it; the fix names the boot disk that holds it, the
    same figure as the create command of a missing pool."""
    gib = 2**30
    need = needs()
    sampler = RoleNeed("sampler", tpu_catalog.plan("v5p-8"), 1, cache_bytes=35 * gib)
    need = Needs(need.name, need.namespace, (need.roles[0], sampler))

    def nodes(allocatable_gib: int) -> list[Any]:
        got = pool("t", "tpu-v5p-slice", "2x2x1", 1) + pool("s", "tpu-v5p-slice", "2x2x1", 1)
        for n in got:
            n["status"]["allocatable"]["ephemeral-storage"] = f"{allocatable_gib}Gi"
        return got

    # Trainer and sampler share the v5p-8 pools: each pool must hold the larger request.
    bad = [f for f in check_node_pools(nodes(30), need) if f.status is Status.PROBLEM]
    assert [f.message.split(":")[0] for f in bad] == ["pool t", "pool s"]
    assert "30 GiB of ephemeral storage, a pod's caches ask 35 GiB" in bad[0].message
    assert all("--disk-size=130" in f.fix for f in bad)
    assert [f for f in check_node_pools(nodes(100), need) if f.status is Status.PROBLEM] == []


# ---------------------------------------------------------------------------------------------- Kueue

LQ_CRDS = {LOCALQUEUE_CRD: crd(LOCALQUEUE_CRD, version="v1beta1")}


def lq(name: str, namespace: str = "team-a", active: str | None = "True") -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {"name": name, "namespace": namespace}, "spec": {"clusterQueue": "cq"}}
    if active is not None:
        obj["status"] = {
            "conditions": [{"type": "Active", "status": active, "reason": "ClusterQueueDoesNotExist"}]
        }
    return obj


@pytest.mark.parametrize(
    ("crds", "queues", "need", "expected"),
    [
        pytest.param({}, None, needs(), [], id="no-queue-named"),
        pytest.param({}, None, needs(queue="lq"), [Status.PROBLEM], id="kueue-missing"),
        pytest.param(LQ_CRDS, [], needs(queue="lq"), [Status.PROBLEM], id="queue-missing"),
        pytest.param(LQ_CRDS, [lq("other")], needs(queue="lq"), [Status.PROBLEM], id="other-queue-only"),
        pytest.param(LQ_CRDS, [lq("lq", active="False")], needs(queue="lq"), [Status.PROBLEM], id="inactive"),
        pytest.param(LQ_CRDS, [lq("lq")], needs(queue="lq"), [Status.OK], id="active"),
        pytest.param(LQ_CRDS, [lq("lq", active=None)], needs(queue="lq"), [Status.OK], id="no-status-yet"),
        pytest.param(LQ_CRDS, None, needs(queue="lq"), [Status.WARNING], id="forbidden"),
    ],
)
def test_queue(crds: dict[str, Any], queues: list[Any] | None, need: Needs, expected: list[Status]) -> None:
    assert [f.status for f in check_queue(crds, queues, need)] == expected


def test_missing_queue_fix_is_a_localqueue_manifest() -> None:
    [finding] = check_queue(LQ_CRDS, [], needs(queue="lq"))
    assert "spec.queueName" in finding.message
    assert "kind: LocalQueue" in finding.fix and "namespace: team-a" in finding.fix


# ------------------------------------------------------------------------------------------- operator

OP_NS, OP_SA = "rljob-system", "rljob-operator"
RLJOB_CRDS = {RLJOB_CRD: crd(RLJOB_CRD, version="v1alpha1")}
OP_DEP = deployment("rljob-operator", OP_NS, "ghcr.io/rljob/rljob-operator:0.1.0", sa=OP_SA)
ALL_ALLOWED: dict[Permission, bool | None] = dict.fromkeys(OPERATOR_PERMISSIONS, True)


def webhook_config(
    groups: list[str] | None = None, resources_: list[str] | None = None, ca: str = "Y2E="
) -> dict[str, Any]:
    return {
        "metadata": {"name": "rljob.dev"},
        "webhooks": [
            {
                "name": "validate.rljob.dev",
                "clientConfig": {"service": {"namespace": OP_NS, "name": "rljob-webhook"}, "caBundle": ca},
                "rules": [
                    {
                        "apiGroups": groups or ["rljob.dev"],
                        "resources": resources_ or ["rljobs"],
                        "operations": ["CREATE", "UPDATE"],
                    }
                ],
            }
        ],
    }


def _denied(*verbs: str) -> dict[Permission, bool | None]:
    out = dict(ALL_ALLOWED)
    for p in out:
        if f"{p.verb} {p.resource}" in verbs:
            out[p] = False
    return out


@pytest.mark.parametrize(
    ("crds", "deps", "hooks", "access", "me", "expected"),
    [
        pytest.param(
            RLJOB_CRDS, [OP_DEP], [webhook_config()], ALL_ALLOWED, True,
            {"operator.crd": Status.OK, "operator.deployment": Status.OK, "operator.rbac": Status.OK,
             "operator.webhook": Status.OK, "user.rbac": Status.OK},
            id="healthy",
        ),
        pytest.param(
            {}, [], [], {}, None,
            {"operator.crd": Status.PROBLEM, "operator.deployment": Status.PROBLEM,
             "operator.webhook": Status.PROBLEM},
            id="not-installed",
        ),
        pytest.param(
            RLJOB_CRDS, [OP_DEP], [webhook_config()], _denied("create jobsets", "patch configmaps"), True,
            {"operator.crd": Status.OK, "operator.deployment": Status.OK, "operator.rbac": Status.PROBLEM,
             "operator.webhook": Status.OK, "user.rbac": Status.OK},
            id="rbac-missing",
        ),
        pytest.param(
            RLJOB_CRDS, [OP_DEP], [webhook_config()], dict.fromkeys(OPERATOR_PERMISSIONS), True,
            {"operator.crd": Status.OK, "operator.deployment": Status.OK, "operator.rbac": Status.WARNING,
             "operator.webhook": Status.OK, "user.rbac": Status.OK},
            id="rbac-unknown",
        ),
        pytest.param(
            RLJOB_CRDS, [OP_DEP], [webhook_config(ca="")], ALL_ALLOWED, False,
            {"operator.crd": Status.OK, "operator.deployment": Status.OK, "operator.rbac": Status.OK,
             "operator.webhook": Status.PROBLEM, "user.rbac": Status.PROBLEM},
            id="webhook-without-ca-and-user-denied",
        ),
        pytest.param(
            RLJOB_CRDS, [OP_DEP], [webhook_config(groups=["batch"], resources_=["jobs"])], ALL_ALLOWED, True,
            {"operator.crd": Status.OK, "operator.deployment": Status.OK, "operator.rbac": Status.OK,
             "operator.webhook": Status.PROBLEM, "user.rbac": Status.OK},
            id="webhook-for-something-else",
        ),
        pytest.param(
            RLJOB_CRDS, [deployment("rljob-operator", OP_NS, "x:1", available=0, sa=OP_SA)],
            [webhook_config()], ALL_ALLOWED, True,
            {"operator.crd": Status.OK, "operator.deployment": Status.PROBLEM, "operator.rbac": Status.OK,
             "operator.webhook": Status.OK, "user.rbac": Status.OK},
            id="operator-down",
        ),
        pytest.param(
            RLJOB_CRDS, [deployment("rljob-operator", "elsewhere", "x:1", sa=OP_SA)], [webhook_config()],
            ALL_ALLOWED, True,
            {"operator.crd": Status.OK, "operator.deployment": Status.PROBLEM, "operator.rbac": Status.OK,
             "operator.webhook": Status.OK, "user.rbac": Status.OK},
            id="operator-in-another-namespace",
        ),
    ],
)  # fmt: skip
def test_operator(
    crds: dict[str, Any],
    deps: list[Any],
    hooks: list[Any],
    access: dict[Permission, bool | None],
    me: bool | None,
    expected: dict[str, Status],
) -> None:
    findings = check_operator(crds, deps, hooks, access, me, OP_NS, OP_SA, "team-a")
    assert dict(statuses(findings)) == expected
    assert len(findings) == len(expected)


def test_denied_permissions_are_named() -> None:
    findings = check_operator(
        RLJOB_CRDS, [OP_DEP], [webhook_config()], _denied("create jobsets"), True, OP_NS, OP_SA, "team-a"
    )
    [rbac] = [f for f in findings if f.check == "operator.rbac"]
    assert (
        rbac.message
        == f"system:serviceaccount:{OP_NS}:{OP_SA} may not: create jobsets.jobset.x-k8s.io (namespace team-a)"
    )


# ---------------------------------------------------------------------------------- report and exit


def test_run_checks_on_a_complete_cluster_exits_0() -> None:
    state = ClusterState(
        crds={JOBSET_CRD: FULL_JOBSET, **RLJOB_CRDS, **LQ_CRDS},
        deployments=[deployment("jobset-controller-manager", "jobset-system", JS_IMAGE), OP_DEP],
        nodes=pools(("t0", V5P16), ("t1", V5P16), ("s0", V5P8)),
        local_queues=[lq("lq")],
        kueue_config={"data": {KUEUE_CONFIG_KEY: "apiVersion: config.kueue.x-k8s.io/v1beta2\n"}},
        webhooks=[webhook_config()],
        access=dict(ALL_ALLOWED),
        can_create_rljobs=True,
        jobset_probe=SERVING,
        operator_namespace=OP_NS,
        operator_sa=OP_SA,
    )
    findings = run_checks(state, needs("v5p-16", 2, "v5p-8", 1, queue="lq"))
    assert worst(findings) is Status.OK, render_text(findings)
    assert exit_code(findings) == EXIT_OK
    # Remove one piece at a time: each is reported, and the exit code says so.
    for attr, value in [
        ("crds", {**RLJOB_CRDS, **LQ_CRDS}),
        ("nodes", pools(("t0", V5P16), ("s0", V5P8))),
        ("local_queues", []),
        ("webhooks", []),
        ("operator_sa", "someone-else"),
        ("jobset_probe", Probe(False, False, error="connection refused")),
    ]:
        broken = copy.copy(state)
        setattr(broken, attr, value)
        got = run_checks(broken, needs("v5p-16", 2, "v5p-8", 1, queue="lq"))
        assert exit_code(got) == EXIT_PROBLEMS, attr


def test_render_text_lists_fixes_and_counts() -> None:
    text = render_text([ok("a", "fine"), problem("b", "broken", "do x\ndo y"), warning("c", "hmm")])
    lines = text.splitlines()
    assert lines[0].split() == ["ok", "a", "fine"]
    assert lines[1].split() == ["PROBLEM", "b", "broken"]
    assert lines[2].split() == ["fix:", "do", "x"]
    assert lines[3].split() == ["do", "y"]
    assert lines[-1] == "1 problem, 1 warning"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("v0.11.0", (0, 11, 0)),
        ("0.10.1", (0, 10, 1)),
        ("v1.2.3-rc.1", (1, 2, 3)),
        ("latest", None),
        ("", None),
    ],
)
def test_parse_version(text: str, expected: tuple[int, int, int] | None) -> None:
    assert parse_version(text) == expected


# ------------------------------------------------------------------------------ operator discovery


def sa(namespace: str, name: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name}}


@pytest.mark.parametrize(
    ("accounts", "namespace", "name", "expected"),
    [
        ([sa("ops", "x-rljob-operator")], None, None, ("ops", "x-rljob-operator")),
        ([], None, None, ("rljob-system", "rljob-rljob-operator")),
        ([sa("a", "o"), sa("b", "o")], None, None, ("rljob-system", "rljob-rljob-operator")),
        ([sa("a", "o"), sa("b", "o")], "b", None, ("b", "o")),
        ([sa("a", "o")], "elsewhere", "mine", ("elsewhere", "mine")),
    ],
)
def test_find_operator(
    accounts: list[Any], namespace: str | None, name: str | None, expected: tuple[str, str]
) -> None:
    assert find_operator(accounts, namespace, name) == expected


def test_operator_permissions_are_the_charts_cluster_role() -> None:
    """doctor checks exactly what the chart grants: a rule added to one and not the other fails here."""
    import yaml

    # The rules are one generated block (`rljob.rules`, hack/gen_rbac.py) that both the ClusterRole and the
    # namespaced Roles include; tests/chart/test_chart.py compares the rendered objects too.
    text = (REPO / "charts" / "rljob" / "templates" / "_rules.tpl").read_text()
    block = text.split('{{- define "rljob.rules" -}}', 1)[1].split("{{- end }}", 1)[0]
    granted = set()
    for rule in yaml.safe_load(block):
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                resource, _, sub = res.partition("/")
                for verb in rule["verbs"]:
                    granted.add((verb, group, resource, sub))
    checked = {(p.verb, p.group, p.resource, p.subresource) for p in OPERATOR_PERMISSIONS}
    assert checked == granted


# -------------------------------------------------------------------------- the operator's admission

UNREACHABLE = Probe(
    False,
    False,
    error='Internal error occurred: failed calling webhook "validate-rljob.rljob.dev": failed to call '
    'webhook: Post "https://127.0.0.1:9443/validate": dial tcp 127.0.0.1:9443: connect: connection refused',
)
DENIED = Probe(
    False,
    False,
    error='admission webhook "validate-rljob.rljob.dev" denied the request: '
    "spec.trainer.mesh: 3 does not divide 4",
)


@pytest.mark.parametrize(
    ("deps", "admission", "for_manifest", "expected"),
    [
        ([], Probe(True, False), False,
         {"operator.deployment": Status.WARNING, "operator.admission": Status.OK}),
        ([OP_DEP], UNREACHABLE, False,
         {"operator.deployment": Status.OK, "operator.admission": Status.PROBLEM}),
        ([], UNREACHABLE, True,
         {"operator.deployment": Status.PROBLEM, "operator.admission": Status.PROBLEM}),
        ([OP_DEP], DENIED, True,
         {"operator.deployment": Status.OK, "operator.admission": Status.PROBLEM}),
        ([], DENIED, True,
         {"operator.deployment": Status.WARNING, "operator.admission": Status.PROBLEM}),
        ([OP_DEP], Probe(False, False, forbidden=True), True, {"operator.deployment": Status.OK}),
    ],
    ids=["outside-cluster", "down", "down-no-deployment", "manifest-refused", "outside-refused", "forbidden"],
)  # fmt: skip
def test_operator_admission(
    deps: list[Any], admission: Probe, for_manifest: bool, expected: dict[str, Status]
) -> None:
    findings = check_operator(
        RLJOB_CRDS,
        deps,
        [webhook_config()],
        ALL_ALLOWED,
        True,
        OP_NS,
        OP_SA,
        "team-a",
        admission,
        for_manifest,
    )
    got = {f.check: f.status for f in findings if f.check in ("operator.deployment", "operator.admission")}
    assert got == expected
    if admission is DENIED:
        [refused] = [f for f in findings if f.check == "operator.admission"]
        assert (
            "refuses this manifest: admission webhook" in refused.message
            and "spec.trainer.mesh" in refused.message
        )


def test_probe_rljob_is_a_valid_manifest() -> None:
    from rljob.recipes.plan import parse_manifest, resolve

    run = resolve(parse_manifest(yaml.safe_dump(probe_rljob("ns1"))))
    assert run.namespace == "ns1"


def test_unreadable_cluster_is_one_access_problem_not_a_list_of_missing_things() -> None:
    state = ClusterState(unreadable=["customresourcedefinitions", "nodes"], can_create_rljobs=False)
    findings = run_checks(state, needs())
    assert statuses(findings) == [("access", Status.PROBLEM), ("user.rbac", Status.PROBLEM)]
    assert "customresourcedefinitions, nodes" in findings[0].message


def _hooks(name: str, group: str, resource: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "webhooks": [{"name": "h", "rules": [{"apiGroups": [group], "resources": [resource]}]}],
    }


JS_MUTATING = _hooks("jobset-mutating-webhook-configuration", "jobset.x-k8s.io", "jobsets")
JS_VALIDATING = _hooks("jobset-validating-webhook-configuration", "jobset.x-k8s.io", "jobsets")


@pytest.mark.parametrize(
    ("mutating", "validating", "missing"),
    [
        ([JS_MUTATING], [JS_VALIDATING], []),
        ([], [JS_VALIDATING], ["mutating"]),
        ([JS_MUTATING], [webhook_config()], ["validating"]),
        ([_hooks("other", "batch", "jobs")], [], ["mutating", "validating"]),
        (None, [], []),  # not readable: nothing said
    ],
)
def test_jobset_webhook_configs(
    mutating: list[Any] | None, validating: list[Any], missing: list[str]
) -> None:
    findings = check_jobset_webhook_configs(mutating, validating)
    assert [f.message.split()[1] for f in findings] == missing
    assert all(f.status is Status.PROBLEM and f.check == "jobset.webhook" for f in findings)


@pytest.mark.parametrize(
    ("error", "status", "needles"),
    [
        (
            'Internal error occurred: failed calling webhook "mjobset.kb.io": connect: connection refused',
            Status.PROBLEM,
            ["unreachable"],
        ),
        (
            'admission webhook "vjobset.kb.io" denied the request: panic: runtime error',
            Status.PROBLEM,
            ["refused a minimal"],
        ),
        # The gate off: the operator falls back (a warning), and doctor names the gate and what it buys.
        (
            'admission webhook "vjobset.kb.io" denied the request: RestartJob and '
            "RestartJobAndIgnoreMaxRestarts failure policy actions are not allowed when RestartJob feature "
            "gate is disabled",
            Status.WARNING,
            [
                "feature gate RestartJob is off",
                "a sampler crash restarts the whole run",
                "the gate buys a sampler's own restart",
                "jobset.restartJob: enabled",
            ],
        ),
        (
            'JobSet.jobset.x-k8s.io "p" is invalid: spec.failurePolicy.rules[0].action: Unsupported value: '
            '"RestartJob"',
            Status.PROBLEM,
            ["does not know the failure action RestartJob"],
        ),
    ],
)
def test_jobset_probe_refusals_are_told_apart(error: str, status: Status, needles: list[str]) -> None:
    findings = check_jobset_controller([], Probe(False, False, error=error))
    [hook] = [f for f in findings if f.check == "jobset.webhook"]
    assert hook.status is status and all(n in hook.message for n in needles), hook.message
    if status is Status.WARNING:
        assert "featureGates: {RestartJob: true}" in (hook.fix or "")


@pytest.mark.parametrize(
    ("ns", "status", "needle"),
    [
        ({"metadata": {"name": "rl"}}, "warning", "enforces no Pod Security level"),
        (
            {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "privileged"}}},
            "warning",
            "privileged",
        ),
        ({"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "baseline"}}}, "ok", "baseline"),
        (
            {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
            "problem",
            "run as root",
        ),
        (False, "warning", "cannot read namespace"),
    ],
)
def test_pod_security(ns: Any, status: str, needle: str) -> None:
    from rljob.cli.doctor.podsecurity import check_pod_security

    (finding,) = check_pod_security(ns, "rl")
    assert finding.status == status and needle in finding.message, finding
    if status != "ok":
        assert (
            finding.fix == "" if ns is False else "pod-security.kubernetes.io/enforce=baseline" in finding.fix
        )
