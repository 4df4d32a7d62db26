"""Pure status logic: what the RLJob's status is, given what the operator observes.

No I/O here. The reconcile service (rljob.operator.reconcile) gathers the observations (the RLJob, a
projection of its JobSet, the newest pod failure, the trainer's progress report) into `Observed` and
calls `derive_status`, which returns the complete new status and the events to post after writing it.

Rules (the tests in tests/operator/test_status.py are the table of cases):
- Terminal phases are latched: once Succeeded or Failed, the phase and terminal conditions never change
  and the operator never creates a JobSet again (also when the JobSet is later deleted by its TTL).
- A spec that does not parse or plan makes the run Failed (reason InvalidSpec, naming the field), unless its
  JobSet exists already (an operator upgrade that refuses what an older version admitted): then the run is
  tracked from its JobSet to its end, with Accepted=False (SpecNoLongerPlans) and a Warning event.
- A child that cannot be created (an API error, or an object of the same name this RLJob does not own)
  keeps the run Pending with Ready=False (CreateFailed, ChildNotOwned) and a Warning event; the reconcile
  retries with backoff. So does a Job of the run whose pods the API server refuses (Pod Security
  admission, a quota): the Job controller's FailedCreate event, read by the reconcile while the run
  waits for pods, is the message (PodCreateFailed), until the pods exist and are ready.
- The compile preflight (spec.trainer.preflight.compile): while its Job runs the run is Pending with
  Ready=False (PreflightCompiling) and no JobSet exists; a refusal (exit 2) keeps it Pending with Ready=False
  (CompileDoesNotFit, the refusal's lines from the pod's termination message) and a Warning event, any other
  failure likewise (PreflightFailed); the JobSet is created only after the Job succeeded. The outcome is kept
  in status.preflight, so a Job deleted by its TTL is not run again.
- A JobSet that disappears before its outcome was observed makes the run Failed (JobSetDeleted): the
  operator does not guess whether it finished, and never silently starts the run over.
- Restarts, per role (rljob.recipes.failure): the run's (a trainer crash restarts every Job) are the
  JobSet's restartsCountTowardsMax; the samplers' (a sampler crash restarts that sampler Job alone) are
  the sum of its replicatedJobsStatus[sampler].jobRestartsCountTowardsMax (JobSet >= v0.12.0). Restarts
  after preemption or maintenance (DisruptionTarget) are not counted. JobSet has one budget for both, so
  the operator holds each role to its own: a role past its budget makes the run Failed
  (RestartsExhausted, naming the budget) and the reconcile suspends the JobSet (its pods stop). The
  class and role of the last failure come from the failed pod when the operator saw it, otherwise from
  which JobSet counter moved.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from rljob.operator import conditions as c
from rljob.recipes import failure as failure_rules
from rljob.recipes.api import (
    Condition,
    FailureClass,
    LastFailure,
    Phase,
    PreflightState,
    PreflightStatus,
    ProgressReport,
    Restarts,
    RLJobStatus,
    RoleRestarts,
    RolesStatus,
    RoleStatus,
)
from rljob.recipes.failure import SamplerFailure

REASON_JOBSET_DELETED = "JobSetDeleted"
TERMINAL = frozenset({Phase.SUCCEEDED, Phase.FAILED})


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp from the API (`2026-01-02T03:04:05Z`) as an aware datetime, else None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _ints(value: Any) -> tuple[int, ...]:
    return tuple(int(x) if isinstance(x, int) else 0 for x in value or ())


def _label_int(labels: Mapping[str, Any], key: str) -> int:
    try:
        return int(labels.get(key, 0))
    except (TypeError, ValueError):
        return 0


def controller_ref(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    """An object's controller owner reference ({} when it has none)."""
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller"):
            return ref
    return {}


def controller_uid(meta: Mapping[str, Any]) -> str:
    """The uid of an object's controller owner reference ("" when it has none)."""
    return str(controller_ref(meta).get("uid") or "")


# --------------------------------------------------------------------------------- JobSet projection


@dataclasses.dataclass(frozen=True, slots=True)
class RoleShape:
    """One replicatedJob: `replicas` Jobs of `pods` pods each."""

    replicas: int
    pods: int


