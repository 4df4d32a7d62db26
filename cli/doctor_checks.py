"""The checks of `rljob doctor [--for FILE]` (cli/doctor.py): does this cluster have what an RLJob needs?

What it checks, and how to fix each gap, printed one finding per line:

- JobSet: the CRD `jobsets.jobset.x-k8s.io` serves v1alpha2 and its schema has every field rljob
  renders (an older JobSet silently drops unknown fields); the controller runs (a Deployment running a
  JobSet image, its version from the image tag) and its webhook answers (a server-side dry-run of a
  tiny JobSet comes back defaulted).
- TPU node pools for the manifest's trainer and sampler shapes (labels
  cloud.google.com/gke-tpu-accelerator / gke-tpu-topology, grouped by cloud.google.com/gke-nodepool):
  JobSet's exclusive placement puts every slice on a node pool of its own, so a role with N slices
  needs N pools of the shape, each with the slice's host count; roles with the same shape add up.
- The Kueue LocalQueue named by spec.queueName, and that it is active.
- The operator: the RLJob CRD, its Deployment, its ServiceAccount's RBAC (SubjectAccessReview per
  permission the operator uses), and the validating webhook for rljobs; plus whether you yourself may
  create RLJobs in the namespace (SelfSubjectAccessReview).

The checks are pure functions over plain Kubernetes objects (the JSON the API server returns), so
they are table-tested without a cluster (tests/doctor/); `gather` reads those objects with the
`kubernetes` client, which is imported lazily: the rest of the CLI works without it.

Exit codes: 0 nothing missing (warnings allowed), 1 problems found, 2 bad input.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from rljob.cli.doctor import (
    DEFAULT_OPERATOR_NAMESPACE,
    DEFAULT_OPERATOR_SERVICE_ACCOUNT,
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_PROBLEMS,
)
from rljob.recipes.api import GROUP, PLURAL
from rljob.recipes.api import VERSION as RLJOB_VERSION
from rljob.recipes.placement import NODEPOOL_LABEL
from rljob.recipes.runconfig import TpuPlan
from rljob.recipes.tpu import ACCELERATOR_LABEL, PLACEMENT_POLICY_LABEL, TOPOLOGY_LABEL, TPU_RESOURCE

__all__ = ["EXIT_BAD_INPUT", "EXIT_OK", "EXIT_PROBLEMS"]

Obj = Mapping[str, Any]

# ------------------------------------------------------------------------------------------ constants

JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_CRD = f"jobsets.{JOBSET_GROUP}"
# The JobSet release rljob is tested with (hack/versions.env JOBSET_VERSION; a test keeps them equal)
# and the oldest one it supports: v0.10.1 added failurePolicy.rules[].onJobFailureMessagePatterns,
# which the exit-code contract's rules need, and is the minimum GKE names for TPU7x multislice.
TESTED_JOBSET_VERSION = "v0.11.0"
MIN_JOBSET_VERSION = (0, 10, 1)
JOBSET_INSTALL = (
    "kubectl apply --server-side -f "
    f"https://github.com/kubernetes-sigs/jobset/releases/download/{TESTED_JOBSET_VERSION}/manifests.yaml"
)
# Schema paths (below the CRD's openAPIV3Schema) of JobSet fields the renderer writes; arrays are
# walked through `items` implicitly.
JOBSET_FIELDS: tuple[tuple[str, ...], ...] = (
    ("spec", "coordinator"),
    ("spec", "network", "publishNotReadyAddresses"),
    ("spec", "successPolicy", "targetReplicatedJobs"),
    ("spec", "failurePolicy", "restartStrategy"),
    ("spec", "failurePolicy", "rules", "onJobFailureMessagePatterns"),
    ("spec", "replicatedJobs", "dependsOn"),
)

KUEUE_GROUP = "kueue.x-k8s.io"
LOCALQUEUE_CRD = f"localqueues.{KUEUE_GROUP}"
TESTED_KUEUE_VERSION = "v0.17.0"

RLJOB_CRD = f"{PLURAL}.{GROUP}"


@dataclass(frozen=True)
class Permission:
    """One permission the operator's ServiceAccount needs."""

    verb: str
    group: str
    resource: str
    subresource: str = ""
    namespaced: bool = True

    def __str__(self) -> str:
        res = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return f"{self.verb} {res}.{self.group}" if self.group else f"{self.verb} {res}"


def _perms(verbs: str, group: str, resource: str, sub: str = "", namespaced: bool = True) -> list[Permission]:
    return [Permission(v, group, resource, sub, namespaced) for v in verbs.split()]


# What the operator does with each kind: exactly the chart's ClusterRole (charts/rljob/templates/
# rbac.yaml; tests/doctor/ checks the two agree). RLJobs are watched and only their status written; the
# JobSet and the run/progress ConfigMaps are server-side applied; failed pods are watched to classify
# failures (never created: the JobSet controller makes pods); each RLJob's pods get a ServiceAccount
# and a Role/RoleBinding for their progress ConfigMap; events are posted; a queued run's Kueue Workload
# gets spec.active (spec.suspend under Kueue, rljob.operator.kueue).
OPERATOR_PERMISSIONS: tuple[Permission, ...] = tuple(
    _perms("get list watch", GROUP, PLURAL)
    + _perms("get patch", GROUP, PLURAL, "status")
    + _perms("update", GROUP, PLURAL, "finalizers")
    + _perms("get list watch create patch", JOBSET_GROUP, "jobsets")
    + _perms("list patch", KUEUE_GROUP, "workloads")
    + _perms("get list watch create patch", "", "configmaps")
    + _perms("list watch", "", "pods")
    + _perms("get create patch", "", "serviceaccounts")
    + _perms("get create patch", "", "services")
    + _perms("get create patch", "rbac.authorization.k8s.io", "roles")
    + _perms("get create patch", "rbac.authorization.k8s.io", "rolebindings")
    + _perms("create patch", "events.k8s.io", "events")
    + _perms("create patch", "", "events")
)
# The chart labels its ServiceAccount and Deployment with this; doctor finds the operator by it.
OPERATOR_LABEL = "app.kubernetes.io/name=rljob-operator"


