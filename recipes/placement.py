"""Where pods land: TPU node selectors, exclusive node pools, the TPU taint toleration.

- nodeSelector cloud.google.com/gke-tpu-accelerator and cloud.google.com/gke-tpu-topology pick a node
  pool of the right slice shape; a multi-host slice of a generation with workload policies (tpu7x) also
  selects its pool's workload policy
  (cloud.google.com/placement-policy-name, named as xpk names it);
- the JobSet annotation alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool on
  each replicatedJob's Job template gives every Job (one slice) a node pool of its own;
- GKE taints TPU nodes google.com/tpu=present:NoSchedule; TPU pods tolerate it.
"""

from __future__ import annotations

from typing import Any

from rljob.recipes.runconfig import TpuPlan
from rljob.recipes.tpu import ACCELERATOR_LABEL, PLACEMENT_POLICY_LABEL, TOPOLOGY_LABEL, TPU_RESOURCE

EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"


def node_selector(tpu: TpuPlan) -> dict[str, str]:
    sel = {ACCELERATOR_LABEL: tpu.accelerator, TOPOLOGY_LABEL: tpu.topology}
    if tpu.placement_policy:
        sel[PLACEMENT_POLICY_LABEL] = tpu.placement_policy
    return sel


def job_annotations() -> dict[str, str]:
    return {EXCLUSIVE_TOPOLOGY: NODEPOOL_LABEL}


def tolerations() -> list[dict[str, Any]]:
    return [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