@dataclasses.dataclass(frozen=True, slots=True)
class JobSetView:
    """The few fields of a JobSet the operator needs (kept in memory for every RLJob: keep it small)."""

    name: str
    uid: str
    resource_version: str
    suspended: bool
    roles: Mapping[str, RoleShape]
    ready_jobs: Mapping[str, int]
    restarts: int = 0
    counted_restarts: int = 0
    completed: bool = False
    failed: bool = False
    failed_reason: str = ""
    failed_message: str = ""
    queue_name: str | None = None
    owner_uid: str = ""  # the controller owner reference's uid: the RLJob that owns this JobSet
    namespace: str = ""
    max_restarts: int | None = None  # the RLJob's spec.failurePolicy.maxRestarts (failure.budgets_of)
    max_sampler_restarts: int | None = None  # the RLJob's spec.failurePolicy.maxSamplerRestarts
    # What a sampler crash restarts in this JobSet (rljob.recipes.failure.sampler_failure_of).
    sampler_failure: SamplerFailure = SamplerFailure.RESTART_SAMPLER_JOB
    # Per replicatedJob, per Job index: restarts of that Job alone (JobSet >= v0.12.0), all and counted.
    job_restarts: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    counted_job_restarts: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobSetView:
        meta = body.get("metadata") or {}
        spec = body.get("spec") or {}
        status = body.get("status") or {}
        roles: dict[str, RoleShape] = {}
        for rj in spec.get("replicatedJobs") or []:
            job_spec = ((rj.get("template") or {}).get("spec")) or {}
            parallelism = int(job_spec.get("parallelism", 1) or 1)
            completions = int(job_spec.get("completions", parallelism) or parallelism)
            roles[str(rj.get("name", ""))] = RoleShape(
                replicas=int(rj.get("replicas", 1) or 1), pods=min(parallelism, completions)
            )
        rjs = status.get("replicatedJobsStatus") or []
        ready = {str(s.get("name", "")): int(s.get("ready", 0) or 0) for s in rjs}
        job_restarts = {
            str(s.get("name", "")): _ints(s.get("jobRestarts")) for s in rjs if s.get("jobRestarts")
        }
        counted_job_restarts = {
            str(s.get("name", "")): _ints(s.get("jobRestartsCountTowardsMax"))
            for s in rjs
            if s.get("jobRestartsCountTowardsMax")
        }
        conds = {str(x.get("type")): x for x in status.get("conditions") or [] if x.get("status") == "True"}
        terminal = str(status.get("terminalState") or "")
        failed = conds.get(c.JS_FAILED)
        max_restarts: int | None = None
        max_sampler_restarts: int | None = None
        if isinstance((spec.get("failurePolicy") or {}).get("maxRestarts"), int):
            max_restarts, max_sampler_restarts = failure_rules.budgets_of(body)
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            resource_version=str(meta.get("resourceVersion", "")),
            suspended=bool(spec.get("suspend", False)),
            roles=roles,
            ready_jobs=ready,
            restarts=int(status.get("restarts", 0) or 0),
            counted_restarts=int(status.get("restartsCountTowardsMax", 0) or 0),
            completed=terminal == c.JS_COMPLETED or c.JS_COMPLETED in conds,
            failed=terminal == c.JS_FAILED or failed is not None,
            failed_reason=str((failed or {}).get("reason", "")),
            failed_message=str((failed or {}).get("message", "")),
            queue_name=(meta.get("labels") or {}).get(c.QUEUE_LABEL),
            owner_uid=controller_uid(meta),
            namespace=str(meta.get("namespace", "")),
            max_restarts=max_restarts,
            max_sampler_restarts=max_sampler_restarts,
            sampler_failure=failure_rules.sampler_failure_of(body),
            job_restarts=job_restarts,
            counted_job_restarts=counted_job_restarts,
        )

    @property
    def job_names(self) -> frozenset[str]:
        """The names of this JobSet's Jobs: ``<jobset>-<replicatedJob>-<index>`` (JobSet's naming)."""
        return frozenset(
            f"{self.name}-{role}-{i}" for role, shape in self.roles.items() for i in range(shape.replicas)
        )

    def owns_pod(self, pod: Mapping[str, Any]) -> bool:
        """Whether ``pod`` is one of this JobSet's: its controller is one of the JobSet's Jobs by name and its
        jobset-uid label is this JobSet's uid. A label alone is not enough: anyone who creates pods in the
        namespace can label one with another run's name."""
        meta = pod.get("metadata") or {}
        owner = controller_ref(meta)
        return (
            bool(self.uid)
            and (meta.get("labels") or {}).get(c.JOBSET_UID_LABEL) == self.uid
            and owner.get("kind") == "Job"
            and str(owner.get("apiVersion", "")).startswith("batch/")
            and owner.get("name") in self.job_names
        )

    def job_restarts_of(self, role: str, index: int) -> int:
        """How often Job `index` of `role` was restarted alone (its pods' job-restart-attempt label)."""
        got = self.job_restarts.get(role, ())
        return got[index] if 0 <= index < len(got) else 0

    def role_status(self, role: str) -> RoleStatus:
        shape = self.roles.get(role)
        if shape is None:
            return RoleStatus()
        ready = min(self.ready_jobs.get(role, 0), shape.replicas) * shape.pods
        return RoleStatus(ready=ready, total=shape.replicas * shape.pods)