# ------------------------------------------------------------------------------------------- findings


class Status(StrEnum):
    OK = "ok"
    WARNING = "warning"
    PROBLEM = "problem"


@dataclass(frozen=True)
class Finding:
    """One line of the report: what was checked, what was found, how to fix it."""

    check: str
    status: Status
    message: str
    fix: str = ""


def ok(check: str, message: str) -> Finding:
    return Finding(check, Status.OK, message)


def warning(check: str, message: str, fix: str = "") -> Finding:
    return Finding(check, Status.WARNING, message, fix)


def problem(check: str, message: str, fix: str = "") -> Finding:
    return Finding(check, Status.PROBLEM, message, fix)


# ---------------------------------------------------------------------------------------------- needs


@dataclass(frozen=True)
class RoleNeed:
    """The slices one role of the RLJob needs."""

    role: str  # trainer | sampler
    tpu: TpuPlan
    slices: int


@dataclass(frozen=True)
class Reference:
    """An object a pod override names, which must exist in the RLJob's namespace before its pods start."""

    kind: str  # Secret | ConfigMap | ServiceAccount | PersistentVolumeClaim | CSIDriver (cluster-scoped)
    name: str
    field: str  # where the manifest names it
    key: str | None = None  # a Secret's or ConfigMap's key
    optional: bool = False


def template_references(spec: Any) -> list[Reference]:
    """Every object the roles' pod overrides name (rljob.recipes.api.PodTemplate), in manifest order."""
    out: list[Reference] = []
    for role in ("trainer", "sampler"):
        template = getattr(getattr(spec, role, None), "template", None)
        pod = template.spec if template is not None else None
        if pod is None:
            continue
        base = f"spec.{role}.template.spec"
        for i, env in enumerate(pod.env or []):
            src = env.value_from or {}
            for kind, ref in (("Secret", src.get("secretKeyRef")), ("ConfigMap", src.get("configMapKeyRef"))):
                if isinstance(ref, dict) and ref.get("name"):
                    field_ = f"{base}.env[{i}].valueFrom"
                    out.append(
                        Reference(kind, ref["name"], field_, ref.get("key"), bool(ref.get("optional")))
                    )
        for i, src in enumerate(pod.env_from or []):
            for kind, ref in (("Secret", src.get("secretRef")), ("ConfigMap", src.get("configMapRef"))):
                if isinstance(ref, dict) and ref.get("name"):
                    out.append(
                        Reference(kind, ref["name"], f"{base}.envFrom[{i}]", None, bool(ref.get("optional")))
                    )
        for i, vol in enumerate(pod.volumes or []):
            where = f"{base}.volumes[{i}]"
            secret, cm, pvc, csi = (
                vol.get(k) or {} for k in ("secret", "configMap", "persistentVolumeClaim", "csi")
            )
            if secret.get("secretName"):
                out.append(
                    Reference("Secret", secret["secretName"], where, None, bool(secret.get("optional")))
                )
            if cm.get("name"):
                out.append(Reference("ConfigMap", cm["name"], where, None, bool(cm.get("optional"))))
            if pvc.get("claimName"):
                out.append(Reference("PersistentVolumeClaim", pvc["claimName"], where))
            if csi.get("driver"):
                out.append(Reference("CSIDriver", csi["driver"], where))
        if pod.service_account_name:
            out.append(Reference("ServiceAccount", pod.service_account_name, f"{base}.serviceAccountName"))
    return out


_CREATE = {
    "Secret": "kubectl -n {ns} create secret generic {name} --from-literal={key}=...",
    "ConfigMap": "kubectl -n {ns} create configmap {name} --from-literal={key}=...",
    "ServiceAccount": "kubectl -n {ns} create serviceaccount {name}",
    "PersistentVolumeClaim": "create the PersistentVolumeClaim {name} in namespace {ns}",
    "CSIDriver": "enable the driver on the cluster (for GCS FUSE: gcloud container clusters update CLUSTER "
    "--update-addons GcsFuseCsiDriver=ENABLED)",
}


def check_references(
    references: Sequence[Reference], found: Mapping[tuple[str, str], Obj | bool | None], namespace: str
) -> list[Finding]:
    """`found[(kind, name)]`: the object (a Secret's or ConfigMap's data keys are checked), None when it
    does not exist, False when doctor may not read it."""
    out: list[Finding] = []
    for ref in references:
        what = f"{ref.kind} {ref.name}" + (f" (key {ref.key})" if ref.key else "") + f", named by {ref.field}"
        got = found.get((ref.kind, ref.name), False)
        fix = _CREATE[ref.kind].format(ns=namespace, name=ref.name, key=ref.key or "KEY")
        if got is False:
            out.append(warning("pods.references", f"cannot read {what}: not checked"))
        elif got is None:
            if ref.optional:
                out.append(ok("pods.references", f"{what}: missing, but optional"))
            else:
                where = "on the cluster" if ref.kind == "CSIDriver" else f"in namespace {namespace}"
                out.append(
                    problem("pods.references", f"{what}: not found {where}; the pods cannot start", fix)
                )
        elif (
            ref.key
            and isinstance(got, dict)
            and ref.key not in {**(got.get("data") or {}), **(got.get("binaryData") or {})}
        ):
            if ref.optional:
                out.append(ok("pods.references", f"{what}: no such key, but optional"))
            else:
                out.append(problem("pods.references", f"{what}: the object has no key {ref.key}", fix))
        else:
            out.append(ok("pods.references", f"{what}: exists"))
    return out


