"""Contract 3 as JobSet rules: the JobSet's message patterns match the Job failure messages that
Kubernetes writes for the podFailurePolicy rules (format from kubernetes pkg/controller/job:
"Container <c> for pod <ns>/<pod> failed with exit code <n> matching FailJob rule at index <i>" and
"Pod <ns>/<pod> has condition DisruptionTarget matching FailJob rule at index <i>")."""

from __future__ import annotations

import re

import pytest
from rljob.recipes import failure


def _action(reason: str, message: str, role: str = "trainer") -> str:
    """The JobSet action for a failed Job of `role`: the first matching rule (JobSet v0.12.0
    pkg/controllers/failure_policy.go ruleIsApplicable: every non-empty list must match), else JobSet's
    default RestartJobSet."""
    for rule in failure.jobset_failure_policy(3, 10)["rules"]:
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
    ("role", "exit_code", "disrupted", "action"),
    [
        ("trainer", 2, False, "FailJobSet"),  # bad configuration: no restart
        ("trainer", 1, False, "RestartJobSet"),  # crash: the run restarts, counted
        ("trainer", 137, False, "RestartJobSet"),
        ("trainer", 143, False, "RestartJobSet"),
        ("trainer", None, True, "RestartJobSetAndIgnoreMaxRestarts"),  # preemption / maintenance: free
        ("trainer", 137, True, "RestartJobSetAndIgnoreMaxRestarts"),  # disruption wins over the exit code
        ("trainer", 2, True, "RestartJobSetAndIgnoreMaxRestarts"),
        # A sampler failure restarts that sampler Job alone: counted for a crash / OOM / lost Ray worker,
        # free for a disruption; bad configuration still fails the run at once.
        ("sampler", 2, False, "FailJobSet"),
        ("sampler", 1, False, "RestartJob"),
        ("sampler", 137, False, "RestartJob"),
        ("sampler", None, True, "RestartJobAndIgnoreMaxRestarts"),
        ("sampler", 137, True, "RestartJobAndIgnoreMaxRestarts"),
        ("sampler", 2, True, "RestartJobAndIgnoreMaxRestarts"),
    ],
)
def test_contract(role: str, exit_code: int | None, disrupted: bool, action: str) -> None:
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
    assert _action(reason, message, role) == action


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
