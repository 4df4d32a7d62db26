"""Restart budgets and the last failure: counted restarts per role against spec.failurePolicy's budgets
(`restarts_used`), the JobSet to stop when a role is past its budget (`stop_jobset`), and which failure
status.lastFailure names (`last_failure`). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses

from rljob.operator import conditions as c
from rljob.operator.status.observed import Observed
from rljob.operator.status.pods import PodFailure
from rljob.operator.status.views import JobSetView
from rljob.recipes.api import FailureClass, LastFailure, Phase, RLJobStatus


def stop_jobset(status: RLJobStatus, jobset: JobSetView | None) -> bool:
    """Whether the reconcile must suspend the JobSet: the run is Failed (a role past its restart budget)
    while its JobSet still runs. JobSet has one budget for both roles (rljob.recipes.failure), so it would
    otherwise restart what the RLJob's budgets refuse."""
    return (
        status.phase == Phase.FAILED
        and jobset is not None
        and not (jobset.failed or jobset.completed or jobset.suspended)
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


def last_failure(obs: Observed, used: Used) -> LastFailure | None:
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