# ------------------------------------------------------------------------------------- pod failures


@dataclasses.dataclass(frozen=True, slots=True)
class PodFailure:
    """What one failed pod says about why its attempt ended."""

    failure_class: FailureClass
    reason: str
    message: str
    time: datetime
    attempt: int
    role: str
    jobset_uid: str = ""  # the JobSet the pod came from (its jobset-uid label)
    job_attempt: int = 0  # its Job's restarts alone (job-restart-attempt label, JobSet >= v0.12.0)
    job_index: int = 0  # its Job's index within the role (job-index label)


def classify_pod(pod: Mapping[str, Any], now: datetime | None = None) -> PodFailure | None:
    """The failure a pod reports, or None if it has not failed.

    DisruptionTarget=True (node deleted, preempted, evicted, drained) is preemption or maintenance
    whatever the exit code; otherwise a terminated container's non-zero exit code decides: 2 is bad
    configuration (contract 3), anything else a crash. Pods that failed while being deleted are not
    failures of their own (SIGTERM from a JobSet restart).
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    labels = meta.get("labels") or {}
    name = str(meta.get("name", ""))
    role = str(labels.get(c.REPLICATED_JOB_LABEL, ""))
    attempt = _label_int(labels, c.RESTART_ATTEMPT_LABEL)
    job = (_label_int(labels, c.JOB_RESTART_ATTEMPT_LABEL), _label_int(labels, c.JOB_INDEX_LABEL))
    jobset_uid = str(labels.get(c.JOBSET_UID_LABEL, ""))
    fallback = now or datetime.now(UTC)
    for cond in status.get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            reason = str(cond.get("reason", ""))
            if reason in c.DISRUPTION_MAINTENANCE:
                klass, our_reason = FailureClass.MAINTENANCE, c.REASON_MAINTENANCE
            else:
                klass, our_reason = FailureClass.PREEMPTION, c.REASON_PREEMPTED
            message = f"pod {name}: {reason or 'DisruptionTarget'}"
            if cond.get("message"):
                message += f": {cond['message']}"
            when = parse_time(cond.get("lastTransitionTime")) or fallback
            return PodFailure(klass, our_reason, message, when, attempt, role, jobset_uid, *job)
    if status.get("phase") != "Failed" or meta.get("deletionTimestamp"):
        # A pod killed while being deleted (the JobSet tearing an attempt down) is a consequence of
        # another failure, not its cause.
        return None
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        code = term.get("exitCode")
        if isinstance(code, int) and code != 0:
            when = parse_time(term.get("finishedAt")) or fallback
            message = f"container {cs.get('name', '?')} of pod {name} exited with code {code}"
            # The container's termination message: what it wrote to /dev/termination-log, or with
            # terminationMessagePolicy FallbackToLogsOnError the end of its log (the entrypoints print one
            # `field: message` line before exit 2). Its last line, bounded.
            said = [x.strip() for x in str(term.get("message") or "").splitlines() if x.strip()]
            if said:
                message += f": {said[-1][:500]}"
            klass, reason = (
                (FailureClass.BAD_CONFIGURATION, c.REASON_BAD_CONFIGURATION)
                if code == failure_rules.EXIT_BAD_CONFIG
                else (FailureClass.CRASH, c.REASON_CRASHED)
            )
            return PodFailure(klass, reason, message, when, attempt, role, jobset_uid, *job)
    return None


# ------------------------------------------------------------------------------ the compile preflight

# The Job controller's Failed condition of a pod failure policy's FailJob rule: "Container compile for pod
# ns/name failed with exit code 2 matching FailJob rule at index 0" (kubernetes pkg/controller/job).
_EXIT_CODE = re.compile(r"failed with exit code (\d+)")


@dataclasses.dataclass(frozen=True, slots=True)
class PreflightView:
    """The few fields of a compile preflight Job (rljob.recipes.render.preflight_job) the operator needs."""

    name: str
    uid: str
    resource_version: str
    owner_uid: str = ""
    succeeded: bool = False
    failed: bool = False
    reason: str = ""
    message: str = ""
    exit_code: int | None = None  # from the Failed condition of the Job's pod failure policy

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PreflightView:
        meta = body.get("metadata") or {}
        conds = {
            str(x.get("type")): x
            for x in (body.get("status") or {}).get("conditions") or []
            if x.get("status") == "True"
        }
        failed = conds.get("Failed") or {}
        message = " ".join(str(failed.get("message") or "").split())
        code = _EXIT_CODE.search(message)
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            resource_version=str(meta.get("resourceVersion", "")),
            owner_uid=controller_uid(meta),
            succeeded="Complete" in conds,
            failed=bool(failed),
            reason=str(failed.get("reason") or ""),
            message=message,
            exit_code=int(code[1]) if code else None,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class PreflightPod:
    """What a failed compile preflight pod said: its Job, its container's exit code and termination
    message (the refusal lines compilecheck wrote to /dev/termination-log, or with FallbackToLogsOnError
    the end of its log)."""

    job: str
    exit_code: int | None
    message: str
    # The kubelet killed the container at its memory limit (reason OOMKilled): the limit it had, which is
    # spec.trainer.preflight.memory ("" when the pod did not say).
    oom_limit: str | None = None


def preflight_pod(pod: Mapping[str, Any]) -> PreflightPod | None:
    """The failure of a preflight pod, or None while it has not failed."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    job = str((meta.get("labels") or {}).get(c.JOB_NAME_LABEL, ""))
    if status.get("phase") != "Failed":
        return None
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        code = term.get("exitCode")
        if isinstance(code, int) and code != 0:
            oom = None
            if term.get("reason") == "OOMKilled":
                containers = (pod.get("spec") or {}).get("containers") or [{}]
                oom = str((((containers[0].get("resources") or {}).get("limits")) or {}).get("memory") or "")
            return PreflightPod(job, code, str(term.get("message") or ""), oom)
    said = f"pod {meta.get('name', '')}: {status.get('reason') or 'Failed'}"
    if status.get("message"):
        said += f": {status['message']}"
    return PreflightPod(job, None, said)


