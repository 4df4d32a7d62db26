#!/usr/bin/env python3
"""Print (as a JSON v1 List) the kwok Nodes of the local cluster: simulated GKE TPU node pools.

One GKE node pool per TPU slice (so JobSet exclusive placement on cloud.google.com/gke-nodepool is
exercised), labelled, tainted and sized like GKE does it (facts: shared/reference/anchors.md §b):
  v5p-8   = 4 chips, topology 2x2x1, 1 host  (ct5p-hightpu-4t)
  v5p-16  = 8 chips, topology 2x2x2, 2 hosts
  tpu7x-8 = 4 chips, topology 2x2x1, 1 host  (tpu7x-standard-4t)
plus a CPU pool for the operator. Usage: nodes.py | kubectl apply -f -
Only the standard library: it runs before the project's virtualenv exists.
"""

from __future__ import annotations

import json
import sys
from typing import Any

ZONE = "us-east5-a"

# (pool name, accelerator label, topology, hosts, machine type, vCPU, memory)
TPU_POOLS = [
    ("v5p-8-a", "tpu-v5p-slice", "2x2x1", 1, "ct5p-hightpu-4t", "208", "448Gi"),
    ("v5p-8-b", "tpu-v5p-slice", "2x2x1", 1, "ct5p-hightpu-4t", "208", "448Gi"),
    ("v5p-16-a", "tpu-v5p-slice", "2x2x2", 2, "ct5p-hightpu-4t", "208", "448Gi"),
    ("v5p-16-b", "tpu-v5p-slice", "2x2x2", 2, "ct5p-hightpu-4t", "208", "448Gi"),
    ("tpu7x-8-a", "tpu7x", "2x2x1", 1, "tpu7x-standard-4t", "224", "960Gi"),
    ("tpu7x-8-b", "tpu7x", "2x2x1", 1, "tpu7x-standard-4t", "224", "960Gi"),
]
CPU_POOL = ("cpu-pool", 2, "e2-standard-8", "8", "32Gi")
CHIPS_PER_HOST = "4"


def node(
    name: str,
    pool: str,
    machine: str,
    cpu: str,
    memory: str,
    extra_labels: dict[str, str],
    extra_alloc: dict[str, str],
    taints: list[dict[str, str]],
) -> dict[str, Any]:
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": machine,
        "topology.kubernetes.io/zone": ZONE,
        "cloud.google.com/gke-nodepool": pool,
        "type": "kwok",
        # GKE's label on the nodes of a pool that runs the GKE metadata server (Workload Identity), where the
        # compile preflight goes by default (rljob.recipes.podpolicy.METADATA_SERVER_LABEL).
        "iam.gke.io/gke-metadata-server-enabled": "true",
        **extra_labels,
    }
    resources = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "100Gi", **extra_alloc}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": labels,
            # kwok manages only nodes carrying this annotation (kwokctl's default selector).
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": taints},
        "status": {"allocatable": resources, "capacity": resources},
    }


def nodes() -> list[dict[str, Any]]:
    out = []
    for pool, accel, topo, hosts, machine, cpu, mem in TPU_POOLS:
        for i in range(hosts):
            out.append(
                node(
                    f"gke-tpu-{pool}-{i}",
                    pool,
                    machine,
                    cpu,
                    mem,
                    {
                        "cloud.google.com/gke-tpu-accelerator": accel,
                        "cloud.google.com/gke-tpu-topology": topo,
                    },
                    {"google.com/tpu": CHIPS_PER_HOST},
                    [{"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}],
                )
            )
    pool, count, machine, cpu, mem = CPU_POOL
    for i in range(count):
        out.append(node(f"gke-{pool}-{i}", pool, machine, cpu, mem, {}, {}, []))
    return out


if __name__ == "__main__":
    json.dump({"apiVersion": "v1", "kind": "List", "items": nodes()}, sys.stdout, indent=1)
    sys.stdout.write("\n")
