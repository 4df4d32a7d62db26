"""`rljob submit | list | status | logs | delete` against the local cluster, with the operator running (the
chart's ServiceAccount; tests/fixtures/operator.py). Each test has its own namespace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.cluster import Cluster, wait_for
from fixtures.k8s import labels_of
from fixtures.operator import OperatorProcess, get_rljob, manifest, wait_rljob
from kubernetes.client.exceptions import ApiException
from rljob.recipes.api import Phase

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600, func_only=True)]
RLJOB = Path(sys.executable).parent / "rljob"
REPO = Path(__file__).resolve().parents[2]


def _rljob(
    c: Cluster, *args: str, stdin: str | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(RLJOB), *args, "--kubeconfig", str(c.kubeconfig)],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=timeout,
    )


def jobs_phases(samples: dict[str, float]) -> list[str]:
    prefix = 'rljob_operator_rljobs{phase="'
    return [k[len(prefix) : -2] for k in samples if k.startswith(prefix)]


def _gone(c: Cluster, ns: str, name: str) -> bool:
    try:
        get_rljob(c, ns, name)
    except ApiException as e:
        gone: bool = e.status == 404
        return gone
    return False


def test_submit_list_status_logs_delete(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    body: dict[str, Any] = manifest("cmds", namespace)
    del body["metadata"]["namespace"]  # from -n
    proc = _rljob(
        cluster,
        "submit",
        "-f",
        "-",
        "-n",
        namespace,
        "--wait",
        "--timeout",
        "150",
        stdin=yaml.safe_dump(body),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"rljob.rljob.dev/cmds created in {namespace}"
    progress = proc.stderr.strip().splitlines()
    assert progress and progress[-1].split("] ", 1)[1].startswith(
        "cmds: Running, pods trainer 1/1 sampler 1/1"
    ), progress
    # Submitting it again is refused by the API server, one line.
    again = _rljob(cluster, "submit", "-f", "-", "-n", namespace, stdin=yaml.safe_dump(body))
    assert again.returncode == 1 and "already exists" in again.stderr and len(again.stderr.splitlines()) == 1

    # The operator's gauge of RLJobs per phase counts it (the session's operator may watch others too).
    running = 'rljob_operator_rljobs{phase="Running"}'
    wait_for(lambda: rljob_operator.metrics().get(running, 0) >= 1, 30, "the Running gauge")
    assert set(jobs_phases(rljob_operator.metrics())) == {p.value for p in Phase}

    # The trainer's progress report reaches status, list and status.
    report = '{"step": 7, "rewardMean": 0.625}'
    cluster.core.patch_namespaced_config_map("cmds-progress", namespace, {"data": {"progress.json": report}})
    wait_rljob(cluster, namespace, "cmds", 60, "step 7", lambda s: (s.get("progress") or {}).get("step") == 7)

    listed = _rljob(cluster, "list", "-n", namespace)
    assert listed.returncode == 0, listed.stderr
    head, row = listed.stdout.splitlines()
    assert head.split() == ["NAME", "PHASE", "STEP", "REWARD", "RESTARTS", "AGE"]
    assert row.split()[:5] == ["cmds", "Running", "7", "0.625", "0"]
    wide = _rljob(cluster, "list", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-3:] == ["JOBSET", "LAST-FAILURE", "URL"] and "cmds" in wide[1].split()[6:]
    items = json.loads(_rljob(cluster, "list", "-n", namespace, "-o", "json").stdout)["items"]
    assert [i["metadata"]["name"] for i in items] == ["cmds"]
    every = _rljob(cluster, "list", "-A").stdout
    assert any(line.split()[:2] == [namespace, "cmds"] for line in every.splitlines())

    status = _rljob(cluster, "status", "cmds", "-n", namespace)
    assert status.returncode == 0, status.stderr
    assert "Phase:       Running" in status.stdout and "Step:        7 of 50" in status.stdout
    assert (
        "Reward:      0.625" in status.stdout
        and "Pods:        trainer 1/1 ready, sampler 1/1 ready" in status.stdout
    )
    assert "Conditions:" in status.stdout
    as_yaml = yaml.safe_load(_rljob(cluster, "status", "cmds", "-n", namespace, "-o", "yaml").stdout)
    assert as_yaml["status"]["progress"]["step"] == 7

    # Logs: the role's pods are the ones read (kwok runs no containers, so its kubelet may have none to
    # give; either way the answer names the sampler's pod, never the trainer's, and is no traceback).
    logs = _rljob(cluster, "logs", "cmds", "-n", namespace, "--role", "sampler", "--tail", "5", timeout=60)
    assert "Traceback" not in logs.stderr
    if logs.returncode:
        assert "cmds-sampler-0-0" in logs.stderr and "trainer" not in logs.stderr, logs.stderr

    # A name that does not exist: one line, exit 1, for every verb.
    for verb in (["status", "nope"], ["logs", "nope"], ["delete", "nope"]):
        missing = _rljob(cluster, *verb, "-n", namespace)
        assert missing.returncode == 1 and "not found" in missing.stderr, (verb, missing.stderr)

    deleted = _rljob(cluster, "delete", "cmds", "-n", namespace, "--wait")
    assert deleted.returncode == 0, deleted.stderr
    assert _gone(cluster, namespace, "cmds")
    wait_for(lambda: not cluster.jobset_pods(namespace, "cmds"), 120, "the JobSet's pods gone")
    assert "No rljobs found" in _rljob(cluster, "list", "-n", namespace).stderr


def test_the_gke_example_is_admitted_and_its_pods_carry_the_overrides(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    """examples/qwen3-8b-v5p-spot-gcsfuse.yaml through the real API server, JobSet's webhooks and the Job
    controller: the pods are created (the API server's pod validation accepts the merged spec) with the
    overrides; they stay Pending, as the local pools are not Spot."""
    body = yaml.safe_load((REPO / "examples" / "qwen3-8b-v5p-spot-gcsfuse.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    proc = _rljob(cluster, "submit", "-f", "-", stdin=yaml.safe_dump(body))
    assert proc.returncode == 0, proc.stderr
    name = body["metadata"]["name"]

    def pods() -> dict[str, Any] | None:
        got = {labels_of(p)["rljob.dev/role"]: p for p in cluster.jobset_pods(namespace, name)}
        return got if set(got) == {"trainer", "sampler"} else None

    by_role = wait_for(pods, 120, "the trainer and sampler pods")
    trainer, sampler = by_role["trainer"], by_role["sampler"]
    assert trainer.metadata.annotations["gke-gcsfuse/volumes"] == "true"
    assert trainer.metadata.labels["team"] == "post-training"
    assert trainer.spec.node_selector["cloud.google.com/gke-spot"] == "true"
    assert trainer.spec.node_selector["cloud.google.com/gke-tpu-topology"] == "2x2x1"
    assert any(v.csi and v.csi.driver == "gcsfuse.csi.storage.gke.io" for v in trainer.spec.volumes)
    (c,) = trainer.spec.containers
    hf = next(e for e in c.env if e.name == "HF_TOKEN")
    assert (hf.value_from.secret_key_ref.name, hf.value_from.secret_key_ref.key) == ("hf-token", "token")
    assert any(m.mount_path == "/data" and m.read_only for m in c.volume_mounts)
    assert sampler.spec.containers[0].resources.requests["memory"] == "64Gi"
    assert sampler.status.phase == "Pending"  # no Spot nodes here
    status = _rljob(cluster, "status", name, "-n", namespace)
    assert status.returncode == 0 and "Phase:       Pending" in status.stdout, status.stdout
