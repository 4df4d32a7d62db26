"""spec.suspend of queued RLJobs (rljob.operator.kueue) and the reconcile around it, on an in-memory API.

The rule under test: Kueue owns spec.suspend of a JobSet with a queue label, so the operator never
writes it (no unsuspending what Kueue holds, no re-suspending what it admitted); the user's suspend and
resume go to the Workload's spec.active. tests/operator/test_kueue_cluster.py runs the same with Kueue.
"""

from __future__ import annotations

import asyncio
import builtins
import copy
from typing import Any

import pytest
from fixtures.operator import stored_rljob as rljob
from rljob.operator import conditions as c
from rljob.operator import k8s, kueue
from rljob.operator.reconcile import Reconciler
from rljob.operator.status.views import JobSetView
from rljob.recipes.render import render

KEY = ("ns", "demo")


class FakeKube:
    """The calls the reconcile makes, on dicts; Workloads by the kueue.x-k8s.io/job-uid label."""

    def __init__(self, *, workload_api: bool = True) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []  # (verb, kind)
        self.workload_api = workload_api
        self.rv = 100

    def _rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    async def dry_run_create(self, kind: Any, obj: dict[str, Any]) -> dict[str, Any]:
        return obj

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.apply(obj)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.calls.append(("create", obj["kind"]))
        stored = copy.deepcopy(obj)
        stored["metadata"].update(uid=f"uid-{obj['kind']}-{key[2]}", resourceVersion=self._rv())
        self.objects[key] = stored
        return copy.deepcopy(stored)

    async def apply_status(self, kind: k8s.Kind, namespace: str, name: str, status: dict[str, Any]) -> Any:
        self.calls.append(("status", "RLJob"))
        obj = self.objects[("RLJob", namespace, name)]
        obj["status"] = copy.deepcopy(status)
        obj["metadata"]["resourceVersion"] = self._rv()
        return copy.deepcopy(obj)

    async def merge_patch(self, kind: k8s.Kind, namespace: str, name: str, patch: dict[str, Any]) -> Any:
        kname = "Workload" if kind == kueue.WORKLOAD else "JobSet"
        self.calls.append(("patch", kname))
        obj = self.objects[(kname, namespace, name)]
        obj.setdefault("spec", {}).update(patch.get("spec") or {})
        labels = (patch.get("metadata") or {}).get("labels")
        if labels:
            obj["metadata"].setdefault("labels", {}).update(labels)
        obj["metadata"]["resourceVersion"] = self._rv()
        return copy.deepcopy(obj)

    async def post_event(self, regarding: dict[str, Any], *, type_: str, reason: str, note: str) -> None:
        self.calls.append(("event", reason))

    async def list(
        self,
        kind: k8s.Kind,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        if kind != kueue.WORKLOAD:
            return []
        self.calls.append(("list", "Workload"))
        if not self.workload_api:
            raise k8s.ApiError(404, {"reason": "NotFound", "message": "the server could not find it"})
        want = dict(x.split("=", 1) for x in (label_selector or "").split(",") if x)
        return [
            copy.deepcopy(o)
            for (kind_, _, _), o in self.objects.items()
            if kind_ == "Workload" and all(o["metadata"]["labels"].get(k) == v for k, v in want.items())
        ]

    # --- what Kueue would do ----------------------------------------------------------------------
    def add_workload(self, jobset_uid: str, active: bool = True) -> dict[str, Any]:
        wl = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "Workload",
            "metadata": {
                "name": "jobset-demo-1",
                "namespace": "ns",
                "labels": {kueue.JOB_UID_LABEL: jobset_uid},
            },
            "spec": {"active": active, "queueName": "tpu"},
        }
        self.objects[("Workload", "ns", "jobset-demo-1")] = wl
        return wl

    def set_jobset(self, *, suspend: bool, queue: str | None = None) -> dict[str, Any]:
        js = self.objects[("JobSet", "ns", "demo")]
        js["spec"]["suspend"] = suspend
        if queue is not None:
            js["metadata"].setdefault("labels", {})[c.QUEUE_LABEL] = queue
        js["metadata"]["resourceVersion"] = self._rv()
        return copy.deepcopy(js)

    def writes(self) -> builtins.list[tuple[str, str]]:
        return [x for x in self.calls if x[0] in ("patch", "create")]


