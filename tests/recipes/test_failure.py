"""Contract 3 as JobSet rules: the JobSet's message patterns match the Job failure messages that
Kubernetes writes for the podFailurePolicy rules (format from kubernetes pkg/controller/job:
"Container <c> for pod <ns>/<pod> failed with exit code <n> matching FailJob rule at index <i>" and
"Pod <ns>/<pod> has condition DisruptionTarget matching FailJob rule at index <i>")."""

from __future__ import annotations

import re

import pytest
from rljob.recipes import failure
from rljob.recipes.failure import SamplerFailure

JOB, RUN = SamplerFailure.RESTART_SAMPLER_JOB, SamplerFailure.RESTART_RUN
# The failure actions JobSet v0.12.0 admits with its feature gate RestartJob off (its default).
DEFAULT_GATE_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"}


def _action(reason: str, message: str, role: str = "trainer", mode: SamplerFailure = JOB) -> str:
    """The JobSet action for a failed Job of `role`: the first matching rule (JobSet v0.12.0
    pkg/controllers/failure_policy.go ruleIsApplicable: every non-empty list must match), else JobSet's
    default RestartJobSet."""
    for rule in failure.jobset_failure_policy(3, 10, mode)["rules"]:
        reasons = rule.get("onJobFailureReasons") or []
        patterns = rule.get("onJobFailureMessagePatterns") or []
        targets = rule.get("targetReplicatedJobs") or []
        if (
            (not reasons or reason in reasons)
            and (not patterns or any(re.search(p, message) for p in patterns))
            and (not targets or role in targets)
        ):
            return str(rule["action"])
    return "RestartJobSet"


def _pod_rule(exit_code: int | None, disrupted: bool) -> int | None:
    """Index of the first podFailurePolicy rule matching a failed pod."""
    for i, rule in enumerate(failure.pod_failure_policy()["rules"]):
        conds = rule.get("onPodConditions", [])
        if disrupted and any(c == {"type": "DisruptionTarget", "status": "True"} for c in conds):
            return i
        codes = rule.get("onExitCodes")
        if codes and exit_code is not None and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            return i
    return None


@pytest.mark.parametrize(
    ("mode", "role", "exit_code", "disrupted", "action"),
    [
        (mode, *row)
        for mode in (JOB, RUN)
        for row in [
            ("trainer", 2, False, "FailJobSet"),  # bad configuration: no restart
            ("trainer", 1, False, "RestartJobSet"),  # crash: the run restarts, counted
            ("trainer", 137, False, "RestartJobSet"),
            ("trainer", 143, False, "RestartJobSet"),
            ("trainer", None, True, "RestartJobSetAndIgnoreMaxRestarts"),  # preemption / maintenance: free
            ("trainer", 137, True, "RestartJobSetAndIgnoreMaxRestarts"),  # disruption wins over the exit
            ("trainer", 2, True, "RestartJobSetAndIgnoreMaxRestarts"),
            ("sampler", 2, False, "FailJobSet"),  # bad configuration still fails the run at once
        ]
    ]
    + [
        # RestartSamplerJob: a sampler failure restarts that sampler Job alone, counted for a crash / OOM /
        # lost Ray worker, free for a disruption.
        (JOB, "sampler", 1, False, "RestartJob"),
        (JOB, "sampler", 137, False, "RestartJob"),
        (JOB, "sampler", None, True, "RestartJobAndIgnoreMaxRestarts"),
        (JOB, "sampler", 137, True, "RestartJobAndIgnoreMaxRestarts"),
        (JOB, "sampler", 2, True, "RestartJobAndIgnoreMaxRestarts"),
        # RestartRun (JobSet's gate off): the whole run restarts, counted for a crash, free for a disruption.
        (RUN, "sampler", 1, False, "RestartJobSet"),
        (RUN, "sampler", 137, False, "RestartJobSet"),
        (RUN, "sampler", None, True, "RestartJobSetAndIgnoreMaxRestarts"),
        (RUN, "sampler", 137, True, "RestartJobSetAndIgnoreMaxRestarts"),
        (RUN, "sampler", 2, True, "RestartJobSetAndIgnoreMaxRestarts"),
    ],
)
def test_contract(
    mode: SamplerFailure, role: str, exit_code: int | None, disrupted: bool, action: str
) -> None:
    idx = _pod_rule(exit_code, disrupted)
    if idx is None:
        reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    elif disrupted:
        reason = "PodFailurePolicy"
        message = f"Pod ns/p-0 has condition DisruptionTarget matching FailJob rule at index {idx}"
    else:
        reason = "PodFailurePolicy"
        message = (
            f"Container {role} for pod ns/p-0 failed with exit code {exit_code} "
            f"matching FailJob rule at index {idx}"
        )
    assert _action(reason, message, role, mode) == action