@dataclass(frozen=True)
class Needs:
    """What one RLJob manifest needs from the cluster."""

    name: str
    namespace: str
    roles: tuple[RoleNeed, ...]
    queue_name: str | None = None
    # The manifest as parsed (camelCase JSON): doctor dry-runs it through the operator's webhook.
    manifest: Mapping[str, Any] | None = field(default=None, compare=False)
    # What the pod overrides (spec.*.template) name in the namespace: Secrets, ConfigMaps, ...
    references: tuple[Reference, ...] = ()


class BadInput(Exception):
    """The manifest is wrong; one `spec.path: message` line per problem."""


def needs_from_manifest(path: Path) -> Needs:
    """Resolve FILE with the recipe core (the same plan `rljob render` uses) into what it needs."""
    from rljob.recipes.plan import PlanError, parse_manifest, resolve

    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        job = parse_manifest(text)
        run = resolve(job)
    except PlanError as exc:
        raise BadInput("\n".join(exc.problems)) from None
    return Needs(
        run.name,
        run.namespace,
        (
            RoleNeed("trainer", run.trainer.tpu, run.trainer.slices),
            RoleNeed("sampler", run.sampler.tpu, run.sampler.replicas),
        ),
        run.spec.queue_name,
        job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"}),
        tuple(template_references(run.spec)),
    )


# --------------------------------------------------------------------------------------------- helpers


def parse_version(text: str) -> tuple[int, int, int] | None:
    m = re.search(r"v?(\d+)\.(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


_UNIT = {"trainer": "slice", "sampler": "replica"}


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}{'' if n == 1 else 's'}"


def _fmt_version(v: tuple[int, int, int]) -> str:
    return "v{}.{}.{}".format(*v)


def _schema_has(schema: Obj, path: Sequence[str]) -> bool:
    node: Obj = schema
    for name in path:
        while node.get("type") == "array" and isinstance(node.get("items"), Mapping):
            node = node["items"]
        props = node.get("properties")
        if not isinstance(props, Mapping) or name not in props:
            return False
        node = props[name]
    return True


def _conditions(obj: Obj) -> dict[str, Obj]:
    return {str(c.get("type")): c for c in obj.get("status", {}).get("conditions", []) or []}


def _served_version(crd: Obj, version: str) -> Obj | None:
    for v in crd.get("spec", {}).get("versions", []) or []:
        if v.get("name") == version and v.get("served", False):
            return v  # type: ignore[no-any-return]
    return None


# ---------------------------------------------------------------------------------------------- JobSet


def check_jobset_crd(crds: Mapping[str, Obj]) -> list[Finding]:
    check = "jobset.crd"
    crd = crds.get(JOBSET_CRD)
    if crd is None:
        return [problem(check, f"the JobSet CRD {JOBSET_CRD} is not installed", JOBSET_INSTALL)]
    version = _served_version(crd, JOBSET_VERSION)
    if version is None:
        return [
            problem(
                check, f"the JobSet CRD does not serve {JOBSET_VERSION}", f"upgrade JobSet: {JOBSET_INSTALL}"
            )
        ]
    schema = version.get("schema", {}).get("openAPIV3Schema", {})
    missing = [".".join(p) for p in JOBSET_FIELDS if not _schema_has(schema, p)]
    if missing:
        return [
            problem(
                check,
                f"the JobSet CRD lacks {', '.join(missing)} (older than "
                f"{_fmt_version(MIN_JOBSET_VERSION)}?): the API server would drop what rljob renders there",
                f"upgrade JobSet to {TESTED_JOBSET_VERSION}: {JOBSET_INSTALL}",
            )
        ]
    return [ok(check, f"JobSet CRD {JOBSET_CRD} serves {JOBSET_VERSION} with every field rljob renders")]


def _jobset_image(dep: Obj) -> str | None:
    containers = dep.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []) or []
    for c in containers:
        image = str(c.get("image", ""))
        if re.search(r"(^|/)jobset(/[^/:@]*)?[:@]", image) or image.rsplit(":", 1)[0].endswith("/jobset"):
            return image
    return None


@dataclass(frozen=True)
class Probe:
    """Outcome of a server-side dry-run create of a minimal JobSet (it runs JobSet's webhooks)."""

    allowed: bool  # the request was admitted
    defaulted: bool  # the mutating webhook filled spec.network.enableDNSHostnames
    error: str = ""  # the API server's message when not admitted
    forbidden: bool = False  # the caller may not create JobSets: nothing learned


def probe_object(namespace: str) -> dict[str, Any]:
    """The JobSet the controller probe dry-runs: no network block, so the webhook's default shows."""
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": {"generateName": "rljob-doctor-probe-", "namespace": namespace},
        "spec": {
            "suspend": True,
            "replicatedJobs": [
                {
                    "name": "probe",
                    "template": {
                        "spec": {
                            "template": {
                                "spec": {
                                    "restartPolicy": "Never",
                                    "containers": [{"name": "probe", "image": "registry.k8s.io/pause:3.10"}],
                                }
                            }
                        }
                    },
                }
            ],
        },
    }


def probe_rljob(namespace: str) -> dict[str, Any]:
    """The RLJob doctor dry-runs when no manifest is given: the smallest complete one."""
    return {
        "apiVersion": f"{GROUP}/{RLJOB_VERSION}",
        "kind": "RLJob",
        "metadata": {"name": "rljob-doctor-probe", "namespace": namespace},
        "spec": {
            "model": {"name": "Qwen/Qwen3-4B"},
            "trainer": {"tpu": "v5p-8"},
            "sampler": {"tpu": "v5p-8"},
            "storage": {"root": "gs://rljob-doctor-probe"},
        },
    }


def _webhook_unreachable(error: str) -> bool:
    """The API server's message when it could not call a webhook (as opposed to the webhook denying)."""
    return "failed calling webhook" in error or "connection refused" in error


