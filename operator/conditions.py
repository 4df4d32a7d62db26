"""Condition types, reasons, labels and annotation keys of the RLJob operator, as named constants.

Every string the operator writes into `status.conditions`, `status.lastFailure` or an Event is one of
these constants, so tests and users can match on them (the JobSet controller's pkg/constants has the
same habit). Reasons are CamelCase; each is used by the condition named in its comment.
"""

from __future__ import annotations

from typing import Final

from rljob.recipes import naming, runconfig

# ------------------------------------------------------------------------------ who we are on the API
FIELD_MANAGER: Final = "rljob-operator"
"""Field manager of every write (server-side apply and patches): `kubectl get -o yaml --show-managed-fields`
shows exactly which fields the operator owns."""

EVENT_COMPONENT: Final = "rljob-operator"

# ----------------------------------------------------------------------------- labels and annotations
LABEL_NAME: Final = naming.RUN_LABEL
"""On every child object and pod template (rljob.recipes.render.labels; the operator adds it to what it
creates itself): the owning RLJob's name.
The operator's watches select children by this label (server-side), so it never lists foreign objects."""

LABEL_PROGRESS: Final = "rljob.dev/progress"
"""On the `<rljob>-progress` ConfigMap only (value "true"): the operator watches these for progress."""

ANNOTATION_PREFIX: Final = "rljob.dev"
"""Prefix of kopf's own bookkeeping annotations (progress/diffbase storages), never kopf.zalando.org."""

FINALIZER: Final = "rljob.dev/finalizer"
"""kopf's finalizer name. The operator has no deletion handlers, so kopf never adds it: children are
garbage-collected through owner references."""

QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
"""Kueue's LocalQueue label on the JobSet (from spec.queueName)."""

JOBSET_NAME_LABEL: Final = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID_LABEL: Final = "jobset.sigs.k8s.io/jobset-uid"
"""Set by the JobSet controller on its Jobs and pods: a pod's failure counts only for its own JobSet."""
REPLICATED_JOB_LABEL: Final = "jobset.sigs.k8s.io/replicatedjob-name"
RESTART_ATTEMPT_LABEL: Final = "jobset.sigs.k8s.io/restart-attempt"
# JobSet >= v0.12.0: a Job restarted alone (failure action RestartJob*) has this label one higher than
# before; its index within its replicatedJob is job-index.
JOB_RESTART_ATTEMPT_LABEL: Final = "jobset.sigs.k8s.io/job-restart-attempt"
JOB_INDEX_LABEL: Final = "jobset.sigs.k8s.io/job-index"

PREFLIGHT_LABEL: Final = naming.PREFLIGHT_LABEL
"""On the compile preflight's Job and pod (value "true", rljob.recipes.naming.PREFLIGHT_LABEL): the operator
watches these Jobs, and reads a failed preflight pod's termination message instead of counting a failure."""
JOB_NAME_LABEL: Final = "batch.kubernetes.io/job-name"
"""Set by the Job controller on a Job's pods."""

PROGRESS_KEY: Final = runconfig.PROGRESS_KEY
"""Key of the trainer's report in the `<rljob>-progress` ConfigMap (contract 4)."""

# ----------------------------------------------------------------------------------- condition types
ACCEPTED: Final = "Accepted"
"""True once the spec parsed and planned; False (reason InvalidSpec) names the offending field."""
READY: Final = "Ready"
"""True while the phase is Running: every trainer and sampler pod is ready."""
SUSPENDED: Final = "Suspended"
"""True while the JobSet is suspended (by spec.suspend or by Kueue waiting for quota)."""
RESTARTING: Final = "Restarting"
"""True while the JobSet is being recreated after a failure; the reason is the failure's class."""
SUCCEEDED: Final = "Succeeded"
"""True once the trainer finished (terminal, latched)."""
FAILED: Final = "Failed"
"""True once the run failed for good (terminal, latched)."""

CONDITION_TYPES: Final = (ACCEPTED, READY, SUSPENDED, RESTARTING, SUCCEEDED, FAILED)