def preflight_outcome(view: PreflightView, pod: PreflightPod | None) -> PreflightStatus:
    """Where a preflight Job stands: Running, Succeeded, DoesNotFit (exit 2: its lines) or Failed."""
    if view.succeeded:
        return PreflightStatus(job=view.name, state=PreflightState.SUCCEEDED, message="every program fits")
    if not view.failed:
        return PreflightStatus(job=view.name, state=PreflightState.RUNNING)
    ours = pod if pod is not None and pod.job == view.name else None
    code = ours.exit_code if ours is not None and ours.exit_code is not None else view.exit_code
    lines = [x.strip() for x in (ours.message if ours else "").splitlines() if x.strip()]
    if code == failure_rules.EXIT_BAD_CONFIG:
        text = "\n".join(lines) or f"Job {view.name}: {view.message}"
        return PreflightStatus(job=view.name, state=PreflightState.DOES_NOT_FIT, message=text[:4000])
    if ours is not None and ours.oom_limit is not None:
        # A setting of the manifest, not a bug: the compile needs more memory than the pod was given.
        limit = f" of {ours.oom_limit}" if ours.oom_limit else ""
        text = (
            f"spec.trainer.preflight.memory: Job {view.name}'s compile ran out of the pod's memory{limit} "
            '(OOMKilled): give a new RLJob more (the spec is immutable; docs/operator.md, "The compile '
            'preflight", says what a compile uses)'
        )
        return PreflightStatus(job=view.name, state=PreflightState.FAILED, message=text)
    text = f"Job {view.name} failed" + (f" with exit code {code}" if code is not None else "")
    text += f" ({view.reason}: {view.message})" if view.reason else ""
    if lines:
        text += ": " + " ".join(lines[-5:])[-2000:]
    return PreflightStatus(job=view.name, state=PreflightState.FAILED, message=text[:4000])


_PREFLIGHT_REASONS = {
    PreflightState.RUNNING: c.REASON_PREFLIGHT_RUNNING,
    PreflightState.DOES_NOT_FIT: c.REASON_COMPILE_DOES_NOT_FIT,
    PreflightState.FAILED: c.REASON_PREFLIGHT_FAILED,
}


# ------------------------------------------------------------------------------------------- status


@dataclasses.dataclass(frozen=True, slots=True)
class Observed:
    """Everything the status depends on, gathered by the reconcile service."""

    generation: int
    now: datetime
    prior: RLJobStatus | None = None
    spec_error: str | None = None
    suspend: bool = False
    queue_name: str | None = None
    max_restarts: int = 3
    max_sampler_restarts: int = 10
    jobset_name: str | None = None
    jobset: JobSetView | None = None
    failure: PodFailure | None = None
    progress: ProgressReport | None = None
    api_url: str | None = None
    # A child the reconcile could not create: (reason, message); REASON_CREATE_FAILED or REASON_NOT_OWNED.
    create_error: tuple[str, str] | None = None
    # The newest FailedCreate of the run's Jobs (their pods refused by the API server): its message.
    pod_create_error: str | None = None
    # The compile preflight of this plan (spec.trainer.preflight.compile): where its Job stands; None when
    # the preflight is off or its Job is not created yet.
    preflight: PreflightStatus | None = None
    # What a sampler crash restarts under this plan (None: not planned); the JobSet's own wins.
    sampler_failure: SamplerFailure | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class Derived:
    status: RLJobStatus
    events: Sequence[Event]