def probe_result(response: Obj) -> Probe:
    network = response.get("spec", {}).get("network") or {}
    return Probe(allowed=True, defaulted=network.get("enableDNSHostnames") is True)


def check_jobset_controller(deployments: Sequence[Obj], probe: Probe | None) -> list[Finding]:
    check = "jobset.controller"
    out: list[Finding] = []
    found = [(d, img) for d in deployments if (img := _jobset_image(d)) is not None]
    for dep, image in found:
        meta = dep.get("metadata", {})
        where = f"{meta.get('namespace')}/{meta.get('name')}"
        available = int(dep.get("status", {}).get("availableReplicas") or 0)
        version = parse_version(image.split("@", 1)[0].rsplit(":", 1)[-1]) if ":" in image else None
        if available < 1:
            out.append(
                problem(
                    check,
                    f"JobSet controller {where} ({image}) has no available replica",
                    f"kubectl -n {meta.get('namespace')} describe deployment {meta.get('name')}; "
                    f"kubectl -n {meta.get('namespace')} logs deployment/{meta.get('name')}",
                )
            )
        elif version is None:
            out.append(warning(check, f"JobSet controller {where} runs {image}: version unknown (no tag)"))
        elif version < MIN_JOBSET_VERSION:
            out.append(
                problem(
                    check,
                    f"JobSet controller {where} is {_fmt_version(version)}; rljob needs "
                    f">= {_fmt_version(MIN_JOBSET_VERSION)}",
                    f"upgrade JobSet to {TESTED_JOBSET_VERSION}: {JOBSET_INSTALL}",
                )
            )
        else:
            note = (
                ""
                if _fmt_version(version) == TESTED_JOBSET_VERSION
                else f" (tested: {TESTED_JOBSET_VERSION})"
            )
            out.append(ok(check, f"JobSet controller {where} {_fmt_version(version)} is available{note}"))
    if probe is not None and not probe.forbidden:
        if not probe.allowed and _webhook_unreachable(probe.error):
            out.append(
                problem(
                    "jobset.webhook",
                    f"JobSet's webhook is unreachable, a dry-run JobSet was refused: {probe.error}",
                    "the JobSet controller (it serves the webhook) is down or its certificate is wrong: "
                    "check the controller's pods and logs, or reinstall: " + JOBSET_INSTALL,
                )
            )
        elif not probe.allowed:
            out.append(
                problem(
                    "jobset.webhook",
                    f"JobSet's webhook refused a minimal dry-run JobSet: {probe.error}",
                    "kubectl get mutatingwebhookconfigurations,validatingwebhookconfigurations | grep jobset "
                    "(both must exist), or reinstall: " + JOBSET_INSTALL,
                )
            )
        elif not probe.defaulted:
            out.append(
                problem(
                    "jobset.webhook",
                    "JobSet's mutating webhook did not default a dry-run JobSet: the webhook "
                    "configuration is missing, so JobSets would run without the controller's defaults",
                    f"reinstall JobSet: {JOBSET_INSTALL}",
                )
            )
        else:
            out.append(
                ok("jobset.webhook", "JobSet's webhook answered a dry-run JobSet (controller serving)")
            )
    if not found and not (probe is not None and probe.allowed and probe.defaulted):
        out.append(
            problem(check, "no JobSet controller found (no Deployment runs a JobSet image)", JOBSET_INSTALL)
        )
    elif not found:
        out.append(
            warning(check, "JobSet's webhook answers but no Deployment runs a JobSet image: version unknown")
        )
    return out


# ------------------------------------------------------------------------------------------ node pools


@dataclass
class Pool:
    """A TPU node pool as its nodes show it."""

    name: str
    accelerator: str
    topology: str
    nodes: int = 0
    ready: int = 0
    tpu_per_node: int | None = None  # smallest allocatable google.com/tpu over its nodes
    placement_policy: str = ""  # label cloud.google.com/placement-policy-name (multi-host tpu7x)


def tpu_pools(nodes: Sequence[Obj]) -> dict[str, Pool]:
    pools: dict[str, Pool] = {}
    for node in nodes:
        meta = node.get("metadata", {})
        labels = meta.get("labels", {}) or {}
        accelerator = labels.get(ACCELERATOR_LABEL)
        if not accelerator:
            continue
        name = labels.get(NODEPOOL_LABEL) or f"node/{meta.get('name')}"
        pool = pools.setdefault(
            name,
            Pool(
                name,
                accelerator,
                labels.get(TOPOLOGY_LABEL, ""),
                placement_policy=labels.get(PLACEMENT_POLICY_LABEL, ""),
            ),
        )
        pool.nodes += 1
        if _conditions(node).get("Ready", {}).get("status") == "True":
            pool.ready += 1
        tpu = (node.get("status", {}).get("allocatable", {}) or {}).get(TPU_RESOURCE)
        count = int(tpu) if tpu is not None and str(tpu).isdigit() else 0
        pool.tpu_per_node = count if pool.tpu_per_node is None else min(pool.tpu_per_node, count)
    return pools


def create_pool_command(plan: TpuPlan, name: str) -> str:
    """The gcloud commands that create one node pool for one slice of this shape (docs/gke.md)."""
    base = (
        f"gcloud container node-pools create {name} --cluster=$CLUSTER --location=$LOCATION "
        f"--node-locations=$ZONE --machine-type={plan.machine_type} --num-nodes={plan.hosts}"
    )
    if plan.placement_policy:
        policy = plan.placement_policy
        return (
            f"gcloud compute resource-policies create workload-policy {policy} --type=HIGH_THROUGHPUT "
            f"--accelerator-topology={plan.topology} --region=$REGION && {base} --placement-policy={policy}"
        )
    if plan.hosts > 1:
        return f"{base} --tpu-topology={plan.topology} --placement-type=COMPACT"
    # A single-host pool names no topology: its machine type is the whole slice (xpk passes
    # --tpu-topology for multi-host pools only).
    return base


