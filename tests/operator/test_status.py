"""Table-driven cases of the pure status logic (rljob.operator.status)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rljob.operator import conditions as c
from rljob.operator.status.observed import Observed
from rljob.operator.status.phase import derive_status, status_body
from rljob.operator.status.pods import PodFailure, classify_pod
from rljob.operator.status.views import JobSetView
from rljob.recipes.api import (
    FailureClass,
    LastFailure,
    Phase,
    ProgressReport,
    Restarts,
    RLJobStatus,
    RoleRestarts,
)

TESTED_MODULES = (
    "rljob.operator.conditions",
    "rljob.operator.status.observed",
    "rljob.operator.status.pods",
    "rljob.operator.status.restarts",
    "rljob.operator.status.views",
)

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
        c.REASON_JOBSET_DELETED,
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


# ------------------------------------------------------------------------- role-scoped restarts


def sampler_restarted(body: dict[str, Any], *, all_: list[int], counted: list[int]) -> dict[str, Any]:
    """`body` with the sampler's per-Job restart counters of JobSet v0.12.0 (replicatedJobsStatus)."""
    for rjs in body["status"]["replicatedJobsStatus"]:
        if rjs["name"] == "sampler":
            rjs["jobRestarts"], rjs["jobRestartsCountTowardsMax"] = all_, counted
    return body


def sampler_prior(used: int) -> RLJobStatus:
    """A Running status that has counted `used` sampler restarts already (no failure recorded)."""
    return RLJobStatus(
        phase=Phase.RUNNING,
        job_set_name="run",
        restarts=Restarts(used=0, left=3, sampler=RoleRestarts(used=used, left=10 - used)),
    )


def sampler_failure(klass: FailureClass, job_attempt: int, when: datetime = EARLIER) -> PodFailure:
    return PodFailure(
        klass, klass.value, f"sampler {klass.value}", when, 0, "sampler", job_attempt=job_attempt, job_index=0
    )


@dataclasses.dataclass
class RoleCase:
    name: str
    obs: Observed
    phase: Phase
    reason: str
    trainer: tuple[int, int]  # (used, left)
    sampler: tuple[int, int]
    last_role: str | None = None
    last_reason: str | None = None
    stop: bool = False


ROLE_CASES = [
    RoleCase(
        "a sampler crash restarts the sampler Job alone: counted for the samplers, the trainer runs on",
        obs(
            js=sampler_restarted(jobset(ready=(1, 0)), all_=[1], counted=[1]),
            failure=sampler_failure(FailureClass.CRASH, 0),
        ),
        Phase.RESTARTING,
        c.REASON_CRASHED,
        trainer=(0, 3),
        sampler=(1, 9),
        last_role="sampler",
        last_reason="crash",
    ),
    RoleCase(
        "a sampler preempted: restarted alone, not counted",
        obs(
            js=sampler_restarted(jobset(ready=(1, 0)), all_=[1], counted=[0]),
            failure=sampler_failure(FailureClass.PREEMPTION, 0),
        ),
        Phase.RESTARTING,
        c.REASON_PREEMPTED,
        trainer=(0, 3),
        sampler=(0, 10),
        last_role="sampler",
    ),
    RoleCase(
        "the restarted sampler is ready again: Running",
        obs(js=sampler_restarted(jobset(ready=(1, 1)), all_=[1], counted=[1]), prior=sampler_prior(1)),
        Phase.RUNNING,
        c.REASON_ALL_ROLES_READY,
        trainer=(0, 3),
        sampler=(1, 9),
    ),
    RoleCase(
        "a sampler failure of the Job's current attempt is not yet the last failure",
        obs(
            js=sampler_restarted(jobset(ready=(1, 1)), all_=[1], counted=[1]),
            failure=sampler_failure(FailureClass.CRASH, 1),
            prior=sampler_prior(1),
        ),
        Phase.RUNNING,
        c.REASON_ALL_ROLES_READY,
        trainer=(0, 3),
        sampler=(1, 9),
    ),
    RoleCase(
        "a sampler restart whose pod was not seen: counted from the JobSet, the role named",
        obs(js=sampler_restarted(jobset(ready=(1, 0)), all_=[2], counted=[2])),
        Phase.RESTARTING,
        c.REASON_CRASHED,
        trainer=(0, 3),
        sampler=(2, 8),
        last_role="sampler",
        last_reason=c.REASON_CRASHED,
    ),
    RoleCase(
        "a trainer crash restarts the run: counted for the run, the role named",
        obs(js=jobset(restarts=1, counted=1), failure=failure(FailureClass.CRASH, 0)),
        Phase.RESTARTING,
        c.REASON_CRASHED,
        trainer=(1, 2),
        sampler=(0, 10),
        last_role="trainer",
    ),
    RoleCase(
        "samplers past their budget: Failed naming the field, the JobSet stopped",
        obs(
            js=sampler_restarted(jobset(ready=(1, 0)), all_=[11], counted=[11]),
            failure=sampler_failure(FailureClass.CRASH, 10),
        ),
        Phase.FAILED,
        c.REASON_RESTARTS_EXHAUSTED,
        trainer=(0, 3),
        sampler=(11, 0),
        last_role="sampler",
        last_reason=c.REASON_RESTARTS_EXHAUSTED,
        stop=True,
    ),
    RoleCase(
        "at the sampler budget, not past it: still running",
        obs(js=sampler_restarted(jobset(ready=(1, 1)), all_=[10], counted=[10]), prior=sampler_prior(10)),
        Phase.RUNNING,
        c.REASON_ALL_ROLES_READY,
        trainer=(0, 3),
        sampler=(10, 0),
    ),
    RoleCase(
        "the run past its budget while JobSet's shared budget has room: Failed, the JobSet stopped",
        obs(js=jobset(restarts=4, counted=4), failure=failure(FailureClass.CRASH, 3)),
        Phase.FAILED,
        c.REASON_RESTARTS_EXHAUSTED,
        trainer=(4, 0),
        sampler=(0, 10),
        last_role="trainer",
        last_reason=c.REASON_RESTARTS_EXHAUSTED,
        stop=True,
    ),
    RoleCase(
        "JobSet's own budget exhausted by a sampler: Failed, the sampler named, nothing to stop",
        obs(
            js=sampler_restarted(jobset(failed_reason=c.JS_REASON_MAX_RESTARTS), all_=[3], counted=[3]),
            failure=sampler_failure(FailureClass.CRASH, 3),
            max_restarts=0,
            max_sampler_restarts=3,
        ),
        Phase.FAILED,
        c.REASON_RESTARTS_EXHAUSTED,
        trainer=(0, 0),
        sampler=(3, 0),
        last_role="sampler",
        last_reason=c.REASON_RESTARTS_EXHAUSTED,
    ),
]