def view(*, suspended: bool, queue: str | None = "tpu", uid: str = "js-uid") -> JobSetView:
    return JobSetView(
        name="demo", uid=uid, resource_version="1", suspended=suspended, roles={}, ready_jobs={},
        queue_name=queue,
    )  # fmt: skip


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ------------------------------------------------------------------------------ kueue.reconcile_suspend


def test_kueue_suspension_is_left_alone_without_any_call() -> None:
    kube = FakeKube()
    kube.add_workload("js-uid")
    out = run(
        kueue.reconcile_suspend(kube, view(suspended=True), want=False, by_user=False, deactivated=False)  # type: ignore[arg-type]
    )
    assert out == kueue.Outcome(None, False) and kube.calls == []


def test_user_suspend_deactivates_the_workload_not_the_jobset() -> None:
    kube = FakeKube()
    kube.add_workload("js-uid")
    out = run(
        kueue.reconcile_suspend(kube, view(suspended=False), want=True, by_user=False, deactivated=False)  # type: ignore[arg-type]
    )
    assert out == kueue.Outcome(None, True)
    assert kube.calls == [("list", "Workload"), ("patch", "Workload")]
    assert kube.objects[("Workload", "ns", "jobset-demo-1")]["spec"]["active"] is False
    # Once deactivated, nothing more while Kueue evicts and suspends (the JobSet may still run a while).
    kube.calls.clear()
    out = run(
        kueue.reconcile_suspend(kube, view(suspended=False), want=True, by_user=False, deactivated=True)  # type: ignore[arg-type]
    )
    assert out == kueue.Outcome(None, True) and kube.calls == []


def test_resume_reactivates_the_workload_and_leaves_the_jobset_to_kueue() -> None:
    kube = FakeKube()
    kube.add_workload("js-uid", active=False)
    out = run(
        kueue.reconcile_suspend(kube, view(suspended=True), want=False, by_user=True, deactivated=False)  # type: ignore[arg-type]
    )
    assert out == kueue.Outcome(None, False)
    assert kube.calls == [("list", "Workload"), ("patch", "Workload")]
    assert kube.objects[("Workload", "ns", "jobset-demo-1")]["spec"]["active"] is True


@pytest.mark.parametrize("workload_api", [False, True])
def test_without_a_workload_the_operator_suspends_and_resumes_the_jobset_itself(workload_api: bool) -> None:
    """No Kueue on the cluster (404 on the Workload API), or no Workload for this JobSet."""
    kube = FakeKube(workload_api=workload_api)
    out = run(
        kueue.reconcile_suspend(kube, view(suspended=False), want=True, by_user=False, deactivated=False)  # type: ignore[arg-type]
    )
    assert out == kueue.Outcome(True, False)
    out = run(kueue.reconcile_suspend(kube, view(suspended=True), want=True, by_user=True, deactivated=False))  # type: ignore[arg-type]
    assert out == kueue.Outcome(None, False)
    out = run(
        kueue.reconcile_suspend(kube, view(suspended=True), want=False, by_user=True, deactivated=False)  # type: ignore[arg-type]
    )
    assert out == kueue.Outcome(False, False)


def test_other_api_errors_are_raised() -> None:
    class Forbidden(FakeKube):
        async def list(
            self,
            kind: k8s.Kind,
            *,
            namespace: str | None = None,
            label_selector: str | None = None,
            field_selector: str | None = None,
        ) -> list[dict[str, Any]]:
            raise k8s.ApiError(403, {"reason": "Forbidden", "message": "no"})

    with pytest.raises(k8s.ApiError):
        run(
            kueue.reconcile_suspend(
                Forbidden(),  # type: ignore[arg-type]
                view(suspended=False),
                want=True,
                by_user=False,
                deactivated=False,
            )
        )


# ------------------------------------------------------------------------------------- the reconcile


def created(**spec: Any) -> tuple[Reconciler, FakeKube]:
    """An RLJob reconciled once (children created); Kueue's webhook suspended the queued JobSet."""
    kube = FakeKube()
    body = rljob(**spec)
    kube.objects[("RLJob", "ns", "demo")] = copy.deepcopy(body)
    rec = Reconciler(kube, render)  # type: ignore[arg-type]
    rec.observe_rljob(None, body)
    run(rec.reconcile(KEY))
    return rec, kube


def observe(rec: Reconciler, kube: FakeKube, js: dict[str, Any]) -> None:
    rec.observe_jobset("MODIFIED", js)
    rec.observe_rljob("MODIFIED", kube.objects[("RLJob", "ns", "demo")])