def check_node_pools(nodes: Sequence[Obj], needs: Needs | None) -> list[Finding]:
    pools = tpu_pools(nodes)
    out: list[Finding] = []
    if needs is None:
        if not pools:
            return [warning("nodepools", "no TPU nodes (no node has the label " + ACCELERATOR_LABEL + ")")]
        listing = ", ".join(
            f"{p.name} ({p.accelerator} {p.topology}, {p.nodes} nodes)" for p in pools.values()
        )
        return [ok("nodepools", f"{len(pools)} TPU node pools: {listing}")]
    # Roles with the same slice shape compete for the same pools: add them up per shape.
    shapes: dict[tuple[str, str], list[RoleNeed]] = {}
    for need in needs.roles:
        shapes.setdefault((need.tpu.accelerator, need.tpu.topology), []).append(need)
    for (accelerator, topology), roles in shapes.items():
        plan = roles[0].tpu
        check = "nodepools." + "+".join(r.role for r in roles)
        wanted = sum(r.slices for r in roles)
        who = " and ".join(f"{r.role} ({_count(r.slices, _UNIT[r.role])})" for r in roles)
        shape = f"{accelerator} {topology} ({plan.type_name}, {_count(plan.hosts, 'node')} each)"
        # A multi-host tpu7x slice's pods also select the pool's workload policy (recipes/placement.py).
        same = [
            p
            for p in pools.values()
            if p.accelerator == accelerator
            and p.topology == topology
            and (not plan.placement_policy or p.placement_policy == plan.placement_policy)
        ]
        full = [p for p in same if p.nodes >= plan.hosts]
        short = [p for p in same if p.nodes < plan.hosts]
        if len(full) < wanted:
            missing = wanted - len(full)
            detail = f"; found {len(full)}" + (f": {', '.join(p.name for p in full)}" if full else "")
            if short:
                detail += "; too small: " + ", ".join(
                    f"{p.name} has {p.nodes}/{plan.hosts} nodes" for p in short
                )
            out.append(
                problem(
                    check,
                    f"{who} need {wanted} node pool{'s' if wanted > 1 else ''} of {shape}{detail} "
                    "(exclusive placement: one pool per slice; a pool that scales from zero shows no nodes)",
                    f"create {missing} more, e.g. "
                    + create_pool_command(
                        plan, f"{plan.type_name}-{needs.name}-{len(full)}"[:40].rstrip("-")
                    ),
                )
            )
            continue
        used = full[:wanted]
        out.append(
            ok(
                check,
                f"{who} need {wanted} pool{'s' if wanted > 1 else ''} of {shape}: "
                + ", ".join(p.name for p in used),
            )
        )
        for p in used:
            if p.ready < p.nodes:
                out.append(
                    warning(
                        check,
                        f"pool {p.name}: {p.ready}/{p.nodes} nodes Ready",
                        f"kubectl get nodes -l {NODEPOOL_LABEL}={p.name}",
                    )
                )
            if (p.tpu_per_node or 0) < plan.chips_per_host:
                out.append(
                    problem(
                        check,
                        f"pool {p.name}: nodes offer {p.tpu_per_node or 0} {TPU_RESOURCE}, a pod needs "
                        f"{plan.chips_per_host} (TPU device plugin not ready?)",
                        f"kubectl describe nodes -l {NODEPOOL_LABEL}={p.name}",
                    )
                )
    return out


# ----------------------------------------------------------------------------------------------- Kueue


def check_queue(
    crds: Mapping[str, Obj], local_queues: Sequence[Obj] | None, needs: Needs | None
) -> list[Finding]:
    if needs is None or not needs.queue_name:
        return []
    check = "kueue.localqueue"
    q, ns = needs.queue_name, needs.namespace
    create = (
        f"kubectl apply -f - <<EOF\napiVersion: {KUEUE_GROUP}/v1beta2\nkind: LocalQueue\n"
        f"metadata: {{name: {q}, namespace: {ns}}}\nspec: {{clusterQueue: CLUSTER_QUEUE}}\nEOF"
    )
    if LOCALQUEUE_CRD not in crds:
        return [
            problem(
                check,
                f"spec.queueName is {q!r} but Kueue is not installed (no CRD {LOCALQUEUE_CRD})",
                "install Kueue: kubectl apply --server-side -f https://github.com/kubernetes-sigs/kueue/"
                f"releases/download/{TESTED_KUEUE_VERSION}/manifests.yaml, then create a ClusterQueue and "
                "the LocalQueue (docs/gke.md), or drop spec.queueName",
            )
        ]
    if local_queues is None:
        return [warning(check, f"cannot list LocalQueues in {ns} (forbidden)")]
    match = [lq for lq in local_queues if lq.get("metadata", {}).get("name") == q]
    if not match:
        return [problem(check, f"spec.queueName: no LocalQueue {q!r} in namespace {ns}", create)]
    active = _conditions(match[0]).get("Active")
    if active is not None and active.get("status") != "True":
        reason = f"{active.get('reason', '')}: {active.get('message', '')}".strip(": ")
        cq = match[0].get("spec", {}).get("clusterQueue", "?")
        return [
            problem(
                check,
                f"LocalQueue {ns}/{q} is not active ({reason})",
                f"kubectl get clusterqueue {cq} -o yaml  # the ClusterQueue must exist and be active",
            )
        ]
    return [ok(check, f"LocalQueue {ns}/{q} exists" + (" and is active" if active is not None else ""))]


# -------------------------------------------------------------------------------------------- operator


def _webhook_covers(hook: Obj, group: str = GROUP, plural: str = PLURAL) -> bool:
    for rule in hook.get("rules", []) or []:
        groups = rule.get("apiGroups", []) or []
        resources = rule.get("resources", []) or []
        if (group in groups or "*" in groups) and (plural in resources or "*" in resources):
            return True
    return False


