"""TPU node pools: one pool per slice of each role's shape (JobSet's exclusive placement)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rljob.cli.doctor.common import _UNIT, Obj, _conditions, _count
from rljob.cli.doctor.findings import Finding, ok, problem, warning
from rljob.cli.doctor.needs import Needs, RoleNeed
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
