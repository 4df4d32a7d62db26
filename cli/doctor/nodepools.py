"""TPU node pools: one pool per slice of each role's shape (JobSet's exclusive placement)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rljob.cli.doctor.common import _UNIT, Obj, _conditions, _count
from rljob.cli.doctor.findings import Finding, ok, problem, warning
from rljob.cli.doctor.needs import Needs, RoleNeed
from rljob.recipes import k8s_rules
from rljob.recipes.disk import DEFAULT_BOOT_DISK_GB, GIB
from rljob.recipes.placement import NODEPOOL_LABEL
from rljob.recipes.runconfig import TpuPlan
from rljob.recipes.tpu import ACCELERATOR_LABEL, PLACEMENT_POLICY_LABEL, TOPOLOGY_LABEL, TPU_RESOURCE


@dataclass
class Pool:
    """A TPU node pool as its nodes show it."""

    name: str
    accelerator: str
    topology: str
    nodes: int = 0
    ready: int = 0
    tpu_per_node: int | None = None  # smallest allocatable google.com/tpu over its nodes
    ephemeral_per_node: int | None = None  # smallest allocatable ephemeral-storage (bytes) over its nodes
    placement_policy: str = ""  # label cloud.google.com/placement-policy-name (multi-host tpu7x)


EPHEMERAL = "ephemeral-storage"


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
        eph = k8s_rules.quantity(
            str((node.get("status", {}).get("allocatable", {}) or {}).get(EPHEMERAL, ""))
        )
        if eph is not None:
            have = int(eph)
            pool.ephemeral_per_node = (
                have if pool.ephemeral_per_node is None else min(pool.ephemeral_per_node, have)
            )
    return pools


def create_pool_command(plan: TpuPlan, name: str, disk_gb: int | None = None) -> str:
    """The gcloud commands that create one node pool for one slice of this shape (docs/gke.md); with
    ``disk_gb`` above GKE's default, the boot disk the role's caches need (recipes/disk.py)."""
    base = (
        f"gcloud container node-pools create {name} --cluster=$CLUSTER --location=$LOCATION "
        f"--node-locations=$ZONE --machine-type={plan.machine_type} --num-nodes={plan.hosts}"
    )
    if disk_gb is not None and disk_gb > DEFAULT_BOOT_DISK_GB:
        base += f" --disk-size={disk_gb}"
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
        cache_bytes = max(r.cache_bytes for r in roles)
        disks = [r.disk_gb for r in roles if r.disk_gb is not None]
        disk_gb = max(disks) if disks else None
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
                        plan, f"{plan.type_name}-{needs.name}-{len(full)}"[:40].rstrip("-"), disk_gb
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
            if cache_bytes and p.ephemeral_per_node is not None and p.ephemeral_per_node < cache_bytes:
                out.append(
                    problem(
                        check,
                        f"pool {p.name}: nodes offer {p.ephemeral_per_node / GIB:.0f} GiB of ephemeral "
                        f"storage, a pod's caches ask {cache_bytes / GIB:.0f} GiB (the kubelet would not "
                        "schedule it, or evict it)",
                        f"recreate the pool with a larger boot disk: --disk-size={disk_gb} (docs/gke.md)",
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
