"""What the status depends on (`Observed`), gathered by the reconcile service (rljob.operator.reconcile).
Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime

from rljob.operator.status.pods import PodFailure
from rljob.operator.status.views import JobSetView
from rljob.recipes.api import PreflightStatus, ProgressReport, RLJobStatus
from rljob.recipes.failure import SamplerFailure


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
