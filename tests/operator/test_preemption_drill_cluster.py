"""Preemption drills on the local cluster with the demo's stand-ins really training (hack/demo.py `train`,
tests/fixtures/standin.py: the pods' trainer and sampler run here as local processes on the tiny CPU
recipe): a run that is training loses its trainer's node and resumes from its last checkpoint step, not
counted; a run whose sampler crashes restarts only the sampler Job while the trainer pod runs on; both
end Succeeded."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from fixtures.cluster import Cluster, deleted_node
from fixtures.k8s import labels_of, meta, name_of, pod_spec
from fixtures.operator import OperatorProcess, running_pods
from fixtures.standin import PodRunner

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900, func_only=True)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
ROLE_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"


def _demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rljob_hack_demo_drill", REPO / "hack" / "demo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kill(runner: PodRunner, role: str) -> str:
    """SIGKILL the local process of the role's running pod, as a lost VM does; the runner neither
    restarts it nor hands its exit code to the pod (the caller decides how the pod ends)."""
    [pod] = [name for name, run in runner.running.items() if run.role == role]
    run = runner.running.pop(pod)
    run.popen.kill()
    run.popen.wait(timeout=30)
    runner.exits[pod] = -9
    return pod


def test_trainer_node_lost_mid_run_resumes_from_its_last_checkpoint(
    cluster: Cluster, rljob_operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    demo = _demo()
    name = "drill-node"
    seen: dict[str, Any] = {}
    rewards: list[float] = []

    def hook(obj: dict[str, Any], runner: PodRunner) -> None:
        progress = (obj.get("status") or {}).get("progress") or {}
        if isinstance(progress.get("rewardMean"), float) and progress.get("step") not in seen.get(
            "steps", ()
        ):
            seen.setdefault("steps", []).append(progress.get("step"))
            rewards.append(progress["rewardMean"])
        failure = (obj.get("status") or {}).get("lastFailure") or {}
        if "ctx" in seen and failure.get("class") == "preemption" and not seen.get("restored"):
            # The restart happened: the node comes back (as the pool's autoscaler or repair brings a VM),
            # so the new attempt's pods fit the pools again.
            seen["restored"] = True
            seen["ctx"].__exit__(None, None, None)
        if "node" in seen or (progress.get("lastCheckpointStep") or 0) < 2:
            return
        [trainer] = running_pods(cluster, namespace, name, "trainer")
        seen["node"], seen["pod_uid"] = pod_spec(trainer).node_name, meta(trainer).uid
        # The VM is gone: its process dies with it, then the node object goes (as GKE deletes it).
        _kill(runner, "trainer")
        time.sleep(3)  # the last report the trainer wrote reaches the status
        status = demo.as_dict(
            cluster.custom.get_namespaced_custom_object(
                demo.GROUP, demo.VERSION, namespace, demo.PLURAL, name
            )
        )["status"]
        seen["checkpoint"] = status["progress"]["lastCheckpointStep"]
        seen["ctx"] = deleted_node(cluster, seen["node"])
        seen["ctx"].__enter__()

    try:
        obj = demo.train(cluster, namespace, name, steps=STEPS, timeout=800, workdir=tmp_path, hook=hook)
    finally:
        if "ctx" in seen and not seen.get("restored"):
            seen["ctx"].__exit__(None, None, None)
    status = obj.get("status") or {}
    assert "node" in seen, ("the run ended before a checkpoint at step 2", status)
    assert status.get("phase") == "Succeeded", (status, rljob_operator.log_tail())
    # One restart of the run, not counted; the trainer resumed at the step it had checkpointed.
    assert status["restarts"]["used"] == 0 and status["restarts"]["sampler"]["used"] == 0, status["restarts"]
    assert status["lastFailure"]["class"] == "preemption" and status["lastFailure"]["role"] == "trainer"
    progress = status["progress"]
    # At least the checkpoint the status showed when the node went: the trainer may have saved a later one
    # whose report had not reached the status yet (a run under load resumed from 4 with 3 shown), and
    # resuming from the newest checkpoint on storage is what loses no work.
    assert seen["checkpoint"] <= progress["resumedFromStep"] < STEPS, (progress, seen)
    assert progress["step"] == STEPS
    # The reward curve continues after the restart: a reward for steps past the resume point.
    assert [s for s in seen["steps"] if s > progress["resumedFromStep"]], seen["steps"]
    assert all(0.0 <= r <= 1.0 for r in rewards), rewards
    js = cluster.get_jobset(namespace, name)
    assert js["status"]["restarts"] == 1 and js["status"].get("restartsCountTowardsMax", 0) == 0


def test_sampler_crash_mid_run_restarts_only_the_sampler(
    cluster: Cluster, rljob_operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    demo = _demo()
    name = "drill-sampler"
    seen: dict[str, Any] = {}

    def hook(obj: dict[str, Any], runner: PodRunner) -> None:
        progress = (obj.get("status") or {}).get("progress") or {}
        if "sampler" in seen or (progress.get("step") or 0) < 2:
            return
        [trainer] = running_pods(cluster, namespace, name, "trainer")
        seen["trainer_uid"] = meta(trainer).uid
        seen["step"] = progress["step"]
        # The sampler process crashes: its pod ends with exit code 1 (the runner's kubelet part).
        pod = _kill(runner, "sampler")
        runner._exit(pod, 1)
        seen["sampler"] = pod

    obj = demo.train(cluster, namespace, name, steps=STEPS, timeout=800, workdir=tmp_path, hook=hook)
    status = obj.get("status") or {}
    assert "sampler" in seen, ("the run ended before step 2", status)
    assert status.get("phase") == "Succeeded", (status, rljob_operator.log_tail())
    assert status["restarts"]["sampler"] == {"used": 1, "left": 9}, status["restarts"]
    assert status["restarts"]["used"] == 0
    assert status["lastFailure"]["role"] == "sampler" and status["lastFailure"]["class"] == "crash"
    assert status["progress"]["step"] == STEPS
    # The trainer was never restarted: one trainer pod, the one seen before the crash, no resume.
    trainers = [p for p in cluster.jobset_pods(namespace, name) if labels_of(p).get(ROLE_LABEL) == "trainer"]
    assert [meta(p).uid for p in trainers] == [seen["trainer_uid"]], [name_of(p) for p in trainers]
    assert status["progress"].get("resumedFromStep") in (None, 0), status["progress"]
    js = cluster.get_jobset(namespace, name)
    assert js["status"].get("restarts", 0) == 0
    [sampler] = [r for r in js["status"]["replicatedJobsStatus"] if r["name"] == "sampler"]
    assert sampler["jobRestarts"] == [1] and sampler["jobRestartsCountTowardsMax"] == [1]