def status(kube: FakeKube) -> dict[str, Any]:
    return dict(kube.objects[("RLJob", "ns", "demo")]["status"])


def suspended_reason(kube: FakeKube) -> str:
    reason: str = next(x["reason"] for x in status(kube)["conditions"] if x["type"] == c.SUSPENDED)
    return reason


def spec_change(rec: Reconciler, kube: FakeKube, **spec: Any) -> None:
    body = kube.objects[("RLJob", "ns", "demo")]
    body["spec"].update(spec)
    body["metadata"]["generation"] += 1
    body["metadata"]["resourceVersion"] = kube._rv()
    rec.observe_rljob("MODIFIED", body)


def test_queued_jobset_held_then_admitted_by_kueue_is_never_patched() -> None:
    rec, kube = created(queueName="tpu")
    observe(rec, kube, kube.set_jobset(suspend=True))  # Kueue's webhook
    kube.calls.clear()
    run(rec.reconcile(KEY))
    assert status(kube)["phase"] == "Suspended" and suspended_reason(kube) == c.REASON_QUEUED
    assert kube.writes() == [] and ("list", "Workload") not in kube.calls
    observe(rec, kube, kube.set_jobset(suspend=False))  # admitted
    run(rec.reconcile(KEY))
    assert status(kube)["phase"] == "Pending"
    observe(rec, kube, kube.set_jobset(suspend=True))  # evicted (preempted) by Kueue
    run(rec.reconcile(KEY))
    assert suspended_reason(kube) == c.REASON_QUEUED
    assert kube.writes() == [] and ("list", "Workload") not in kube.calls


def test_user_suspend_then_resume_of_a_queued_run_goes_through_the_workload() -> None:
    rec, kube = created(queueName="tpu")
    js_uid = kube.objects[("JobSet", "ns", "demo")]["metadata"]["uid"]
    kube.add_workload(js_uid)
    observe(rec, kube, kube.set_jobset(suspend=False))  # admitted, running
    run(rec.reconcile(KEY))
    kube.calls.clear()
    spec_change(rec, kube, suspend=True)
    run(rec.reconcile(KEY))
    assert kube.writes() == [("patch", "Workload")]
    assert kube.objects[("Workload", "ns", "jobset-demo-1")]["spec"]["active"] is False
    assert kube.objects[("JobSet", "ns", "demo")]["spec"]["suspend"] is False
    kube.calls.clear()
    observe(rec, kube, kube.set_jobset(suspend=True))  # Kueue evicts (Deactivated) and suspends
    run(rec.reconcile(KEY))
    assert status(kube)["phase"] == "Suspended" and suspended_reason(kube) == c.REASON_SUSPENDED_BY_USER
    assert kube.writes() == [] and ("list", "Workload") not in kube.calls
    spec_change(rec, kube, suspend=False)
    run(rec.reconcile(KEY))
    assert kube.writes() == [("patch", "Workload")]
    assert kube.objects[("Workload", "ns", "jobset-demo-1")]["spec"]["active"] is True
    assert kube.objects[("JobSet", "ns", "demo")]["spec"]["suspend"] is True  # Kueue's to release
    assert suspended_reason(kube) == c.REASON_QUEUED
    kube.calls.clear()
    run(rec.reconcile(KEY))
    assert kube.calls == []


def test_a_queue_label_kueue_defaulted_is_kept_and_its_suspension_respected() -> None:
    """Kueue's LocalQueue defaulting labels a JobSet whose RLJob names no queue."""
    rec, kube = created()
    observe(rec, kube, kube.set_jobset(suspend=True, queue="default"))
    kube.calls.clear()
    run(rec.reconcile(KEY))
    js = kube.objects[("JobSet", "ns", "demo")]
    assert js["metadata"]["labels"][c.QUEUE_LABEL] == "default" and js["spec"]["suspend"] is True
    assert kube.writes() == []
    assert suspended_reason(kube) == c.REASON_QUEUED and "default" in next(
        x["message"] for x in status(kube)["conditions"] if x["type"] == c.SUSPENDED
    )


def test_without_a_queue_the_operator_owns_spec_suspend() -> None:
    rec, kube = created()
    observe(rec, kube, kube.set_jobset(suspend=True))  # someone else suspended it
    kube.calls.clear()
    run(rec.reconcile(KEY))
    assert kube.writes() == [("patch", "JobSet")]
    assert kube.objects[("JobSet", "ns", "demo")]["spec"]["suspend"] is False