def check_jobset_webhook_configs(mutating: Sequence[Obj] | None, validating: Sequence[Obj]) -> list[Finding]:
    """JobSet ships a mutating (defaults) and a validating webhook configuration; both must be there.
    `mutating` None: not readable, nothing said."""
    if mutating is None:
        return []
    out = []
    for kind, configs in (("mutating", mutating), ("validating", validating)):
        if not any(
            _webhook_covers(h, JOBSET_GROUP, "jobsets") for c in configs for h in c.get("webhooks") or []
        ):
            out.append(
                problem(
                    "jobset.webhook",
                    f"no {kind} webhook configuration covers jobsets: JobSets would run without the "
                    f"controller's {'defaults' if kind == 'mutating' else 'validation'}",
                    f"reinstall JobSet: {JOBSET_INSTALL}",
                )
            )
    return out


def check_operator(
    crds: Mapping[str, Obj],
    deployments: Sequence[Obj],
    webhooks: Sequence[Obj],
    access: Mapping[Permission, bool | None],
    can_create_rljobs: bool | None,
    operator_namespace: str,
    operator_sa: str,
    namespace: str,
    admission: Probe | None = None,
    for_manifest: bool = False,
) -> list[Finding]:
    """`admission` is a server-side dry-run create of an RLJob (the manifest, or doctor's own probe):
    it passes through the operator's webhook, so it shows whether the operator answers wherever it runs."""
    out: list[Finding] = []
    unreachable = admission is not None and not admission.allowed and _webhook_unreachable(admission.error)
    answered = admission is not None and not admission.forbidden and (admission.allowed or not unreachable)
    install = f"helm install rljob charts/rljob --namespace {operator_namespace} --create-namespace"
    if RLJOB_CRD not in crds:
        out.append(problem("operator.crd", f"the RLJob CRD {RLJOB_CRD} is not installed", install))
    else:
        out.append(ok("operator.crd", f"RLJob CRD {RLJOB_CRD} installed"))

    ours = [
        d
        for d in deployments
        if d.get("metadata", {}).get("namespace") == operator_namespace
        and d.get("spec", {}).get("template", {}).get("spec", {}).get("serviceAccountName") == operator_sa
    ]
    if not ours and answered:
        out.append(
            warning(
                "operator.deployment",
                f"no Deployment in {operator_namespace} runs as ServiceAccount {operator_sa}, but the "
                "operator's webhook answers: the operator runs outside the cluster?",
            )
        )
    elif not ours:
        out.append(
            problem(
                "operator.deployment",
                f"no Deployment in {operator_namespace} runs as ServiceAccount {operator_sa}",
                install + "  (or pass --operator-namespace / --operator-service-account)",
            )
        )
    for dep in ours:
        name = dep["metadata"].get("name")
        if int(dep.get("status", {}).get("availableReplicas") or 0) < 1:
            out.append(
                problem(
                    "operator.deployment",
                    f"operator Deployment {operator_namespace}/{name} has no available replica",
                    f"kubectl -n {operator_namespace} logs deployment/{name}",
                )
            )
        else:
            out.append(
                ok("operator.deployment", f"operator Deployment {operator_namespace}/{name} is available")
            )

    denied = [str(p) for p, allowed in access.items() if allowed is False]
    unknown = [str(p) for p, allowed in access.items() if allowed is None]
    subject = f"system:serviceaccount:{operator_namespace}:{operator_sa}"
    if denied:
        out.append(
            problem(
                "operator.rbac",
                f"{subject} may not: {', '.join(denied)} (namespace {namespace})",
                f"reinstall the chart's RBAC: helm upgrade rljob charts/rljob -n {operator_namespace}",
            )
        )
    if unknown:
        out.append(
            warning(
                "operator.rbac",
                f"could not check {len(unknown)} permissions of {subject} (you may not create "
                "subjectaccessreviews.authorization.k8s.io)",
            )
        )
    if access and not denied and not unknown:
        out.append(ok("operator.rbac", f"{subject} has all {len(access)} permissions the operator uses"))

    hooks = [
        (cfg.get("metadata", {}).get("name"), hook)
        for cfg in webhooks
        for hook in cfg.get("webhooks", []) or []
        if _webhook_covers(hook)
    ]
    if not hooks:
        out.append(
            problem(
                "operator.webhook",
                "no validating webhook covers rljobs: bad manifests would be accepted and fail later",
                install,
            )
        )
    for cfg_name, hook in hooks:
        client = hook.get("clientConfig", {}) or {}
        if client.get("service") and not client.get("caBundle"):
            out.append(
                problem(
                    "operator.webhook",
                    f"webhook {cfg_name}/{hook.get('name')} has no caBundle: the API server cannot call it",
                    f"helm upgrade rljob charts/rljob -n {operator_namespace}",
                )
            )
        else:
            target = client.get("service") or {"url": client.get("url")}
            where = (
                f"service {target.get('namespace')}/{target.get('name')}"
                if "name" in target
                else f"url {target.get('url')}"
            )
            out.append(
                ok("operator.webhook", f"webhook {cfg_name}/{hook.get('name')} covers rljobs ({where})")
            )

    what = "this manifest" if for_manifest else "doctor's probe RLJob"
    if admission is not None and not admission.forbidden and hooks:
        if unreachable:
            out.append(
                problem(
                    "operator.admission",
                    f"a dry-run of {what} could not reach the operator's webhook: {admission.error}",
                    f"the operator is down or unreachable: kubectl -n {operator_namespace} get pods; "
                    f"kubectl -n {operator_namespace} logs deployment/<operator>",
                )
            )
        elif not admission.allowed:
            out.append(problem("operator.admission", f"the operator refuses {what}: {admission.error}"))
        else:
            out.append(ok("operator.admission", f"the operator's webhook admitted a dry-run of {what}"))

    if can_create_rljobs is False:
        out.append(
            problem(
                "user.rbac",
                f"you may not create rljobs in namespace {namespace}",
                f"ask an admin for a RoleBinding granting create on {PLURAL}.{GROUP} in {namespace}",
            )
        )
    elif can_create_rljobs:
        out.append(ok("user.rbac", f"you may create rljobs in namespace {namespace}"))
    return out