# How recent a Job's FailedCreate must be to count: the Job controller retries a refused pod create with a
# backoff of at most a minute (MaxJobApiBackOff, kubernetes pkg/controller/job/job_controller.go), and each
# retry's event moves lastTimestamp (or the series' lastObservedTime), though the event recorder's spam
# filter lets one object's repeats through only every 5 minutes after a burst: an event older than 10
# minutes is a refusal that stopped.
POD_CREATE_ERROR_WINDOW_S = 10 * 60


def pod_create_error(events: Sequence[Mapping[str, Any]], jobset: JobSetView, now: datetime) -> str | None:
    """The message of the newest recent FailedCreate event (core/v1) of a Job of ``jobset``, matched by the
    Job's exact name (``<jobset>-<replicatedJob>-<index>``: a name prefix would take RLJob ``a-b``'s events
    for RLJob ``a``'s), or None."""
    newest: tuple[datetime, str] | None = None
    jobs = jobset.job_names
    for ev in events:
        obj = ev.get("involvedObject") or {}
        if ev.get("reason") != "FailedCreate" or obj.get("kind") != "Job":
            continue
        name = str(obj.get("name") or "")
        if name not in jobs:
            continue
        series = ev.get("series") or {}
        when = (
            parse_time(ev.get("lastTimestamp"))
            or parse_time(series.get("lastObservedTime"))
            or parse_time(ev.get("eventTime"))
            or parse_time(ev.get("firstTimestamp"))
        )
        if when is None or (now - when).total_seconds() > POD_CREATE_ERROR_WINDOW_S:
            continue
        message = f"Job {name}: " + " ".join(str(ev.get("message") or "").split())
        if newest is None or when > newest[0]:
            newest = (when, message[:1000])
    return newest[1] if newest else None


def stop_jobset(status: RLJobStatus, jobset: JobSetView | None) -> bool:
    """Whether the reconcile must suspend the JobSet: the run is Failed (a role past its restart budget)
    while its JobSet still runs. JobSet has one budget for both roles (rljob.recipes.failure), so it would
    otherwise restart what the RLJob's budgets refuse."""
    return (
        status.phase == Phase.FAILED
        and jobset is not None
        and not (jobset.failed or jobset.completed or jobset.suspended)
    )


def _roles(obs: Observed) -> RolesStatus:
    if obs.jobset is not None:
        return RolesStatus(
            trainer=obs.jobset.role_status(c.ROLE_TRAINER), sampler=obs.jobset.role_status(c.ROLE_SAMPLER)
        )
    prior = obs.prior.roles if obs.prior and obs.prior.roles else RolesStatus()
    return RolesStatus(
        trainer=RoleStatus(ready=0, total=prior.trainer.total),
        sampler=RoleStatus(ready=0, total=prior.sampler.total),
    )


def _newer(failure: PodFailure, prior: LastFailure | None) -> bool:
    return prior is None or prior.time is None or failure.time > prior.time


@dataclasses.dataclass(frozen=True, slots=True)
class Used:
    """Counted restarts per role, and the role past its budget (None: none)."""

    trainer: int = 0
    sampler: int = 0
    exhausted: str | None = None


def restarts_used(obs: Observed) -> Used:
    """Counted restarts per role (the JobSet's counters, else the prior status) and which role, if any, is
    past its budget (spec.failurePolicy.maxRestarts, maxSamplerRestarts)."""
    js, prior = obs.jobset, obs.prior
    if js is not None:
        trainer = js.counted_restarts
        sampler = sum(js.counted_job_restarts.get(c.ROLE_SAMPLER, ()))
    else:
        restarts = prior.restarts if prior and prior.restarts else None
        trainer = restarts.used if restarts else 0
        sampler = restarts.sampler.used if restarts and restarts.sampler else 0
    exhausted = None
    if trainer > obs.max_restarts:
        exhausted = c.ROLE_TRAINER
    elif sampler > obs.max_sampler_restarts:
        exhausted = c.ROLE_SAMPLER
    return Used(trainer=trainer, sampler=sampler, exhausted=exhausted)


def exhausted_message(obs: Observed, used: Used) -> str:
    """What a run stopped for a role past its budget says (the field to raise)."""
    if used.exhausted == c.ROLE_SAMPLER:
        return (
            f"spec.failurePolicy.maxSamplerRestarts: {used.sampler} sampler restarts counted, "
            f"the budget is {obs.max_sampler_restarts}: the run is stopped"
        )
    return (
        f"spec.failurePolicy.maxRestarts: {used.trainer} restarts of the run counted, "
        f"the budget is {obs.max_restarts}: the run is stopped"
    )


def _role(role: str) -> str | None:
    return role if role in (c.ROLE_TRAINER, c.ROLE_SAMPLER) else None


