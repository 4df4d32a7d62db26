"""`make demo`'s training part (hack/demo.py `train`) on the local cluster: the tiny CPU RLJob applied,
the operator rendering its JobSet, the pods' trainer and sampler run here as local processes
(tests/fixtures/standin.py) with the pods' environment and ServiceAccount, progress through the progress
ConfigMap, until the RLJob is Succeeded."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from fixtures.cluster import Cluster
from fixtures.k8s import pod_status
from fixtures.operator import OperatorProcess, pods_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600, func_only=True)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def _demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rljob_hack_demo", REPO / "hack" / "demo.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_demo_trains_to_succeeded(
    cluster: Cluster, rljob_operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    demo = _demo()
    obj = demo.train(cluster, namespace, "demo-train", steps=STEPS, timeout=420, workdir=tmp_path)
    status = obj.get("status") or {}
    assert status.get("phase") == "Succeeded", (status, rljob_operator.log_tail())
    progress = status["progress"]
    assert progress["step"] == STEPS
    assert isinstance(progress["rewardMean"], float)
    assert 0.0 <= progress["rewardMean"] <= 1.0
    # The trainer's pod ended as its local process did (exit 0), and both roles ran here.
    commands = sorted(p.parent.name for p in tmp_path.glob("*/command.json"))
    assert len(commands) == 2, commands
    phases = [pod_status(p).phase for p in pods_of(cluster, namespace, "demo-train", "trainer")]
    assert phases == ["Succeeded"], phases
