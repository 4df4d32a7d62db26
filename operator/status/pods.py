"""Pod classification: what a failed pod says about why its run's attempt ended (`classify_pod`), and
what the Job controller's FailedCreate events say of pods the API server refused (`pod_create_error`).
Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from rljob.operator import conditions as c
from rljob.operator.status.views import JobSetView, label_int, parse_time
from rljob.recipes import failure as failure_rules
from rljob.recipes.api import FailureClass


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
    attempt = label_int(labels, c.RESTART_ATTEMPT_LABEL)
    job = (label_int(labels, c.JOB_RESTART_ATTEMPT_LABEL), label_int(labels, c.JOB_INDEX_LABEL))
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
