"""spec.suspend of an RLJob whose JobSet Kueue manages (it carries kueue.x-k8s.io/queue-name).

Kueue owns such a JobSet's `spec.suspend`: its webhook suspends the JobSet at creation, it unsuspends it
when the Workload is admitted, and it suspends it again on eviction. It also undoes anyone else's write:
a JobSet suspended while its Workload is admitted is unsuspended at once (jobframework reconciler, "Job
admitted, unsuspending"), and one unsuspended without admission is suspended again. So the operator
never writes `spec.suspend` of a queued JobSet; the user's `spec.suspend` goes to the Workload's
`spec.active`, which is how Kueue stops a job and keeps it stopped (evicted, reason Deactivated), and
hands it back to the queue on resume.

Fallbacks, where no Kueue Workload will answer for the JobSet: no Workload API on the cluster (Kueue not
installed) or no Workload for the JobSet, then the operator writes the JobSet's `spec.suspend` itself.
A run created with `suspend: true` and a queue can start for a moment: Kueue makes and may admit the
Workload before the operator sees it to deactivate it.

Each call is one LIST of Workloads by the JobSet's uid (label kueue.x-k8s.io/job-uid), across
namespaces, plus a merge patch per Workload that differs; the reconcile calls it only on a change.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Final

from rljob.operator import k8s
from rljob.operator.status.views import JobSetView

WORKLOAD: Final = k8s.Kind("kueue.x-k8s.io", "v1beta2", "workloads")
JOB_UID_LABEL: Final = "kueue.x-k8s.io/job-uid"


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    jobset_suspend: bool | None  # write this JobSet spec.suspend (a fallback), or None: leave it to Kueue
    deactivated: bool  # the JobSet's Workload is known to be inactive now


async def set_active(kube: k8s.Kube, js: JobSetView, active: bool) -> int | None:
    """Set spec.active on the Workloads of the JobSet; how many there are, None without the Workload API."""
    try:
        workloads = await kube.list(
            WORKLOAD, namespace=js.namespace or None, label_selector=f"{JOB_UID_LABEL}={js.uid}"
        )
    except k8s.ApiError as exc:
        if exc.status == 404:
            return None
        raise
    for wl in workloads:
        if bool((wl.get("spec") or {}).get("active", True)) != active:
            meta = wl["metadata"]
            await kube.merge_patch(WORKLOAD, meta["namespace"], meta["name"], {"spec": {"active": active}})
    return len(workloads)


async def reconcile_suspend(
    kube: k8s.Kube, js: JobSetView, *, want: bool, by_user: bool, deactivated: bool
) -> Outcome:
    """Bring the queued JobSet to the user's spec.suspend (`want`) through Kueue.

    `by_user`: the RLJob's status says the user suspended it (so a resume must reactivate);
    `deactivated`: this operator already deactivated the Workload of this JobSet (nothing to do)."""
    if want:
        if deactivated:
            return Outcome(None, True)
        found = await set_active(kube, js, False)
        if found:
            return Outcome(None, True)
        return Outcome(True if not js.suspended else None, False)
    if not (deactivated or by_user):
        return Outcome(None, False)  # the common case: Kueue's own suspension, not ours to touch
    found = await set_active(kube, js, True)
    if not found and js.suspended:
        return Outcome(False, False)
    return Outcome(None, False)


def outcome_patch(outcome: Outcome) -> dict[str, Any]:
    return {} if outcome.jobset_suspend is None else {"spec": {"suspend": outcome.jobset_suspend}}
