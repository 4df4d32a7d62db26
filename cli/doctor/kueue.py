"""Kueue: the LocalQueue named by spec.queueName exists and is active."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rljob.cli.doctor.common import Obj, _conditions
from rljob.cli.doctor.findings import Finding, ok, problem, warning
from rljob.cli.doctor.needs import Needs

KUEUE_GROUP = "kueue.x-k8s.io"


LOCALQUEUE_CRD = f"localqueues.{KUEUE_GROUP}"


TESTED_KUEUE_VERSION = "v0.19.2"


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