@pytest.mark.parametrize("case", ROLE_CASES, ids=lambda x: x.name)
def test_role_scoped_restarts(case: RoleCase) -> None:
    from rljob.operator.status.restarts import stop_jobset

    derived = derive_status(case.obs)
    st = derived.status
    assert st.phase == case.phase
    active = {x.type: x for x in st.conditions if x.status == "True"}
    ctype = {Phase.RUNNING: c.READY, Phase.RESTARTING: c.RESTARTING, Phase.FAILED: c.FAILED}[case.phase]
    assert active[ctype].reason == case.reason
    assert st.restarts is not None and st.restarts.trainer and st.restarts.sampler
    assert (st.restarts.used, st.restarts.left) == case.trainer
    assert (st.restarts.trainer.used, st.restarts.trainer.left) == case.trainer
    assert (st.restarts.sampler.used, st.restarts.sampler.left) == case.sampler
    if case.last_role is None:
        assert st.last_failure is None
    else:
        assert st.last_failure is not None and st.last_failure.role == case.last_role
    if case.last_reason is not None:
        assert st.last_failure is not None and st.last_failure.reason == case.last_reason
    if case.phase == Phase.FAILED and case.reason == c.REASON_RESTARTS_EXHAUSTED:
        field = "maxSamplerRestarts" if case.last_role == "sampler" else "maxRestarts"
        assert f"spec.failurePolicy.{field}" in active[c.FAILED].message or case.obs.jobset.failed  # type: ignore[union-attr]
    assert stop_jobset(st, case.obs.jobset) == case.stop


def test_a_sampler_restart_message_says_the_trainer_kept_running() -> None:
    st = derive_status(
        obs(
            js=sampler_restarted(jobset(ready=(1, 0)), all_=[1], counted=[1]),
            failure=sampler_failure(FailureClass.CRASH, 0),
        )
    ).status
    restarting = next(x for x in st.conditions if x.type == c.RESTARTING)
    assert restarting.message.startswith("sampler restart 1, the trainer kept running: waiting for pods")


def test_jobset_view_reads_the_budgets_and_job_restarts() -> None:
    from rljob.recipes import failure as rules

    body = sampler_restarted(jobset(), all_=[2, 0], counted=[1, 0])
    body["metadata"]["annotations"] = rules.budget_annotations(4, 6)
    body["spec"]["failurePolicy"] = rules.jobset_failure_policy(4, 6)
    view = JobSetView.from_body(body)
    assert (view.max_restarts, view.max_sampler_restarts) == (4, 6)
    assert view.job_restarts["sampler"] == (2, 0) and view.counted_job_restarts["sampler"] == (1, 0)
    assert (view.job_restarts_of("sampler", 0), view.job_restarts_of("sampler", 1)) == (2, 0)
    assert view.job_restarts_of("sampler", 5) == 0


def test_classify_pod_reads_the_job_restart_attempt() -> None:
    body = pod(phase="Failed", exit_code=1, attempt="0")
    body["metadata"]["labels"][c.REPLICATED_JOB_LABEL] = "sampler"
    body["metadata"]["labels"][c.JOB_RESTART_ATTEMPT_LABEL] = "3"
    body["metadata"]["labels"][c.JOB_INDEX_LABEL] = "1"
    got = classify_pod(body)
    assert got is not None and (got.role, got.job_attempt, got.job_index) == ("sampler", 3, 1)
