"""Views of the API bodies the status reads: the few fields of a JobSet (`JobSetView`), and what every body
view shares (timestamps, the controller owner reference). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from rljob.operator import conditions as c
from rljob.recipes import failure as failure_rules
from rljob.recipes.api import RoleStatus
from rljob.recipes.failure import SamplerFailure


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


def label_int(labels: Mapping[str, Any], key: str) -> int:
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