def test_restart_run_uses_only_actions_jobset_admits_by_default() -> None:
    """With JobSet's gate RestartJob off its webhook refuses RestartJob and RestartJobAndIgnoreMaxRestarts."""
    actions = {r["action"] for r in failure.jobset_failure_policy(3, 10, RUN)["rules"]}
    assert actions <= DEFAULT_GATE_ACTIONS
    assert {
        r["action"] for r in failure.jobset_failure_policy(3, 10, JOB)["rules"]
    } - DEFAULT_GATE_ACTIONS == {
        "RestartJob",
        "RestartJobAndIgnoreMaxRestarts",
    }


@pytest.mark.parametrize(("mode", "total", "sampler_budget"), [(JOB, 13, 10), (RUN, 3, 0)])
def test_restart_run_counts_against_the_runs_budget(
    mode: SamplerFailure, total: int, sampler_budget: int
) -> None:
    """Under RestartRun every counted restart is the run's: JobSet's budget is maxRestarts alone, and the
    annotations give the samplers none; the JobSet says which policy it carries."""
    js = {
        "metadata": {"annotations": failure.budget_annotations(3, 10, mode)},
        "spec": {"failurePolicy": failure.jobset_failure_policy(3, 10, mode)},
    }
    assert js["spec"]["failurePolicy"]["maxRestarts"] == total
    assert failure.budgets_of(js) == (3, sampler_budget)
    assert failure.sampler_failure_of(js) is mode
    assert failure.sampler_failure_of({"metadata": {}}) is JOB  # rendered before the annotation existed


@pytest.mark.parametrize(
    ("error", "admitted"),
    [
        (None, True),
        (
            'HTTP 422: admission webhook "vjobset.kb.io" denied the request: RestartJob and '
            "RestartJobAndIgnoreMaxRestarts failure policy actions are not allowed when RestartJob feature "
            "gate is disabled",
            False,
        ),
        (
            'JobSet.jobset.x-k8s.io "p" is invalid: spec.failurePolicy.rules[0].action: Unsupported value: '
            '"RestartJob"',
            False,
        ),
        (
            'Internal error occurred: failed calling webhook "mjobset.kb.io": connect: connection refused',
            None,
        ),
        ("HTTP 404: the server could not find the requested resource", None),
        ('HTTP 403: jobsets.jobset.x-k8s.io is forbidden: User "x" cannot create', None),
    ],
)
def test_restart_job_admitted_reads_the_dry_run(error: str | None, admitted: bool | None) -> None:
    assert failure.restart_job_admitted(error) is admitted
    probe = failure.restart_job_probe("ns1")
    assert probe["metadata"]["namespace"] == "ns1" and probe["spec"]["suspend"] is True
    assert [r["action"] for r in probe["spec"]["failurePolicy"]["rules"]] == ["RestartJob"]


@pytest.mark.parametrize(("trainer", "sampler", "total"), [(3, 10, 13), (0, 0, 0), (7, 0, 7), (0, 5, 5)])
def test_budgets_round_trip_through_the_jobset(trainer: int, sampler: int, total: int) -> None:
    """JobSet has one budget (the sum); the annotations carry each role's for the operator."""
    js = {
        "metadata": {"annotations": failure.budget_annotations(trainer, sampler)},
        "spec": {"failurePolicy": failure.jobset_failure_policy(trainer, sampler)},
    }
    assert js["spec"]["failurePolicy"]["maxRestarts"] == total
    assert failure.budgets_of(js) == (trainer, sampler)
    # A JobSet rendered before per-role budgets: its maxRestarts is the run's, the samplers' none.
    del js["metadata"]["annotations"]
    assert failure.budgets_of(js) == (total, 0)


def test_constants_and_shape() -> None:
    assert (failure.EXIT_OK, failure.EXIT_BAD_CONFIG) == (0, 2)
    policy = failure.jobset_failure_policy(7, 2)
    assert policy["maxRestarts"] == 9 and policy["restartStrategy"] == "BlockingRecreate"
    assert [r["name"] for r in policy["rules"]] == [
        "disruptionFreeRestart",
        "samplerDisruptionFreeRestart",
        "badConfigurationFail",
        "samplerRestart",
    ]
    # rule names as JobSet's API requires
    assert all(re.fullmatch(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", r["name"]) for r in policy["rules"])
    # index 10 must not match the pattern of index 1
    assert not re.search(failure.message_pattern(1), "matching FailJob rule at index 10")
