"""Contract 3 as JobSet rules: the JobSet's message patterns match the Job failure messages that
Kubernetes writes for the podFailurePolicy rules (format from kubernetes pkg/controller/job:
"Container <c> for pod <ns>/<pod> failed with exit code <n> matching FailJob rule at index <i>" and
"Pod <ns>/<pod> has condition DisruptionTarget matching FailJob rule at index <i>")."""

from __future__ import annotations

import re

import pytest
from rljob.recipes import failure


def _action(reason: str, message: str) -> str:
    """The JobSet action for a failed Job: first matching rule, else JobSet's default RestartJobSet."""
    for rule in failure.jobset_failure_policy(3)["rules"]:
        if reason in rule["onJobFailureReasons"] and any(
            re.search(p, message) for p in rule["onJobFailureMessagePatterns"]
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
    ("exit_code", "disrupted", "action"),
    [
        (2, False, "FailJobSet"),  # bad configuration: no restart
        (1, False, "RestartJobSet"),  # crash: counted restart
        (137, False, "RestartJobSet"),
        (143, False, "RestartJobSet"),
        (None, True, "RestartJobSetAndIgnoreMaxRestarts"),  # preemption / maintenance: free restart
        (137, True, "RestartJobSetAndIgnoreMaxRestarts"),  # disruption wins over the exit code
        (2, True, "RestartJobSetAndIgnoreMaxRestarts"),
    ],
)
def test_contract(exit_code: int | None, disrupted: bool, action: str) -> None:
    idx = _pod_rule(exit_code, disrupted)
    if idx is None:
        reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    elif disrupted:
        reason = "PodFailurePolicy"
        message = f"Pod ns/p-0 has condition DisruptionTarget matching FailJob rule at index {idx}"
    else:
        reason = "PodFailurePolicy"
        message = (
            f"Container trainer for pod ns/p-0 failed with exit code {exit_code} "
            f"matching FailJob rule at index {idx}"
        )
    assert _action(reason, message) == action


def test_constants_and_shape() -> None:
    assert (failure.EXIT_OK, failure.EXIT_BAD_CONFIG) == (0, 2)
    policy = failure.jobset_failure_policy(7)
    assert policy["maxRestarts"] == 7 and policy["restartStrategy"] == "BlockingRecreate"
    assert [r["name"] for r in policy["rules"]] == ["disruptionFreeRestart", "badConfigurationFail"]
    # rule names as JobSet's API requires
    assert all(re.fullmatch(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", r["name"]) for r in policy["rules"])
    # index 10 must not match the pattern of index 1
    assert not re.search(failure.message_pattern(1), "matching FailJob rule at index 10")
