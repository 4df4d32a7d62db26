"""Failure handling: the exit-code contract of every entrypoint and the JobSet rules that enforce it.

Contract 3:
- exit 0 (`EXIT_OK`): done;
- exit 2 (`EXIT_BAD_CONFIG`): bad configuration, the JobSet fails at once, no restart;
- any other non-zero exit: a restart, counted. Of the trainer: the whole run restarts from its last
  checkpoint, counted against spec.failurePolicy.maxRestarts. Of a sampler (a crash, an OOM, a lost
  Ray worker of a multi-host replica): that sampler Job restarts alone, counted against
  spec.failurePolicy.maxSamplerRestarts, while the trainer keeps running and waits for it
  (`SamplerFailure.RESTART_SAMPLER_JOB`, which needs JobSet's feature gate RestartJob); where the
  cluster's JobSet refuses that action, the whole run restarts from its last checkpoint instead,
  counted against spec.failurePolicy.maxRestarts (`SamplerFailure.RESTART_RUN`);
- preemption / maintenance (pod condition DisruptionTarget, e.g. node deleted or pod evicted): the
  same restart (the run's for the trainer, the Job's for a sampler, or the run's under RESTART_RUN),
  NOT counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from rljob.recipes.naming import JOBSET_GROUP, JOBSET_VERSION, SAMPLER, TRAINER


class SamplerFailure(StrEnum):
    """What a sampler crash restarts (rljob.recipes.failure): chosen by the plan from whether the cluster's
    JobSet admits the failure action RestartJob (its feature gate RestartJob)."""

    RESTART_SAMPLER_JOB = "RestartSamplerJob"  # that sampler Job alone, against maxSamplerRestarts
    RESTART_RUN = "RestartRun"  # the whole run from its last checkpoint, against maxRestarts


EXIT_OK = 0
EXIT_RESTART = 1  # what an entrypoint exits with where a later start may succeed: a counted restart
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
#   (rljob.operator.status.restarts.restarts_used): a role past its budget fails the run;
# - RestartJob and RestartJobAndIgnoreMaxRestarts are behind JobSet's alpha feature gate RestartJob
#   (off by default in v0.12.0; docs/gke.md turns it on, `rljob doctor` checks it). Without it (the
#   plan's input `restart_job` False: SamplerFailure.RESTART_RUN) the sampler rules are left out: a
#   sampler's disruption matches the run's free restart (the disruption rule has no target), and a
#   sampler crash gets JobSet's default RestartJobSet like a trainer crash, counted against the run's
#   budget alone (the JobSet's maxRestarts is spec.failurePolicy.maxRestarts; maxSamplerRestarts unused);
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
# What a sampler crash restarts in this JobSet (a SamplerFailure), for the operator's status.
ANNOTATION_SAMPLER_FAILURE = "rljob.dev/sampler-failure"

# JobSet's feature gate that admits the failure actions RestartJob and RestartJobAndIgnoreMaxRestarts, and
# what its webhook's refusal says while the gate is off (JobSet v0.12.0).
RESTART_JOB_GATE = "RestartJob"
RESTART_JOB_GATE_REFUSAL = "RestartJob feature gate"


def explain(mode: SamplerFailure) -> str:
    """One line saying what a sampler crash restarts under `mode`, for `rljob plan` and the status."""
    if mode is SamplerFailure.RESTART_SAMPLER_JOB:
        return (
            "a sampler crash restarts that sampler Job alone, counted against "
            "spec.failurePolicy.maxSamplerRestarts, while the trainer keeps running; needs JobSet's feature "
            f"gate {RESTART_JOB_GATE}"
        )
    return (
        "a sampler crash restarts the whole run from its last checkpoint, counted against "
        "spec.failurePolicy.maxRestarts, maxSamplerRestarts unused; the cluster's JobSet refuses the failure "
        f"action RestartJob, feature gate {RESTART_JOB_GATE} off"
    )


def sampler_failure(restart_job: bool) -> SamplerFailure:
    """The plan's choice for a cluster whose JobSet admits the failure action RestartJob, or not."""
    return SamplerFailure.RESTART_SAMPLER_JOB if restart_job else SamplerFailure.RESTART_RUN


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


def budget_annotations(
    max_restarts: int, max_sampler_restarts: int, mode: SamplerFailure = SamplerFailure.RESTART_SAMPLER_JOB
) -> dict[str, str]:
    """The JobSet's annotations naming each role's budget and what a sampler crash restarts (read back by
    rljob.operator.status.views.JobSetView); under RESTART_RUN the samplers have no budget of their own."""
    return {
        ANNOTATION_MAX_RESTARTS: str(max_restarts),
        ANNOTATION_MAX_SAMPLER_RESTARTS: str(
            max_sampler_restarts if mode is SamplerFailure.RESTART_SAMPLER_JOB else 0
        ),
        ANNOTATION_SAMPLER_FAILURE: mode.value,
    }


def sampler_failure_of(js: Mapping[str, Any]) -> SamplerFailure:
    """What a sampler crash restarts in a rendered JobSet (its annotation; one rendered before the
    annotation existed restarts the sampler Job alone)."""
    notes = (js.get("metadata") or {}).get("annotations") or {}
    try:
        return SamplerFailure(notes.get(ANNOTATION_SAMPLER_FAILURE, SamplerFailure.RESTART_SAMPLER_JOB))
    except ValueError:
        return SamplerFailure.RESTART_SAMPLER_JOB


