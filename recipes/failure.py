"""Failure handling: the exit-code contract of every entrypoint and the JobSet rules that enforce it.

Contract 3:
- exit 0 (`EXIT_OK`): done;
- exit 2 (`EXIT_BAD_CONFIG`): bad configuration, the JobSet fails at once, no restart;
- any other non-zero exit: a restart counted against spec.failurePolicy.maxRestarts;
- preemption / maintenance (pod condition DisruptionTarget, e.g. node deleted or pod evicted): a
  restart NOT counted.
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_BAD_CONFIG = 2

# What an entrypoint prints (one line, then exit 1: a counted restart, since a pod's metadata server can
# answer late) when google-auth finds no credentials for spec.storage.root.
NO_CREDENTIALS = (
    "spec.storage.root: no Google Cloud credentials in this pod: give the job a Kubernetes ServiceAccount "
    "bound to a Google service account with access to the bucket (spec.serviceAccountName, Workload "
    "Identity: https://cloud.google.com/kubernetes-engine/docs/how-to/workload-identity)"
)

# How the contract is enforced (JobSet v0.11.0 API, batch/v1 podFailurePolicy):
# - every Job runs with backoffLimit 0, restartPolicy Never and this podFailurePolicy:
#     rule 0: FailJob on pod condition DisruptionTarget=True   (preemption, eviction, maintenance)
#     rule 1: FailJob on exit code 2 in any container          (bad configuration)
#   Kubernetes then fails the Job with reason PodFailurePolicy and a message ending in
#   "matching FailJob rule at index N";
# - the JobSet's failurePolicy rules map those messages to actions:
#     index 0 -> RestartJobSetAndIgnoreMaxRestarts (a free restart)
#     index 1 -> FailJobSet (no restart)
#   any other failure (another exit code: backoffLimit exceeded) matches no rule, and JobSet's
#   default action RestartJobSet applies: a restart counted against maxRestarts;
# - restartStrategy BlockingRecreate: every old TPU pod is gone before new ones are created.

JOB_FAILURE_REASON = "PodFailurePolicy"
POD_RULE_DISRUPTION = 0
POD_RULE_BAD_CONFIG = 1
RULE_DISRUPTION = "disruptionFreeRestart"
RULE_BAD_CONFIG = "badConfigurationFail"
RESTART_STRATEGY = "BlockingRecreate"


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


def jobset_failure_policy(max_restarts: int) -> dict[str, Any]:
    """The JobSet failurePolicy implementing contract 3."""
    return {
        "maxRestarts": max_restarts,
        "restartStrategy": RESTART_STRATEGY,
        "rules": [
            {
                "name": RULE_DISRUPTION,
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": [JOB_FAILURE_REASON],
                "onJobFailureMessagePatterns": [message_pattern(POD_RULE_DISRUPTION)],
            },
            {
                "name": RULE_BAD_CONFIG,
                "action": "FailJobSet",
                "onJobFailureReasons": [JOB_FAILURE_REASON],
                "onJobFailureMessagePatterns": [message_pattern(POD_RULE_BAD_CONFIG)],
            },
        ],
    }