def _last_failure(obs: Observed, used: Used) -> LastFailure | None:
    prior = obs.prior.last_failure if obs.prior else None
    js, seen = obs.jobset, obs.failure
    if js is None:
        return prior
    stopped = used.exhausted is not None and not js.completed
    if js.failed or stopped:
        if js.failed and js.failed_reason == c.JS_REASON_FAIL_ACTION:
            klass, reason = FailureClass.BAD_CONFIGURATION, c.REASON_BAD_CONFIGURATION
        elif stopped or js.failed_reason == c.JS_REASON_MAX_RESTARTS:
            klass, reason = FailureClass.CRASH, c.REASON_RESTARTS_EXHAUSTED
        else:
            klass, reason = FailureClass.CRASH, c.REASON_JOBSET_FAILED
        match = seen is not None and seen.failure_class == klass
        detail = seen.message if seen is not None and match else js.failed_message
        if stopped and not js.failed:
            detail = exhausted_message(obs, used) + (
                f"; {seen.message}" if seen is not None and match else ""
            )
        when = seen.time if seen is not None and match else obs.now
        role = used.exhausted if stopped else (_role(seen.role) if seen is not None and match else None)
        if prior is not None and prior.reason == reason and prior.failure_class == klass:
            return prior
        return LastFailure(failure_class=klass, reason=reason, message=detail, time=when, role=role)
    # The failure that ended attempt N-1 (the JobSet is now at attempt N = restarts), or the one that ended
    # a sampler Job restarted alone (its Job is now at job-restart-attempt + 1).
    if seen is not None and _newer(seen, prior):
        ended_attempt = seen.attempt == js.restarts - 1 and js.restarts > 0
        ended_job = (
            seen.role == c.ROLE_SAMPLER
            and seen.attempt == js.restarts
            and seen.job_attempt == js.job_restarts_of(seen.role, seen.job_index) - 1
        )
        if ended_attempt or ended_job:
            return LastFailure(
                failure_class=seen.failure_class,
                reason=seen.reason,
                message=seen.message,
                time=seen.time,
                role=_role(seen.role),
            )
    before = obs.prior.restarts if obs.prior and obs.prior.restarts else None
    prior_used = before.used if before else 0
    prior_sampler = before.sampler.used if before and before.sampler else 0
    if used.trainer > prior_used:
        message = f"restart {used.trainer} of {obs.max_restarts} counted (the failed pod was not observed)"
        return LastFailure(
            failure_class=FailureClass.CRASH,
            reason=c.REASON_CRASHED,
            message=message,
            time=obs.now,
            role=c.ROLE_TRAINER,
        )
    if used.sampler > prior_sampler:
        message = (
            f"sampler restart {used.sampler} of {obs.max_sampler_restarts} counted "
            "(the failed pod was not observed)"
        )
        return LastFailure(
            failure_class=FailureClass.CRASH,
            reason=c.REASON_CRASHED,
            message=message,
            time=obs.now,
            role=c.ROLE_SAMPLER,
        )
    return prior


_FAILURE_REASON = {
    FailureClass.PREEMPTION: c.REASON_PREEMPTED,
    FailureClass.MAINTENANCE: c.REASON_MAINTENANCE,
    FailureClass.CRASH: c.REASON_CRASHED,
    FailureClass.BAD_CONFIGURATION: c.REASON_BAD_CONFIGURATION,
}


