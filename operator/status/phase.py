"""Phase and conditions: the complete new status of an RLJob and the events that announce its transitions
(`derive_status`), from what was observed (rljob.operator.status.observed). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from rljob.operator import conditions as c
from rljob.operator.status.observed import Observed
from rljob.operator.status.preflight import PREFLIGHT_REASONS
from rljob.operator.status.restarts import Used, exhausted_message, last_failure, restarts_used
from rljob.recipes.api import (
    Condition,
    FailureClass,
    LastFailure,
    Phase,
    PreflightState,
    Restarts,
    RLJobStatus,
    RoleRestarts,
    RolesStatus,
    RoleStatus,
)
from rljob.recipes.failure import SamplerFailure

TERMINAL = frozenset({Phase.SUCCEEDED, Phase.FAILED})


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class Derived:
    status: RLJobStatus
    events: Sequence[Event]


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
                c.REASON_JOBSET_DELETED,
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
            return Phase.PENDING, PREFLIGHT_REASONS[pf.state], message
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
    {c.REASON_CREATE_FAILED, c.REASON_POD_CREATE_FAILED, c.REASON_NOT_OWNED, *PREFLIGHT_REASONS.values()}
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
    last = last_failure(obs, used)
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
