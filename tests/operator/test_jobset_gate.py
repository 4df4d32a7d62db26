"""What the operator renders when the cluster's JobSet refuses the failure action RestartJob (its feature
gate off, JobSet's default): the start-up probe, a refused JobSet turning it off, the plan and the status
saying which failure policy is in force. The real JobSet controller with the gate off:
tests/operator/test_restart_gate_cluster.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fixtures.memkube import MemoryKube, run
from fixtures.operator import stored_rljob as rljob
from rljob.operator import k8s
from rljob.operator.config import OperatorConfig
from rljob.operator.jobset_gate import RestartJobGate
from rljob.operator.reconcile import ChildError, Reconciler
from rljob.recipes.render import render

# JobSet v0.12.0's webhook with the gate off (pkg/webhooks/jobset_webhook.go).
GATE_OFF = (
    'admission webhook "vjobset.kb.io" denied the request: RestartJob and RestartJobAndIgnoreMaxRestarts '
    "failure policy actions are not allowed when RestartJob feature gate is disabled"
)


class ProbedKube(MemoryKube):
    """A MemoryKube whose JobSet dry run answers as the cluster's JobSet would."""

    def __init__(self, dry_run_error: k8s.ApiError | None) -> None:
        super().__init__()
        self.dry_run_error = dry_run_error

    async def dry_run_create(self, kind: k8s.Kind, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] != "JobSet":
            return await super().dry_run_create(kind, obj)
        self.writes.append(("dry-run", "JobSet", obj["metadata"]["namespace"], ""))
        if self.dry_run_error is not None:
            raise self.dry_run_error
        return copy.deepcopy(obj)


@pytest.mark.parametrize(
    ("setting", "error", "admitted", "probed"),
    [
        ("auto", None, True, True),
        ("auto", k8s.ApiError(422, {"message": GATE_OFF}), False, True),
        # Nothing learned (JobSet not installed, its webhook down): RestartJob assumed until a refusal.
        (
            "auto",
            k8s.ApiError(404, {"message": "the server could not find the requested resource"}),
            True,
            True,
        ),
        ("enabled", k8s.ApiError(422, {"message": GATE_OFF}), True, False),
        ("disabled", None, False, False),
    ],
)
def test_start_up_probe(setting: str, error: k8s.ApiError | None, admitted: bool, probed: bool) -> None:
    kube = ProbedKube(error)
    gate = RestartJobGate(setting)
    run(gate.probe(kube, "ns1"))  # type: ignore[arg-type]
    assert gate.admitted is admitted
    assert [w[:3] for w in kube.writes] == ([("dry-run", "JobSet", "ns1")] if probed else [])


def test_setting_comes_from_the_chart_and_a_bad_one_stops_the_operator() -> None:
    assert OperatorConfig.from_env({}).jobset_restart_job == "auto"
    assert OperatorConfig.from_env({"RLJOB_JOBSET_RESTART_JOB": "disabled"}).jobset_restart_job == "disabled"
    with pytest.raises(
        ValueError, match="RLJOB_JOBSET_RESTART_JOB: 'off' is not one of auto, enabled, disabled"
    ):
        RestartJobGate("off")


def _setup(gate: RestartJobGate) -> tuple[Reconciler, MemoryKube]:
    body = rljob()
    kube = MemoryKube()
    kube.objects[("RLJob", "ns", "demo")] = copy.deepcopy(body)
    rec = Reconciler(kube, lambda job: render(job, restart_job=gate.admitted), gate=gate)  # type: ignore[arg-type]
    rec.observe_rljob(None, body)
    return rec, kube


def test_a_jobset_refused_for_the_gate_is_planned_again_without_restart_job() -> None:
    """auto, the probe could not tell: the first JobSet (RestartJob) is refused for the gate; the retry
    renders the fallback, and the status says a sampler crash restarts the run, with no sampler budget."""
    gate = RestartJobGate("auto")
    rec, kube = _setup(gate)
    kube.fail["JobSet"] = k8s.ApiError(422, {"message": GATE_OFF})
    with pytest.raises(ChildError):
        run(rec.reconcile(("ns", "demo")))
    assert gate.admitted is False
    status = kube.objects[("RLJob", "ns", "demo")]["status"]
    assert any("RestartJob feature gate" in x.get("message", "") for x in status["conditions"])
    del kube.fail["JobSet"]  # the controller admits what JobSet's defaults allow
    run(rec.reconcile(("ns", "demo")))
    js = kube.objects[("JobSet", "ns", "demo")]
    actions = [r["action"] for r in js["spec"]["failurePolicy"]["rules"]]
    assert actions == ["RestartJobSetAndIgnoreMaxRestarts", "FailJobSet"]
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 3
    assert js["metadata"]["annotations"]["rljob.dev/sampler-failure"] == "RestartRun"
    run_json = kube.objects[("ConfigMap", "ns", "demo-run")]["data"]["run.json"]
    assert '"samplerFailure": "RestartRun"' in run_json
    status = kube.objects[("RLJob", "ns", "demo")]["status"]
    assert status["samplerFailure"] == "RestartRun"
    assert status["restarts"] == {"used": 0, "left": 3, "trainer": {"used": 0, "left": 3}}


@pytest.mark.parametrize(("setting", "error"), [("enabled", GATE_OFF), ("auto", "HTTP 500: etcd timeout")])
def test_other_refusals_change_nothing(setting: str, error: str) -> None:
    """`enabled` is the chart's word (the refusal stays in the status); another error is not the gate."""
    gate = RestartJobGate(setting)
    rec, kube = _setup(gate)
    kube.fail["JobSet"] = k8s.ApiError(422, {"message": error})
    with pytest.raises(ChildError):
        run(rec.reconcile(("ns", "demo")))
    assert gate.admitted is True
    del kube.fail["JobSet"]
    run(rec.reconcile(("ns", "demo")))
    js = kube.objects[("JobSet", "ns", "demo")]
    assert "RestartJob" in [r["action"] for r in js["spec"]["failurePolicy"]["rules"]]
    assert kube.objects[("RLJob", "ns", "demo")]["status"]["samplerFailure"] == "RestartSamplerJob"
