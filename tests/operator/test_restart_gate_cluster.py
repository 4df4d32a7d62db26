"""An RLJob on JobSet's defaults: a cluster of its own whose JobSet controller runs with its feature gate
RestartJob off (hack/cluster.sh RLJOB_JOBSET_RESTART_JOB_GATE=off), the operator with the chart's default
jobset.restartJob: auto. Its start-up dry run finds the gate off, so it renders the fallback failure
policy (rljob.recipes.failure, RestartRun), which the controller admits; a sampler crash then restarts the
whole run from its last checkpoint, counted against spec.failurePolicy.maxRestarts. On the same cluster
(one cluster start for both): the series per RLJob of the operator's /metrics, scraped and parsed as
Prometheus does, gone once the RLJob is deleted."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from fixtures.cluster import Cluster, fail_pod, new_namespace, wait_for
from fixtures.operator import (
    GROUP,
    PLURAL,
    VERSION,
    OperatorProcess,
    create_rljob,
    manifest,
    running_pods,
    wait_phase,
    wait_rljob,
)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.cluster


@pytest.fixture
def namespace_gate_off(cluster_gate_off: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    yield from new_namespace(cluster_gate_off, request)


def _pod(c: Cluster, ns: str, name: str, role: str) -> Any:
    return wait_for(lambda: next(iter(running_pods(c, ns, name, role)), None), 90, f"a Running {role} pod")


def test_a_sampler_crash_restarts_the_run_when_jobsets_gate_is_off(
    cluster_gate_off: Cluster, namespace_gate_off: str, rljob_operator_gate_off: OperatorProcess
) -> None:
    c, ns = cluster_gate_off, namespace_gate_off
    assert "JobSet refuses the failure action RestartJob" in rljob_operator_gate_off.log_tail(400)
    create_rljob(c, manifest("gateoff", ns, failurePolicy={"maxRestarts": 2, "maxSamplerRestarts": 5}))
    status = wait_phase(c, ns, "gateoff", "Running", timeout=120)["status"]
    assert status["samplerFailure"] == "RestartRun"
    assert status["restarts"] == {"used": 0, "left": 2, "trainer": {"used": 0, "left": 2}}
    js = c.get_jobset(ns, "gateoff")
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 2
    assert [r["action"] for r in policy["rules"]] == ["RestartJobSetAndIgnoreMaxRestarts", "FailJobSet"]
    trainer_uid = _pod(c, ns, "gateoff", "trainer").metadata.uid

    fail_pod(c, ns, _pod(c, ns, "gateoff", "sampler").metadata.name, 1)
    status = wait_rljob(
        c,
        ns,
        "gateoff",
        180,
        "one counted restart of the run",
        lambda s: (s.get("restarts") or {}).get("used") == 1 and s.get("phase") == "Running",
    )["status"]
    assert status["restarts"] == {"used": 1, "left": 1, "trainer": {"used": 1, "left": 1}}
    assert status["lastFailure"]["class"] == "crash" and status["lastFailure"]["role"] == "sampler"
    assert c.get_jobset(ns, "gateoff")["status"]["restarts"] == 1
    # The whole run restarted: the trainer pod is a new one.
    assert _pod(c, ns, "gateoff", "trainer").metadata.uid != trainer_uid


def _run_series(op: OperatorProcess, name: str) -> dict[tuple[str, str], float]:
    """The operator's rljob_run_* samples of RLJob `name`: (series, role or phase label) -> value."""
    url = f"http://127.0.0.1:{op.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("rljob_run_") and s.labels.get("name") == name:
                out[(s.name, s.labels.get("role") or s.labels.get("phase") or "")] = s.value
    return out


def test_run_series_follow_the_rljob(
    cluster_gate_off: Cluster, namespace_gate_off: str, rljob_operator_gate_off: OperatorProcess
) -> None:
    c, ns, op = cluster_gate_off, namespace_gate_off, rljob_operator_gate_off
    create_rljob(c, manifest("series", ns))
    wait_phase(c, ns, "series", "Running", timeout=120)
    report = (
        '{"step": 12, "lastCheckpointStep": 10, "rewardMean": 0.5, "adapterVersion": 2, '
        '"updateTime": "2026-01-01T00:00:00Z"}'
    )
    c.core.patch_namespaced_config_map("series-progress", ns, {"data": {"progress.json": report}})
    wait_rljob(c, ns, "series", 60, "progress step 12", lambda s: (s.get("progress") or {}).get("step") == 12)
    got = wait_for(
        lambda: (lambda g: g if g.get(("rljob_run_step", "")) == 12 else None)(_run_series(op, "series")),
        30,
        "the series of step 12",
    )
    assert got[("rljob_run_reward_mean", "")] == 0.5
    assert got[("rljob_run_last_checkpoint_step", "")] == 10
    assert got[("rljob_run_seconds_since_last_step", "")] > 3600  # reported at 2026-01-01
    assert got[("rljob_run_restarts", "trainer")] == 0
    assert got[("rljob_run_phase", "Running")] == 1 and got[("rljob_run_phase", "Pending")] == 0
    c.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "series")
    wait_for(lambda: not _run_series(op, "series"), 60, "the series gone after the RLJob's deletion")
