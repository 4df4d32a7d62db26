"""Failure handling: the exit-code contract of every entrypoint and the JobSet rules that enforce it.

Contract 3:
- exit 0 (`EXIT_OK`): done;
- exit 2 (`EXIT_BAD_CONFIG`): bad configuration, the JobSet fails at once, no restart;
- any other non-zero exit: a restart, counted. Of the trainer: the whole run restarts from its last
  checkpoint, counted against spec.failurePolicy.maxRestarts. Of a sampler (a crash, an OOM, a lost
  Ray worker of a multi-host replica): that sampler Job restarts alone, counted against
  spec.failurePolicy.maxSamplerRestarts, while the trainer keeps running and waits for it;
- preemption / maintenance (pod condition DisruptionTarget, e.g. node deleted or pod evicted): the
  same restart (the run's for the trainer, the Job's for a sampler), NOT counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rljob.recipes.naming import SAMPLER, TRAINER

EXIT_OK = 0
EXIT_BAD_CONFIG = 2

# What an entrypoint prints (one line, then exit 1: a counted restart, since a pod's metadata server can
# answer late) when google-auth finds no credentials for spec.storage.root.
NO_CREDENTIALS = (
    "spec.storage.root: no Google Cloud credentials in this pod: give the job a Kubernetes ServiceAccount "
    "bound to a Google service account with access to the bucket (spec.serviceAccountName, Workload "
    "Identity: https://cloud.google.com/kubernetes-engine/docs/how-to/workload-identity)"
)

# How the contract is enforced (JobSet v0.12.0 API, batch/v1 podFailurePolicy):
# - every Job runs with backoffLimit 0, restartPolicy Never and this podFailurePolicy:
#     rule 0: FailJob on pod condition DisruptionTarget=True   (preemption, eviction, maintenance)
#     rule 1: FailJob on exit code 2 in any container          (bad configuration)
#   Kubernetes then fails the Job with reason PodFailurePolicy and a message ending in
#   "matching FailJob rule at index N";
# - the JobSet's failurePolicy rules map those messages to actions, per role (first match wins):
#     trainer, index 0 -> RestartJobSetAndIgnoreMaxRestarts  (a free restart of the run)
#     sampler, index 0 -> RestartJobAndIgnoreMaxRestarts     (a free restart of that sampler Job alone)
#     any,     index 1 -> FailJobSet                         (no restart)
#     sampler, else    -> RestartJob                         (that sampler Job alone, counted)
#   a trainer failure that matches no rule (another exit code: backoffLimit exceeded) gets JobSet's
#   default action RestartJobSet: the whole run restarts from its last checkpoint, counted;
# - JobSet has one budget for both counted actions (spec.failurePolicy.maxRestarts of the JobSet bounds
#   restartsCountTowardsMax + sum(replicatedJobsStatus[].jobRestartsCountTowardsMax)), so the render sets
#   it to the sum of the two RLJob budgets and the operator holds each role to its own
#   (rljob.operator.status.restarts_exhausted): a role past its budget fails the run;
# - RestartJob and RestartJobAndIgnoreMaxRestarts are behind JobSet's alpha feature gate RestartJob
#   (off by default in v0.12.0; docs/gke.md turns it on, `rljob doctor` checks it);
# - restartStrategy BlockingRecreate: on a restart of the run, every old TPU pod is gone before new ones
#   are created (a restarted sampler Job is recreated on its own, the trainer untouched).

JOB_FAILURE_REASON = "PodFailurePolicy"
POD_RULE_DISRUPTION = 0
POD_RULE_BAD_CONFIG = 1
RULE_DISRUPTION = "disruptionFreeRestart"
RULE_SAMPLER_DISRUPTION = "samplerDisruptionFreeRestart"
RULE_BAD_CONFIG = "badConfigurationFail"
RULE_SAMPLER_CRASH = "samplerRestart"
RESTART_STRATEGY = "BlockingRecreate"
# The two budgets on the JobSet, for the operator (JobSet itself has only their sum).
ANNOTATION_MAX_RESTARTS = "rljob.dev/max-restarts"
ANNOTATION_MAX_SAMPLER_RESTARTS = "rljob.dev/max-sampler-restarts"


def message_pattern(pod_rule_index: int) -> str:
    """RE2 pattern matching the Job failure message Kubernetes writes for a podFailurePolicy rule."""
    return f"matching FailJob rule at index {pod_rule_index}$"


def pod_failure_policy() -> dict[str, Any]:
    """The podFailurePolicy of every Job (trainer and sampler)."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
            {
                "action": "FailJob",
                "onExitCodes": {"operator": "In", "values": [EXIT_BAD_CONFIG]},
            },
        ]
    }


def budget_annotations(max_restarts: int, max_sampler_restarts: int) -> dict[str, str]:
    """The JobSet's annotations naming each role's budget (read back by rljob.operator.status.JobSetView)."""
    return {
        ANNOTATION_MAX_RESTARTS: str(max_restarts),
        ANNOTATION_MAX_SAMPLER_RESTARTS: str(max_sampler_restarts),
    }


def budgets_of(js: Mapping[str, Any]) -> tuple[int, int]:
    """(maxRestarts, maxSamplerRestarts) of a rendered JobSet: its annotations (budget_annotations);
    a JobSet rendered before sampler budgets existed has only its failurePolicy.maxRestarts, all the run's."""
    notes = (js.get("metadata") or {}).get("annotations") or {}
    total = int(((js.get("spec") or {}).get("failurePolicy") or {}).get("maxRestarts", 0) or 0)
    try:
        return int(notes[ANNOTATION_MAX_RESTARTS]), int(notes[ANNOTATION_MAX_SAMPLER_RESTARTS])
    except (KeyError, TypeError, ValueError):
        return total, 0


def jobset_max_restarts(max_restarts: int, max_sampler_restarts: int) -> int:
    """JobSet's one budget for counted restarts: the run's and the samplers' together (see above)."""
    return max_restarts + max_sampler_restarts


def jobset_failure_policy(max_restarts: int, max_sampler_restarts: int) -> dict[str, Any]:
    """The JobSet failurePolicy implementing contract 3 with role-scoped restarts."""
    return {
        "maxRestarts": jobset_max_restarts(max_restarts, max_sampler_restarts),
        "restartStrategy": RESTART_STRATEGY,
        "rules": [
            {
                "name": RULE_DISRUPTION,
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": [JOB_FAILURE_REASON],
                "onJobFailureMessagePatterns": [message_pattern(POD_RULE_DISRUPTION)],
                "targetReplicatedJobs": [TRAINER],
            },
            {
                "name": RULE_SAMPLER_DISRUPTION,
                "action": "RestartJobAndIgnoreMaxRestarts",
                "onJobFailureReasons": [JOB_FAILURE_REASON],
                "onJobFailureMessagePatterns": [message_pattern(POD_RULE_DISRUPTION)],
                "targetReplicatedJobs": [SAMPLER],
            },
            {
                "name": RULE_BAD_CONFIG,
                "action": "FailJobSet",
                "onJobFailureReasons": [JOB_FAILURE_REASON],
                "onJobFailureMessagePatterns": [message_pattern(POD_RULE_BAD_CONFIG)],
            },
            {
                "name": RULE_SAMPLER_CRASH,
                "action": "RestartJob",
                "targetReplicatedJobs": [SAMPLER],
            },
        ],
    }