def _phase_and_reasons(
    obs: Observed, roles: RolesStatus, last: LastFailure | None, used: Used
) -> tuple[Phase, str, str]:
    """(phase, reason, message) for the non-latched case."""
    js = obs.jobset
    if obs.spec_error is not None:
        return Phase.FAILED, c.REASON_INVALID_SPEC, obs.spec_error
    if js is None:
        prior_js = obs.prior.job_set_name if obs.prior else None
        if prior_js:
            return (
                Phase.FAILED,
                REASON_JOBSET_DELETED,
                f"JobSet {prior_js} was deleted before its outcome was observed",
            )
        if obs.create_error is not None:
            return Phase.PENDING, *obs.create_error
        pf = obs.preflight
        if pf is not None and pf.state != PreflightState.SUCCEEDED:
            if pf.state == PreflightState.RUNNING:
                message = (
                    f"Job {pf.job} compiles the trainer's programs on a CPU pod; the JobSet is created once "
                    "they fit"
                )
            else:
                message = pf.message or f"Job {pf.job} failed"
            return Phase.PENDING, _PREFLIGHT_REASONS[pf.state], message
        if obs.suspend:
            return Phase.SUSPENDED, c.REASON_SUSPENDED_BY_USER, "spec.suspend is true"
        return Phase.PENDING, c.REASON_WAITING_FOR_PODS, "creating the JobSet"
    if js.completed:
        return Phase.SUCCEEDED, c.REASON_TRAINER_COMPLETED, "the trainer finished"
    if used.exhausted is not None and not js.failed:
        return Phase.FAILED, c.REASON_RESTARTS_EXHAUSTED, exhausted_message(obs, used)
    if js.failed:
        reason = last.reason if last else c.REASON_JOBSET_FAILED
        message = f"{js.failed_reason}: {js.failed_message}" if js.failed_reason else js.failed_message
        if last and last.message and last.message not in message:
            message = f"{message}; {last.message}"
        return Phase.FAILED, reason, message
    if js.suspended:
        if obs.suspend:
            return Phase.SUSPENDED, c.REASON_SUSPENDED_BY_USER, "spec.suspend is true"
        if obs.queue_name:
            return (
                Phase.SUSPENDED,
                c.REASON_QUEUED,
                f"waiting for Kueue to admit it from queue {obs.queue_name}",
            )
        return Phase.SUSPENDED, c.REASON_SUSPENDED_BY_USER, "the JobSet is suspended"
    all_ready = all(r.total > 0 and r.ready >= r.total for r in (roles.trainer, roles.sampler))
    if all_ready:
        return Phase.RUNNING, c.REASON_ALL_ROLES_READY, "every trainer and sampler pod is ready"
    sampler_restarts = sum(js.job_restarts.get(c.ROLE_SAMPLER, ()))
    if js.restarts > 0 or sampler_restarts > 0:
        reason = _FAILURE_REASON.get(last.failure_class, c.REASON_CRASHED) if last else c.REASON_CRASHED
        what = (
            f"sampler restart {sampler_restarts}, the trainer kept running"
            if roles.trainer.total > 0 and roles.trainer.ready >= roles.trainer.total
            else f"attempt {js.restarts + 1}"
        )
        return (
            Phase.RESTARTING,
            reason,
            f"{what}: waiting for pods ({last.message if last else ''})",
        )
    if obs.pod_create_error is not None:
        return Phase.PENDING, c.REASON_POD_CREATE_FAILED, obs.pod_create_error
    return (
        Phase.PENDING,
        c.REASON_WAITING_FOR_PODS,
        f"trainer {roles.trainer.ready}/{roles.trainer.total}, "
        f"sampler {roles.sampler.ready}/{roles.sampler.total} ready",
    )


# Reasons the Ready condition shows itself while the run waits (the others show WaitingForPods).
_CREATE_REASONS = frozenset(
    {c.REASON_CREATE_FAILED, c.REASON_POD_CREATE_FAILED, c.REASON_NOT_OWNED, *_PREFLIGHT_REASONS.values()}
)


def _conditions(
    phase: Phase, reason: str, message: str, no_longer_plans: str | None = None
) -> list[tuple[str, bool, str, str]]:
    """(type, status, reason, message) for every condition type, in CONDITION_TYPES order."""
    invalid = phase == Phase.FAILED and reason == c.REASON_INVALID_SPEC

    def row(
        ctype: str, active: bool, inactive_reason: str, inactive_message: str = ""
    ) -> tuple[str, bool, str, str]:
        return (ctype, active, reason if active else inactive_reason, message if active else inactive_message)

    waiting = phase in (Phase.PENDING, Phase.RESTARTING)
    accepted = (
        (c.ACCEPTED, False, c.REASON_SPEC_NO_LONGER_PLANS, no_longer_plans)
        if no_longer_plans is not None
        else (
            c.ACCEPTED,
            not invalid,
            reason if invalid else c.REASON_ACCEPTED,
            message if invalid else "spec is valid",
        )
    )
    return [
        accepted,
        row(
            c.READY,
            phase == Phase.RUNNING,
            reason
            if reason in _CREATE_REASONS
            else c.REASON_WAITING_FOR_PODS
            if waiting
            else c.REASON_NOT_RUNNING,
            message if phase == Phase.PENDING else f"phase {phase.value}",
        ),
        row(c.SUSPENDED, phase == Phase.SUSPENDED, c.REASON_NOT_SUSPENDED),
        row(c.RESTARTING, phase == Phase.RESTARTING, c.REASON_NOT_RESTARTING),
        row(c.SUCCEEDED, phase == Phase.SUCCEEDED, c.REASON_NOT_FINISHED),
        row(c.FAILED, phase == Phase.FAILED, c.REASON_NOT_FINISHED),
    ]


