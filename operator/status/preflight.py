"""The compile preflight (spec.trainer.preflight.compile): the view of its Job, what its failed pod said,
where it stands (`preflight_outcome`) and the Ready reason of each state. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from rljob.operator import conditions as c
from rljob.operator.status.views import controller_uid
from rljob.recipes import failure as failure_rules
from rljob.recipes.api import PreflightState, PreflightStatus

# The Job controller's Failed condition of a pod failure policy's FailJob rule: "Container compile for pod
# ns/name failed with exit code 2 matching FailJob rule at index 0" (kubernetes pkg/controller/job).
_EXIT_CODE = re.compile(r"failed with exit code (\d+)")


@dataclasses.dataclass(frozen=True, slots=True)
class PreflightView:
    """The few fields of a compile preflight Job (rljob.recipes.render.preflight_job) the operator needs."""

    name: str
    uid: str
    resource_version: str
    owner_uid: str = ""
    succeeded: bool = False
    failed: bool = False
    reason: str = ""
    message: str = ""
    exit_code: int | None = None  # from the Failed condition of the Job's pod failure policy

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PreflightView:
        meta = body.get("metadata") or {}
        conds = {
            str(x.get("type")): x
            for x in (body.get("status") or {}).get("conditions") or []
            if x.get("status") == "True"
        }
        failed = conds.get("Failed") or {}
        message = " ".join(str(failed.get("message") or "").split())
        code = _EXIT_CODE.search(message)
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            resource_version=str(meta.get("resourceVersion", "")),
            owner_uid=controller_uid(meta),
            succeeded="Complete" in conds,
            failed=bool(failed),
            reason=str(failed.get("reason") or ""),
            message=message,
            exit_code=int(code[1]) if code else None,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class PreflightPod:
    """What a failed compile preflight pod said: its Job, its container's exit code and termination
    message (the refusal lines compilecheck wrote to /dev/termination-log, or with FallbackToLogsOnError
    the end of its log)."""

    job: str
    exit_code: int | None
    message: str
    # The kubelet killed the container at its memory limit (reason OOMKilled): the limit it had, which is
    # spec.trainer.preflight.memory ("" when the pod did not say).
    oom_limit: str | None = None


def preflight_pod(pod: Mapping[str, Any]) -> PreflightPod | None:
    """The failure of a preflight pod, or None while it has not failed."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    job = str((meta.get("labels") or {}).get(c.JOB_NAME_LABEL, ""))
    if status.get("phase") != "Failed":
        return None
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        code = term.get("exitCode")
        if isinstance(code, int) and code != 0:
            oom = None
            if term.get("reason") == "OOMKilled":
                containers = (pod.get("spec") or {}).get("containers") or [{}]
                oom = str((((containers[0].get("resources") or {}).get("limits")) or {}).get("memory") or "")
            return PreflightPod(job, code, str(term.get("message") or ""), oom)
    said = f"pod {meta.get('name', '')}: {status.get('reason') or 'Failed'}"
    if status.get("message"):
        said += f": {status['message']}"
    return PreflightPod(job, None, said)


def preflight_outcome(view: PreflightView, pod: PreflightPod | None) -> PreflightStatus:
    """Where a preflight Job stands: Running, Succeeded, DoesNotFit (exit 2: its lines) or Failed."""
    if view.succeeded:
        return PreflightStatus(job=view.name, state=PreflightState.SUCCEEDED, message="every program fits")
    if not view.failed:
        return PreflightStatus(job=view.name, state=PreflightState.RUNNING)
    ours = pod if pod is not None and pod.job == view.name else None
    code = ours.exit_code if ours is not None and ours.exit_code is not None else view.exit_code
    lines = [x.strip() for x in (ours.message if ours else "").splitlines() if x.strip()]
    if code == failure_rules.EXIT_BAD_CONFIG:
        text = "\n".join(lines) or f"Job {view.name}: {view.message}"
        return PreflightStatus(job=view.name, state=PreflightState.DOES_NOT_FIT, message=text[:4000])
    if ours is not None and ours.oom_limit is not None:
        # A setting of the manifest, not a bug: the compile needs more memory than the pod was given.
        limit = f" of {ours.oom_limit}" if ours.oom_limit else ""
        text = (
            f"spec.trainer.preflight.memory: Job {view.name}'s compile ran out of the pod's memory{limit} "
            '(OOMKilled): give a new RLJob more (the spec is immutable; docs/operator.md, "The compile '
            'preflight", says what a compile uses)'
        )
        return PreflightStatus(job=view.name, state=PreflightState.FAILED, message=text)
    text = f"Job {view.name} failed" + (f" with exit code {code}" if code is not None else "")
    text += f" ({view.reason}: {view.message})" if view.reason else ""
    if lines:
        text += ": " + " ".join(lines[-5:])[-2000:]
    return PreflightStatus(job=view.name, state=PreflightState.FAILED, message=text[:4000])


PREFLIGHT_REASONS = {
    PreflightState.RUNNING: c.REASON_PREFLIGHT_RUNNING,
    PreflightState.DOES_NOT_FIT: c.REASON_COMPILE_DOES_NOT_FIT,
    PreflightState.FAILED: c.REASON_PREFLIGHT_FAILED,
}