# --------------------------------------------------------------------------------------- cluster state


@dataclass
class ClusterState:
    """Everything the checks read, as the API server returned it (JSON dicts)."""

    server: str = ""
    crds: dict[str, Obj] = field(default_factory=dict)
    deployments: list[Obj] = field(default_factory=list)
    nodes: list[Obj] = field(default_factory=list)
    local_queues: list[Obj] | None = None
    webhooks: list[Obj] = field(default_factory=list)
    access: dict[Permission, bool | None] = field(default_factory=dict)
    can_create_rljobs: bool | None = None
    jobset_probe: Probe | None = None
    rljob_probe: Probe | None = None
    mutating_webhooks: list[Obj] | None = None
    unreadable: list[str] = field(default_factory=list)  # cluster-wide lists the caller may not read
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    operator_sa: str = DEFAULT_OPERATOR_SERVICE_ACCOUNT
    references: dict[tuple[str, str], Obj | bool | None] = field(default_factory=dict)


def run_checks(state: ClusterState, needs: Needs | None) -> list[Finding]:
    namespace = needs.namespace if needs else "default"
    if state.unreadable:
        # Without these lists every check would report things missing that are only hidden.
        mine = check_operator({}, [], [], {}, state.can_create_rljobs, "", "", namespace)
        return [
            problem(
                "access",
                f"you may not list {', '.join(state.unreadable)}: doctor cannot check this cluster",
                "run doctor as a cluster admin, or bind a ClusterRole with get/list on "
                "customresourcedefinitions, deployments, nodes and validatingwebhookconfigurations",
            ),
            *[f for f in mine if f.check == "user.rbac"],
        ]
    return (
        check_jobset_crd(state.crds)
        + check_jobset_controller(state.deployments, state.jobset_probe)
        + (
            check_jobset_webhook_configs(state.mutating_webhooks, state.webhooks)
            if JOBSET_CRD in state.crds
            else []
        )
        + check_node_pools(state.nodes, needs)
        + check_queue(state.crds, state.local_queues, needs)
        + check_operator(
            state.crds,
            state.deployments,
            state.webhooks,
            state.access,
            state.can_create_rljobs,
            state.operator_namespace,
            state.operator_sa,
            namespace,
            state.rljob_probe,
            needs is not None and needs.manifest is not None,
        )
        + (check_references(needs.references, state.references, namespace) if needs else [])
    )


class ClusterError(Exception):
    """The cluster could not be read at all (no kubeconfig, API server unreachable)."""


class _Forbidden(Exception):
    pass


def _api_message(exc: Any) -> str:
    """The `message` of a Kubernetes Status in an ApiException's body, else the exception's text."""
    message = exc.body if isinstance(exc.body, str | bytes) else str(exc)
    with contextlib.suppress(ValueError, AttributeError):
        message = json.loads(message).get("message", message)
    return str(message.decode() if isinstance(message, bytes) else message)


def find_operator(
    service_accounts: Sequence[Obj], namespace: str | None, name: str | None
) -> tuple[str, str]:
    """The operator's namespace and ServiceAccount: the flags where given, else the one ServiceAccount
    the chart labelled (OPERATOR_LABEL), else the chart's defaults for `helm install rljob`."""
    found = [
        (sa["metadata"]["namespace"], sa["metadata"]["name"])
        for sa in service_accounts
        if (namespace is None or sa["metadata"]["namespace"] == namespace)
        and (name is None or sa["metadata"]["name"] == name)
    ]
    if len(found) == 1:
        return found[0]
    return namespace or DEFAULT_OPERATOR_NAMESPACE, name or DEFAULT_OPERATOR_SERVICE_ACCOUNT