def merge_conditions(
    prior: Sequence[Condition], rows: Sequence[tuple[str, bool, str, str]], generation: int, now: datetime
) -> list[Condition]:
    """Conditions with lastTransitionTime kept from `prior` where the status did not change."""
    old = {x.type: x for x in prior}
    out: list[Condition] = []
    for ctype, ok, reason, message in rows:
        status = "True" if ok else "False"
        before = old.get(ctype)
        since = before.last_transition_time if before is not None and before.status == status else None
        out.append(
            Condition(
                type=ctype,
                status=status,
                reason=reason,
                message=message[:1024],
                last_transition_time=since or now,
                observed_generation=generation,
            )
        )
    return out


_PHASE_EVENT = {
    Phase.SUSPENDED: ("Normal", c.EVENT_SUSPENDED),
    Phase.RESTARTING: ("Warning", c.EVENT_RESTARTING),
    Phase.SUCCEEDED: ("Normal", c.EVENT_SUCCEEDED),
    Phase.FAILED: ("Warning", c.EVENT_FAILED),
}


def derive_status(obs: Observed) -> Derived:
    """The complete new status and the events that announce its transitions."""
    prior = obs.prior
    roles = _roles(obs)
    progress = obs.progress or (prior.progress if prior else None)
    if prior is not None and prior.phase in TERMINAL:
        # Latched: only the observational parts (roles going to zero, a last progress report) move.
        status = prior.model_copy(
            update={"roles": roles, "progress": progress, "observed_generation": obs.generation}
        )
        return Derived(status=status, events=())
    no_longer_plans = None
    if obs.spec_error is not None and obs.jobset is not None:
        # The spec was admitted and its JobSet runs, but this operator cannot plan it (an upgrade): follow
        # the JobSet to its end rather than fail a running job or leave it untracked.
        no_longer_plans = (
            f"this operator cannot plan the spec any more; JobSet {obs.jobset.name} is tracked to its end "
            f"and never recreated: {obs.spec_error}"
        )
        obs = dataclasses.replace(obs, spec_error=None)
    used = restarts_used(obs)
    last = _last_failure(obs, used)
    sampler_failure = obs.jobset.sampler_failure if obs.jobset is not None else obs.sampler_failure
    if obs.spec_error is not None:
        last = LastFailure(
            failure_class=FailureClass.BAD_CONFIGURATION,
            reason=c.REASON_INVALID_SPEC,
            message=obs.spec_error,
            time=obs.now,
        )
    phase, reason, message = _phase_and_reasons(obs, roles, last, used)
    rows = _conditions(phase, reason, message, no_longer_plans)
    conds = merge_conditions(prior.conditions if prior else [], rows, obs.generation, obs.now)
    status = RLJobStatus(
        phase=phase,
        conditions=conds,
        observed_generation=obs.generation,
        job_set_name=(obs.jobset.name if obs.jobset else None) or (prior.job_set_name if prior else None),
        restarts=Restarts(
            used=used.trainer,
            left=max(0, obs.max_restarts - used.trainer),
            trainer=RoleRestarts(used=used.trainer, left=max(0, obs.max_restarts - used.trainer)),
            # Under RestartRun a sampler crash is a restart of the run: the samplers have no budget.
            sampler=RoleRestarts(used=used.sampler, left=max(0, obs.max_sampler_restarts - used.sampler))
            if sampler_failure is not SamplerFailure.RESTART_RUN
            else None,
        ),
        last_failure=last,
        roles=roles,
        progress=progress,
        url=obs.api_url or (prior.url if prior else None),
        preflight=obs.preflight or (prior.preflight if prior else None),
        sampler_failure=sampler_failure or (prior.sampler_failure if prior else None),
    )
    events: list[Event] = []
    prior_phase = prior.phase if prior else None
    if phase != prior_phase:
        if phase in _PHASE_EVENT:
            etype, ereason = _PHASE_EVENT[phase]
            events.append(Event(etype, ereason, f"{reason}: {message}"[:1024]))
        elif phase == Phase.RUNNING and prior_phase == Phase.SUSPENDED:
            events.append(Event("Normal", c.EVENT_RESUMED, message))
    # Warnings for what the phase does not show, once per new message (not on every retry).
    before = {x.type: x for x in prior.conditions} if prior else {}
    for ctype, ok, why, text in rows:
        old = before.get(ctype)
        new = old is None or (old.reason, old.message) != (why, text[:1024])
        if not ok and why in _WARN_REASONS and new:
            events.append(Event("Warning", why, text[:1024]))
    return Derived(status=status, events=events)


_WARN_REASONS = frozenset(
    {
        c.REASON_CREATE_FAILED,
        c.REASON_POD_CREATE_FAILED,
        c.REASON_NOT_OWNED,
        c.REASON_SPEC_NO_LONGER_PLANS,
        c.REASON_COMPILE_DOES_NOT_FIT,
        c.REASON_PREFLIGHT_FAILED,
    }
)


def status_body(status: RLJobStatus) -> dict[str, Any]:
    """The status as the JSON the API stores (camelCase, no nulls)."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True)
