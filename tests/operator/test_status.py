"""Table-driven cases of the pure status logic (rljob.operator.status)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rljob.operator import conditions as c
from rljob.operator.status import (
    REASON_JOBSET_DELETED,
    JobSetView,
    Observed,
    PodFailure,
    classify_pod,
    derive_status,
    status_body,
)
from rljob.recipes.api import FailureClass, LastFailure, Phase, ProgressReport, Restarts, RLJobStatus

NOW = datetime(2026, 11, 29, 20, 0, 0, tzinfo=UTC)
EARLIER = NOW - timedelta(minutes=5)


def jobset(
    *,
    ready: tuple[int, int] = (0, 0),
    restarts: int = 0,
    counted: int = 0,
    suspend: bool = False,
    completed: bool = False,
    failed_reason: str | None = None,
    trainer: tuple[int, int] = (1, 2),
) -> dict[str, Any]:
    """A JobSet body as the API returns it: trainer `replicas x pods`, one single-host sampler."""
    conds = []
    if completed:
        conds.append({"type": "Completed", "status": "True", "reason": "AllJobsCompleted", "message": "done"})
    if failed_reason:
        conds.append(
            {"type": "Failed", "status": "True", "reason": failed_reason, "message": "jobset failed"}
        )
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "run", "namespace": "ns", "uid": "js-uid", "resourceVersion": "10"},
        "spec": {
            "suspend": suspend,
            "replicatedJobs": [
                {
                    "name": "trainer",
                    "replicas": trainer[0],
                    "template": {"spec": {"parallelism": trainer[1], "completions": trainer[1]}},
                },
                {
                    "name": "sampler",
                    "replicas": 1,
                    "template": {"spec": {"parallelism": 1, "completions": 1}},
                },
            ],
        },
        "status": {
            "restarts": restarts,
            "restartsCountTowardsMax": counted,
            "replicatedJobsStatus": [
                {"name": "trainer", "ready": ready[0]},
                {"name": "sampler", "ready": ready[1]},
            ],
            "conditions": conds,
            **({"terminalState": "Completed"} if completed else {}),
            **({"terminalState": "Failed"} if failed_reason else {}),
        },
    }


def prior(phase: Phase, **kw: Any) -> RLJobStatus:
    return RLJobStatus(
        phase=phase, restarts=Restarts(used=kw.pop("used", 0), left=3), job_set_name="run", **kw
    )


def failure(klass: FailureClass, attempt: int, reason: str = "", when: datetime = EARLIER) -> PodFailure:
    return PodFailure(klass, reason or klass.value, f"{klass.value} happened", when, attempt, "trainer")


@dataclasses.dataclass
class Case:
    name: str
    obs: Observed
    phase: Phase
    reason: str  # the reason of the condition that is True for this phase
    used: int = 0
    last_class: FailureClass | None = None
    last_reason: str | None = None
    events: tuple[str, ...] = ()


def obs(**kw: Any) -> Observed:
    js = kw.pop("js", None)
    return Observed(generation=1, now=NOW, jobset=JobSetView.from_body(js) if js else None, **kw)


CASES = [
    Case("new: no JobSet yet", obs(), Phase.PENDING, c.REASON_WAITING_FOR_PODS),
    Case(
        "new and suspended",
        obs(suspend=True),
        Phase.SUSPENDED,
        c.REASON_SUSPENDED_BY_USER,
        events=(c.EVENT_SUSPENDED,),
    ),
    Case("pods not ready", obs(js=jobset(ready=(0, 1))), Phase.PENDING, c.REASON_WAITING_FOR_PODS),
    Case(
        "trainer ready, sampler not", obs(js=jobset(ready=(1, 0))), Phase.PENDING, c.REASON_WAITING_FOR_PODS
    ),
    Case("all ready", obs(js=jobset(ready=(1, 1))), Phase.RUNNING, c.REASON_ALL_ROLES_READY),
    Case(
        "resumed after suspension",
        obs(js=jobset(ready=(1, 1)), prior=prior(Phase.SUSPENDED)),
        Phase.RUNNING,
        c.REASON_ALL_ROLES_READY,
        events=(c.EVENT_RESUMED,),
    ),
    Case(
        "JobSet suspended by user",
        obs(js=jobset(suspend=True), suspend=True),
        Phase.SUSPENDED,
        c.REASON_SUSPENDED_BY_USER,
        events=(c.EVENT_SUSPENDED,),
    ),
    Case(
        "JobSet suspended by Kueue",
        obs(js=jobset(suspend=True), queue_name="q"),
        Phase.SUSPENDED,
        c.REASON_QUEUED,
        events=(c.EVENT_SUSPENDED,),
    ),
    Case(
        "succeeded",
        obs(js=jobset(completed=True)),
        Phase.SUCCEEDED,
        c.REASON_TRAINER_COMPLETED,
        events=(c.EVENT_SUCCEEDED,),
    ),
    Case(
        "preemption: free restart, seen pod",
        obs(
            js=jobset(restarts=1, counted=0),
            prior=prior(Phase.RUNNING),
            failure=failure(FailureClass.PREEMPTION, 0, c.REASON_PREEMPTED),
        ),
        Phase.RESTARTING,
        c.REASON_PREEMPTED,
        used=0,
        last_class=FailureClass.PREEMPTION,
        events=(c.EVENT_RESTARTING,),
    ),
    Case(
        "maintenance: free restart",
        obs(
            js=jobset(restarts=1),
            prior=prior(Phase.RUNNING),
            failure=failure(FailureClass.MAINTENANCE, 0, c.REASON_MAINTENANCE),
        ),
        Phase.RESTARTING,
        c.REASON_MAINTENANCE,
        last_class=FailureClass.MAINTENANCE,
        events=(c.EVENT_RESTARTING,),
    ),
    Case(
        "crash: counted restart, seen pod",
        obs(
            js=jobset(restarts=1, counted=1),
            prior=prior(Phase.RUNNING),
            failure=failure(FailureClass.CRASH, 0, c.REASON_CRASHED),
        ),
        Phase.RESTARTING,
        c.REASON_CRASHED,
        used=1,
        last_class=FailureClass.CRASH,
        events=(c.EVENT_RESTARTING,),
    ),
    Case(
        "crash: counted restart, pod not seen",
        obs(js=jobset(restarts=2, counted=2), prior=prior(Phase.RUNNING, used=1)),
        Phase.RESTARTING,
        c.REASON_CRASHED,
        used=2,
        last_class=FailureClass.CRASH,
        events=(c.EVENT_RESTARTING,),
    ),
    Case(
        "running again after a restart keeps the last failure",
        obs(
            js=jobset(ready=(1, 1), restarts=1),
            prior=prior(
                Phase.RESTARTING,
                last_failure=LastFailure(
                    failure_class=FailureClass.PREEMPTION, reason="Preempted", time=EARLIER
                ),
            ),
            failure=failure(FailureClass.PREEMPTION, 0, c.REASON_PREEMPTED),
        ),
        Phase.RUNNING,
        c.REASON_ALL_ROLES_READY,
        last_class=FailureClass.PREEMPTION,
    ),
    Case(
        "exit 2: FailJobSet is bad configuration",
        obs(
            js=jobset(failed_reason=c.JS_REASON_FAIL_ACTION),
            prior=prior(Phase.RUNNING),
            failure=failure(FailureClass.BAD_CONFIGURATION, 0),
        ),
        Phase.FAILED,
        c.REASON_BAD_CONFIGURATION,
        last_class=FailureClass.BAD_CONFIGURATION,
        last_reason=c.REASON_BAD_CONFIGURATION,
        events=(c.EVENT_FAILED,),
    ),
    Case(
        "restarts exhausted",
        obs(
            js=jobset(failed_reason=c.JS_REASON_MAX_RESTARTS, restarts=3, counted=3),
            prior=prior(Phase.RESTARTING, used=3),
        ),
        Phase.FAILED,
        c.REASON_RESTARTS_EXHAUSTED,
        used=3,
        last_class=FailureClass.CRASH,
        last_reason=c.REASON_RESTARTS_EXHAUSTED,
        events=(c.EVENT_FAILED,),
    ),
    Case(
        "invalid spec",
        obs(spec_error="spec.trainer.mesh: product 3 != 4 devices"),
        Phase.FAILED,
        c.REASON_INVALID_SPEC,
        last_class=FailureClass.BAD_CONFIGURATION,
        last_reason=c.REASON_INVALID_SPEC,
        events=(c.EVENT_FAILED,),
    ),
    Case(
        "JobSet deleted before the outcome was seen",
        obs(prior=prior(Phase.RUNNING)),
        Phase.FAILED,
        REASON_JOBSET_DELETED,
        events=(c.EVENT_FAILED,),
    ),
    Case("latched Succeeded: JobSet deleted by TTL", obs(prior=prior(Phase.SUCCEEDED)), Phase.SUCCEEDED, ""),
    Case(
        "latched Failed: JobSet running again is ignored",
        obs(js=jobset(ready=(1, 1)), prior=prior(Phase.FAILED)),
        Phase.FAILED,
        "",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[x.name for x in CASES])
def test_derive_status(case: Case) -> None:
    derived = derive_status(case.obs)
    st = derived.status
    assert st.phase == case.phase
    if case.reason:
        active = {x.type: x for x in st.conditions if x.status == "True"}
        expected_type = {
            Phase.PENDING: None,
            Phase.RUNNING: c.READY,
            Phase.SUSPENDED: c.SUSPENDED,
            Phase.RESTARTING: c.RESTARTING,
            Phase.SUCCEEDED: c.SUCCEEDED,
            Phase.FAILED: c.FAILED,
        }[case.phase]
        if expected_type is None:
            ready = next(x for x in st.conditions if x.type == c.READY)
            assert ready.status == "False" and ready.reason == case.reason
        else:
            assert active[expected_type].reason == case.reason
        assert [x.type for x in st.conditions] == list(c.CONDITION_TYPES)
        assert st.restarts is not None and st.restarts.used == case.used and st.restarts.left == 3 - case.used
    if case.last_class is None and case.obs.prior is None:
        assert st.last_failure is None or case.phase == Phase.FAILED
    if case.last_class is not None:
        assert st.last_failure is not None and st.last_failure.failure_class == case.last_class
    if case.last_reason is not None:
        assert st.last_failure is not None and st.last_failure.reason == case.last_reason
    assert tuple(e.reason for e in derived.events) == case.events
    assert st.observed_generation == 1


def test_roles_count_pods_of_ready_jobs() -> None:
    st = derive_status(obs(js=jobset(ready=(2, 1), trainer=(2, 4)))).status
    assert st.roles is not None
    assert (st.roles.trainer.ready, st.roles.trainer.total) == (8, 8)
    assert (st.roles.sampler.ready, st.roles.sampler.total) == (1, 1)
    st = derive_status(obs(js=jobset(ready=(1, 0), trainer=(2, 4)))).status
    assert st.roles is not None and (st.roles.trainer.ready, st.roles.sampler.ready) == (4, 0)


def test_transition_time_kept_while_status_unchanged() -> None:
    first = derive_status(obs(js=jobset(ready=(1, 1)))).status
    later = dataclasses.replace(obs(js=jobset(ready=(1, 1)), prior=first), now=NOW + timedelta(hours=1))
    second = derive_status(later).status
    assert status_body(first) == status_body(second)
    broken = dataclasses.replace(later, jobset=JobSetView.from_body(jobset(ready=(0, 1))))
    third = derive_status(broken).status
    ready = next(x for x in third.conditions if x.type == c.READY)
    assert ready.status == "False" and ready.last_transition_time == NOW + timedelta(hours=1)


def test_progress_copied_and_kept() -> None:
    report = ProgressReport(
        step=7, last_checkpoint_step=5, resumed_from_step=0, reward_mean=0.25, adapter_version=3
    )
    st = derive_status(obs(js=jobset(ready=(1, 1)), progress=report)).status
    assert st.progress == report
    again = derive_status(obs(js=jobset(ready=(1, 1)), prior=st)).status
    assert again.progress == report
    body = status_body(st)
    assert body["progress"] == {
        "step": 7,
        "lastCheckpointStep": 5,
        "resumedFromStep": 0,
        "rewardMean": 0.25,
        "adapterVersion": 3,
    }


def test_api_url_set_and_kept() -> None:
    url = "http://tk-api.team.svc:8080"
    st = derive_status(obs(js=jobset(ready=(1, 1)), api_url=url)).status
    assert st.url == url and status_body(st)["url"] == url
    assert derive_status(obs(js=jobset(ready=(1, 1)), prior=st)).status.url == url
    assert derive_status(obs(js=jobset(ready=(1, 1)))).status.url is None


def test_latched_status_ignores_a_new_failure() -> None:
    done = derive_status(obs(js=jobset(completed=True))).status
    later = derive_status(obs(js=jobset(failed_reason="FailedJobs"), prior=done)).status
    assert later.phase == Phase.SUCCEEDED
    assert later.conditions == done.conditions


# ------------------------------------------------------------------------------------ classify_pod


def pod(
    *, phase: str = "Running", exit_code: int | None = None, disruption: str | None = None, attempt: str = "0"
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "conditions": []}
    if exit_code is not None:
        status["containerStatuses"] = [
            {
                "name": "trainer",
                "state": {"terminated": {"exitCode": exit_code, "finishedAt": "2026-11-29T19:55:00Z"}},
            }
        ]
    if disruption is not None:
        status["conditions"].append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": disruption,
                "lastTransitionTime": "2026-11-29T19:56:00Z",
            }
        )
    labels = {c.REPLICATED_JOB_LABEL: "trainer", c.RESTART_ATTEMPT_LABEL: attempt}
    return {"metadata": {"name": "run-trainer-0-0-abcde", "labels": labels}, "status": status}


POD_CASES = [
    ("running", pod(), None, None),
    ("exit 2", pod(phase="Failed", exit_code=2), FailureClass.BAD_CONFIGURATION, c.REASON_BAD_CONFIGURATION),
    ("exit 1", pod(phase="Failed", exit_code=1), FailureClass.CRASH, c.REASON_CRASHED),
    ("exit 137 (OOM)", pod(phase="Failed", exit_code=137), FailureClass.CRASH, c.REASON_CRASHED),
    (
        "node deleted",
        pod(phase="Failed", disruption="DeletionByPodGC"),
        FailureClass.PREEMPTION,
        c.REASON_PREEMPTED,
    ),
    (
        "preempted by scheduler",
        pod(disruption="PreemptionByScheduler"),
        FailureClass.PREEMPTION,
        c.REASON_PREEMPTED,
    ),
    (
        "graceful node shutdown",
        pod(disruption="TerminationByKubelet", exit_code=143, phase="Failed"),
        FailureClass.PREEMPTION,
        c.REASON_PREEMPTED,
    ),
    (
        "evicted (drain)",
        pod(disruption="EvictionByEvictionAPI"),
        FailureClass.MAINTENANCE,
        c.REASON_MAINTENANCE,
    ),
    (
        "taint manager",
        pod(disruption="DeletionByTaintManager"),
        FailureClass.MAINTENANCE,
        c.REASON_MAINTENANCE,
    ),
    (
        "disruption wins over exit 2",
        pod(phase="Failed", exit_code=2, disruption="DeletionByPodGC"),
        FailureClass.PREEMPTION,
        c.REASON_PREEMPTED,
    ),
    ("failed with exit 0 only", pod(phase="Failed", exit_code=0), None, None),
]


@pytest.mark.parametrize(("name", "body", "klass", "reason"), POD_CASES, ids=[x[0] for x in POD_CASES])
def test_classify_pod(
    name: str, body: dict[str, Any], klass: FailureClass | None, reason: str | None
) -> None:
    got = classify_pod(body, now=NOW)
    if klass is None:
        assert got is None
        return
    assert got is not None
    assert (got.failure_class, got.reason, got.role, got.attempt) == (klass, reason, "trainer", 0)
    assert got.time < NOW


def test_classify_pod_reads_attempt_and_exit_code_message() -> None:
    got = classify_pod(pod(phase="Failed", exit_code=3, attempt="4"))
    assert got is not None and got.attempt == 4
    assert got.message == "container trainer of pod run-trainer-0-0-abcde exited with code 3"


def test_pod_killed_by_a_restart_is_not_a_cause() -> None:
    body = pod(phase="Failed", exit_code=143)
    body["metadata"]["deletionTimestamp"] = "2026-11-29T19:57:00Z"
    assert classify_pod(body) is None
    body = pod(phase="Failed", disruption="DeletionByPodGC")
    body["metadata"]["deletionTimestamp"] = "2026-11-29T19:57:00Z"
    got = classify_pod(body)
    assert got is not None and got.failure_class == FailureClass.PREEMPTION