def budgets_of(js: Mapping[str, Any]) -> tuple[int, int]:
    """(maxRestarts, maxSamplerRestarts) of a rendered JobSet: its annotations (budget_annotations);
    a JobSet rendered before sampler budgets existed has only its failurePolicy.maxRestarts, all the run's."""
    notes = (js.get("metadata") or {}).get("annotations") or {}
    total = int(((js.get("spec") or {}).get("failurePolicy") or {}).get("maxRestarts", 0) or 0)
    try:
        return int(notes[ANNOTATION_MAX_RESTARTS]), int(notes[ANNOTATION_MAX_SAMPLER_RESTARTS])
    except (KeyError, TypeError, ValueError):
        return total, 0


def jobset_max_restarts(
    max_restarts: int, max_sampler_restarts: int, mode: SamplerFailure = SamplerFailure.RESTART_SAMPLER_JOB
) -> int:
    """JobSet's one budget for counted restarts: the run's and the samplers' together (see above); the
    run's alone under RESTART_RUN."""
    return max_restarts + (max_sampler_restarts if mode is SamplerFailure.RESTART_SAMPLER_JOB else 0)


def jobset_failure_policy(
    max_restarts: int, max_sampler_restarts: int, mode: SamplerFailure = SamplerFailure.RESTART_SAMPLER_JOB
) -> dict[str, Any]:
    """The JobSet failurePolicy implementing contract 3: with role-scoped restarts (RESTART_SAMPLER_JOB),
    or with actions JobSet admits by default (RESTART_RUN: every restart is the run's)."""
    if mode is SamplerFailure.RESTART_RUN:
        # No target: a sampler's disruption is a free restart of the run; its crash gets the default.
        rules = [
            _rule(RULE_DISRUPTION, "RestartJobSetAndIgnoreMaxRestarts", POD_RULE_DISRUPTION),
            _bad_config(),
        ]
    else:
        rules = [
            _rule(RULE_DISRUPTION, "RestartJobSetAndIgnoreMaxRestarts", POD_RULE_DISRUPTION, TRAINER),
            _rule(RULE_SAMPLER_DISRUPTION, "RestartJobAndIgnoreMaxRestarts", POD_RULE_DISRUPTION, SAMPLER),
            _bad_config(),
            {"name": RULE_SAMPLER_CRASH, "action": "RestartJob", "targetReplicatedJobs": [SAMPLER]},
        ]
    return {
        "maxRestarts": jobset_max_restarts(max_restarts, max_sampler_restarts, mode),
        "restartStrategy": RESTART_STRATEGY,
        "rules": rules,
    }


def _rule(name: str, action: str, pod_rule: int, role: str | None = None) -> dict[str, Any]:
    """A rule matching a Job that the podFailurePolicy rule `pod_rule` failed (of `role` only, if given)."""
    rule: dict[str, Any] = {
        "name": name,
        "action": action,
        "onJobFailureReasons": [JOB_FAILURE_REASON],
        "onJobFailureMessagePatterns": [message_pattern(pod_rule)],
    }
    if role is not None:
        rule["targetReplicatedJobs"] = [role]
    return rule


def _bad_config() -> dict[str, Any]:
    return _rule(RULE_BAD_CONFIG, "FailJobSet", POD_RULE_BAD_CONFIG)


def restart_job_probe(namespace: str) -> dict[str, Any]:
    """The JobSet a server-side dry run creates to learn whether the cluster's JobSet admits the failure
    action RestartJob (`rljob doctor`; the operator at start-up with the chart's `jobset.restartJob:
    auto`): suspended, no network block (so the mutating webhook's default shows), and a RestartJob rule
    like the sampler's, which a controller without the gate refuses."""
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": {"generateName": "rljob-probe-", "namespace": namespace},
        "spec": {
            "suspend": True,
            "failurePolicy": {
                "maxRestarts": 1,
                "rules": [{"name": "probe", "action": "RestartJob", "targetReplicatedJobs": ["probe"]}],
            },
            "replicatedJobs": [
                {
                    "name": "probe",
                    "template": {
                        "spec": {
                            "template": {
                                "spec": {
                                    "restartPolicy": "Never",
                                    "containers": [{"name": "probe", "image": "registry.k8s.io/pause:3.10"}],
                                }
                            }
                        }
                    },
                }
            ],
        },
    }


def restart_job_admitted(error: str | None) -> bool | None:
    """What a dry run of `restart_job_probe` (or of any rljob JobSet) says about the failure action
    RestartJob: True admitted (no error), False refused for it (the feature gate off, or a CRD older than
    v0.12.0 that does not know the action), None refused for another reason (JobSet missing, its webhook
    unreachable, not allowed): unknown."""
    if error is None:
        return True
    if RESTART_JOB_GATE_REFUSAL in error or 'Unsupported value: "RestartJob"' in error:
        return False
    return None


def webhook_unreachable(error: str) -> bool:
    """The API server's message when it could not call a webhook (as opposed to the webhook denying)."""
    return "failed calling webhook" in error or "connection refused" in error