def gather(
    needs: Needs | None,
    kubeconfig: str | None = None,
    context: str | None = None,
    operator_namespace: str | None = None,
    operator_sa: str | None = None,
) -> ClusterState:
    """Read what the checks need with the kubernetes client (imported here, lazily)."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException

    try:
        if kubeconfig is None and context is None:
            try:
                config.load_kube_config()  # type: ignore[no-untyped-call]
            except (ConfigException, FileNotFoundError, TypeError):
                config.load_incluster_config()  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
    except (ConfigException, FileNotFoundError, TypeError) as exc:
        raise ClusterError(f"no usable kubeconfig: {exc}") from None

    api = client.ApiClient()
    namespace = needs.namespace if needs else "default"

    def raw(call: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            resp = call(*args, _preload_content=False, _request_timeout=15, **kwargs)
        except ApiException as exc:
            if exc.status in (401, 403):
                raise _Forbidden(str(exc.reason)) from None
            if exc.status == 404:
                return None
            raise
        except Exception as exc:  # urllib3 connection errors and the like
            raise ClusterError(f"cannot reach the API server {api.configuration.host}: {exc}") from None
        return json.loads(resp.data)

    def items(call: Any, *args: Any, **kwargs: Any) -> list[Obj] | None:
        try:
            got = raw(call, *args, **kwargs)
        except _Forbidden:
            return None
        except ApiException as exc:
            raise ClusterError(f"{api.configuration.host}: {exc.status} {exc.reason}") from None
        return list(got.get("items", [])) if got else []

    state = ClusterState(server=str(api.configuration.host))
    ext = client.ApiextensionsV1Api(api)
    lists = {
        "customresourcedefinitions": items(ext.list_custom_resource_definition),
        "deployments": items(client.AppsV1Api(api).list_deployment_for_all_namespaces),
        "nodes": items(client.CoreV1Api(api).list_node),
        "validatingwebhookconfigurations": items(
            client.AdmissionregistrationV1Api(api).list_validating_webhook_configuration
        ),
    }
    state.unreadable = sorted(k for k, v in lists.items() if v is None)
    state.crds = {c["metadata"]["name"]: c for c in lists["customresourcedefinitions"] or []}
    state.deployments = lists["deployments"] or []
    state.nodes = lists["nodes"] or []
    state.webhooks = lists["validatingwebhookconfigurations"] or []
    state.mutating_webhooks = items(
        client.AdmissionregistrationV1Api(api).list_mutating_webhook_configuration
    )
    custom = client.CustomObjectsApi(api)
    lq_crd = state.crds.get(LOCALQUEUE_CRD)
    if lq_crd is not None and needs is not None and needs.queue_name:
        served = [v["name"] for v in lq_crd["spec"]["versions"] if v.get("served")]
        storage = [v["name"] for v in lq_crd["spec"]["versions"] if v.get("storage")] or served
        state.local_queues = items(
            custom.list_namespaced_custom_object, KUEUE_GROUP, storage[0], namespace, "localqueues"
        )

    if JOBSET_CRD in state.crds:
        try:
            got = raw(
                custom.create_namespaced_custom_object,
                JOBSET_GROUP,
                JOBSET_VERSION,
                namespace,
                "jobsets",
                probe_object(namespace),
                dry_run="All",
            )
            state.jobset_probe = probe_result(got or {})
        except _Forbidden:
            state.jobset_probe = Probe(False, False, forbidden=True)
        except ApiException as exc:
            state.jobset_probe = Probe(False, False, error=_api_message(exc))

    if RLJOB_CRD in state.crds:
        rljob = (
            dict(needs.manifest)
            if needs is not None and needs.manifest is not None
            else probe_rljob(namespace)
        )
        try:
            raw(
                custom.create_namespaced_custom_object,
                GROUP,
                RLJOB_VERSION,
                namespace,
                PLURAL,
                rljob,
                dry_run="All",
            )
            state.rljob_probe = Probe(True, False)
        except _Forbidden:
            state.rljob_probe = Probe(False, False, forbidden=True)
        except ApiException as exc:
            state.rljob_probe = Probe(False, False, error=_api_message(exc))

    core = client.CoreV1Api(api)
    readers = {
        "Secret": lambda name: raw(core.read_namespaced_secret, name, namespace),
        "ConfigMap": lambda name: raw(core.read_namespaced_config_map, name, namespace),
        "ServiceAccount": lambda name: raw(core.read_namespaced_service_account, name, namespace),
        "PersistentVolumeClaim": lambda name: raw(
            core.read_namespaced_persistent_volume_claim, name, namespace
        ),
        "CSIDriver": lambda name: raw(client.StorageV1Api(api).read_csi_driver, name),
    }
    for ref in needs.references if needs else ():
        try:
            state.references[(ref.kind, ref.name)] = readers[ref.kind](ref.name)
        except (_Forbidden, ApiException):
            state.references[(ref.kind, ref.name)] = False

    labelled = items(
        client.CoreV1Api(api).list_service_account_for_all_namespaces, label_selector=OPERATOR_LABEL
    )
    operator_namespace, operator_sa = find_operator(labelled or [], operator_namespace, operator_sa)
    state.operator_namespace, state.operator_sa = operator_namespace, operator_sa
    authz = client.AuthorizationV1Api(api)
    user = f"system:serviceaccount:{operator_namespace}:{operator_sa}"
    for perm in OPERATOR_PERMISSIONS:
        attrs: dict[str, Any] = {"verb": perm.verb, "group": perm.group, "resource": perm.resource}
        if perm.subresource:
            attrs["subresource"] = perm.subresource
        if perm.namespaced:
            attrs["namespace"] = namespace
        body = client.V1SubjectAccessReview.from_dict(
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": user,
                    "groups": [
                        "system:serviceaccounts",
                        f"system:serviceaccounts:{operator_namespace}",
                        "system:authenticated",
                    ],
                    "resourceAttributes": attrs,
                },
            }
        )
        try:
            got = raw(authz.create_subject_access_review, body)
            state.access[perm] = bool((got or {}).get("status", {}).get("allowed"))
        except (_Forbidden, ApiException):
            state.access[perm] = None
    self_review = client.V1SelfSubjectAccessReview.from_dict(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {
                "resourceAttributes": {
                    "verb": "create",
                    "group": GROUP,
                    "resource": PLURAL,
                    "namespace": namespace,
                }
            },
        }
    )
    try:
        got = raw(authz.create_self_subject_access_review, self_review)
        state.can_create_rljobs = bool((got or {}).get("status", {}).get("allowed"))
    except (_Forbidden, ApiException):
        state.can_create_rljobs = None
    return state


# --------------------------------------------------------------------------------------------- output


_MARK = {Status.OK: "ok", Status.WARNING: "WARN", Status.PROBLEM: "PROBLEM"}


def render_text(findings: Sequence[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"{_MARK[f.status]:<8} {f.check:<20} {f.message}")
        for i, fix in enumerate(f.fix.splitlines()):
            lines.append(f"{'':<8} {'':<20} {'fix: ' if i == 0 else '     '}{fix}")
    problems = sum(f.status is Status.PROBLEM for f in findings)
    warnings = sum(f.status is Status.WARNING for f in findings)
    lines.append(
        f"{problems} problem{'s' if problems != 1 else ''}, {warnings} warning{'s' if warnings != 1 else ''}"
    )
    return "\n".join(lines)


def exit_code(findings: Sequence[Finding]) -> int:
    return EXIT_PROBLEMS if any(f.status is Status.PROBLEM for f in findings) else EXIT_OK
