"""The local cluster itself: node pools shaped like GKE TPU pools, RBAC enforced, helm usable."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from fixtures.cluster import HELM, Cluster
from fixtures.k8s import labels_of, spec_of, status_of
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster

ACCEL = "cloud.google.com/gke-tpu-accelerator"
TOPO = "cloud.google.com/gke-tpu-topology"
NODEPOOL = "cloud.google.com/gke-nodepool"


def test_node_pools_look_like_gke_tpu_pools(cluster: Cluster) -> None:
    pools: dict[str, list[client.V1Node]] = {}
    for node in cluster.core.list_node().items:
        pools.setdefault(labels_of(node)[NODEPOOL], []).append(node)
    shape = {
        pool: (labels_of(nodes[0]).get(ACCEL), labels_of(nodes[0]).get(TOPO), len(nodes))
        for pool, nodes in pools.items()
    }
    assert shape == {
        "v5p-8-a": ("tpu-v5p-slice", "2x2x1", 1),
        "v5p-8-b": ("tpu-v5p-slice", "2x2x1", 1),
        "v5p-16-a": ("tpu-v5p-slice", "2x2x2", 2),
        "v5p-16-b": ("tpu-v5p-slice", "2x2x2", 2),
        "tpu7x-8-a": ("tpu7x", "2x2x1", 1),
        "tpu7x-8-b": ("tpu7x", "2x2x1", 1),
        "cpu-pool": (None, None, 2),
    }
    for pool, nodes in pools.items():
        for node in nodes:
            taints = [(t.key, t.value, t.effect) for t in spec_of(node).taints or []]
            status = status_of(node)
            assert status.allocatable is not None and status.conditions is not None, status
            if pool == "cpu-pool":
                assert taints == []
                assert "google.com/tpu" not in status.allocatable
            else:
                assert taints == [("google.com/tpu", "present", "NoSchedule")]
                assert status.allocatable["google.com/tpu"] == "4"
            assert any(c.type == "Ready" and c.status == "True" for c in status.conditions)


def test_rbac_is_enforced(cluster: Cluster, namespace: str) -> None:
    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))  # type: ignore[no-untyped-call]
    api.set_default_header("Impersonate-User", f"system:serviceaccount:{namespace}:default")
    try:
        with pytest.raises(ApiException) as err:
            client.CoreV1Api(api).list_namespaced_pod(namespace)
        assert err.value.status == 403
    finally:
        api.close()


def test_helm_installs_a_chart(cluster: Cluster, namespace: str, tmp_path: Path) -> None:
    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  value: {{ .Values.value | quote }}\n"
    )
    (chart / "values.yaml").write_text("value: from-values\n")
    subprocess.run(
        [
            str(HELM),
            "install",
            "probe",
            str(chart),
            "--namespace",
            namespace,
            "--set",
            "value=from-cli",
            "--wait",
            "--timeout",
            "60s",
        ],
        env=cluster.env,
        check=True,
        capture_output=True,
        timeout=90,
    )
    cm = cluster.core.read_namespaced_config_map("probe-cm", namespace)
    assert cm.data == {"value": "from-cli"}
    subprocess.run(
        [str(HELM), "uninstall", "probe", "--namespace", namespace],
        env=cluster.env,
        check=True,
        capture_output=True,
        timeout=60,
    )