# ---------------------------------------------------------------------------------------- reasons
# Accepted
REASON_ACCEPTED: Final = "Rendered"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_SPEC_NO_LONGER_PLANS: Final = "SpecNoLongerPlans"
"""Accepted=False while a running JobSet is tracked although this operator version cannot plan the spec
(an upgrade refuses what an older version admitted): the run is followed to its end, never recreated."""
# Ready
REASON_ALL_ROLES_READY: Final = "AllRolesReady"
REASON_WAITING_FOR_PODS: Final = "WaitingForPods"
REASON_NOT_RUNNING: Final = "NotRunning"
REASON_CREATE_FAILED: Final = "CreateFailed"
"""Ready=False while a child object (ServiceAccount, Role, RoleBinding, ConfigMap, JobSet) cannot be created:
the API answered an error (a 422, an RBAC denial, the JobSet CRD missing); retried with backoff."""
REASON_POD_CREATE_FAILED: Final = "PodCreateFailed"
"""Ready=False while a Job of the run cannot create its pods: the Job controller's FailedCreate event (Pod
Security admission, a ResourceQuota or LimitRange, an admission webhook refusing the pod), with the API
server's message; it clears when the pods exist and are ready."""
REASON_PREFLIGHT_RUNNING: Final = "PreflightCompiling"
"""Ready=False while the compile preflight's Job (spec.trainer.preflight.compile) runs; no JobSet exists
yet."""
REASON_COMPILE_DOES_NOT_FIT: Final = "CompileDoesNotFit"
"""Ready=False when the compile preflight refused the run (exit 2): one line per program that does not fit
its TPU's HBM, naming the fields; the JobSet is never created (no TPU is requested)."""
REASON_PREFLIGHT_FAILED: Final = "PreflightFailed"
"""Ready=False when the compile preflight failed otherwise (exit 1: an rljob bug, storage unreadable at
start; the pod evicted): its message; the JobSet is never created for this preflight Job."""
REASON_NOT_OWNED: Final = "ChildNotOwned"
"""Ready=False while an object with a child's name exists that this RLJob does not own (its controller owner
reference names another uid): it is never adopted, overwritten or counted; retried with backoff."""
# Suspended
REASON_SUSPENDED_BY_USER: Final = "SuspendedByUser"
REASON_QUEUED: Final = "WaitingForQueue"
REASON_NOT_SUSPENDED: Final = "NotSuspended"
# Restarting (and lastFailure.reason)
REASON_PREEMPTED: Final = "Preempted"
REASON_MAINTENANCE: Final = "Maintenance"
REASON_CRASHED: Final = "Crashed"
REASON_BAD_CONFIGURATION: Final = "BadConfiguration"
REASON_NOT_RESTARTING: Final = "NotRestarting"
# Succeeded
REASON_TRAINER_COMPLETED: Final = "TrainerCompleted"
# Failed
REASON_RESTARTS_EXHAUSTED: Final = "RestartsExhausted"
REASON_JOBSET_FAILED: Final = "JobSetFailed"
REASON_NOT_FINISHED: Final = "NotFinished"
# The JobSet disappeared before its outcome was observed.
REASON_JOBSET_DELETED: Final = "JobSetDeleted"

# Events (posted after the status write)
EVENT_JOBSET_CREATED: Final = "JobSetCreated"
EVENT_SUSPENDED: Final = "Suspended"
EVENT_RESUMED: Final = "Resumed"
EVENT_RESTARTING: Final = "Restarting"
EVENT_SUCCEEDED: Final = "Succeeded"
EVENT_FAILED: Final = "Failed"
EVENT_INVALID_SPEC: Final = "InvalidSpec"
EVENT_PREFLIGHT_CREATED: Final = "PreflightCreated"
# Also events: REASON_CREATE_FAILED, REASON_POD_CREATE_FAILED, REASON_NOT_OWNED,
# REASON_SPEC_NO_LONGER_PLANS, REASON_COMPILE_DOES_NOT_FIT, REASON_PREFLIGHT_FAILED (Warning).

# ------------------------------------------------------------------------------- JobSet vocabulary
JS_COMPLETED: Final = "Completed"
JS_FAILED: Final = "Failed"
JS_SUSPENDED: Final = "Suspended"
JS_REASON_FAIL_ACTION: Final = "FailJobSetFailurePolicyAction"
JS_REASON_MAX_RESTARTS: Final = "ReachedMaxRestarts"

# Pod DisruptionTarget reasons (k8s.io/api/core/v1) and the failure class each means for a TPU job.
# A spot/preemptible TPU VM that goes away shows up as the node deleted (PodGC) or as a graceful node
# shutdown (kubelet); eviction through the API and NoExecute taints are how maintenance drains a pool.
DISRUPTION_PREEMPTION: Final = frozenset({"DeletionByPodGC", "PreemptionByScheduler", "TerminationByKubelet"})
DISRUPTION_MAINTENANCE: Final = frozenset({"EvictionByEvictionAPI", "DeletionByTaintManager"})

# Roles: the replicatedJob names the renderer writes.
ROLE_TRAINER: Final = naming.TRAINER
ROLE_SAMPLER: Final = naming.SAMPLER
