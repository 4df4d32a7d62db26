"""The reconcile service's decisions and API writes, against an in-memory API (`MemoryKube`).

The real API is exercised in test_operator_cluster.py; here each case checks which writes one reconcile
makes: children created once with owner references, exactly one status write, none when nothing
changed, never a JobSet after a terminal phase.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from fixtures.operator import stored_rljob as rljob
from rljob.operator import conditions as c
from rljob.operator import k8s
from rljob.operator.reconcile import PlanCache, Reconciler, WorkQueue, make_plan, newer
from rljob.recipes.render import render


class MemoryKube:
    """Just enough of k8s.Kube: stores applied objects, records every write."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.writes: list[tuple[str, str, str]] = []
        self.rv = 100

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """k8s.Kube.create: a POST, or a server-side apply when the object exists."""
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            return await self.apply(obj)
        return await self._store("create", obj)

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self._store("apply", obj)

    async def _store(self, verb: str, obj: dict[str, Any]) -> dict[str, Any]:
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        self.writes.append((verb, *key))
        stored = copy.deepcopy(obj)
        stored["metadata"].update(uid=f"uid-{key[2]}", resourceVersion=self._next_rv())
        self.objects[key] = stored
        return copy.deepcopy(stored)

    async def apply_status(
        self, kind: k8s.Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        self.writes.append(("status", "RLJob", namespace, name))
        obj = self.objects[("RLJob", namespace, name)]
        obj["status"] = copy.deepcopy(status)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        return copy.deepcopy(obj)

    async def merge_patch(
        self, kind: k8s.Kind, namespace: str, name: str, patch: dict[str, Any]
    ) -> dict[str, Any]:
        self.writes.append(("patch", "JobSet", namespace, name))
        obj = self.objects[("JobSet", namespace, name)]
        obj["spec"].update(patch["spec"])
        obj["metadata"]["resourceVersion"] = self._next_rv()
        return copy.deepcopy(obj)

    async def post_event(self, regarding: dict[str, Any], *, type_: str, reason: str, note: str) -> None:
        self.writes.append(("event", reason, "", ""))

    async def list(self, kind: k8s.Kind, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return []


def setup(body: dict[str, Any]) -> tuple[Reconciler, MemoryKube]:
    kube = MemoryKube()
    kube.objects[("RLJob", "ns", body["metadata"]["name"])] = copy.deepcopy(body)
    rec = Reconciler(kube, render)  # type: ignore[arg-type]
    rec.observe_rljob(None, body)
    return rec, kube


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_first_reconcile_creates_children_and_writes_status_once() -> None:
    rec, kube = setup(rljob())
    run(rec.reconcile(("ns", "demo")))
    created = [w[1] for w in kube.writes if w[0] in ("create", "apply")]
    # The progress ConfigMap, SA, Role, run ConfigMap together; the RoleBinding after its Role (the API
    # server resolves the Role to check escalation); the JobSet last. All created (POST), none applied.
    assert created == ["ConfigMap", "ServiceAccount", "Role", "ConfigMap", "RoleBinding", "JobSet"]
    assert not [w for w in kube.writes if w[0] == "apply"]
    assert [w for w in kube.writes if w[0] == "status"] == [("status", "RLJob", "ns", "demo")]
    assert kube.writes[-1] == ("event", c.EVENT_JOBSET_CREATED, "", "")
    for (kind, _, name), obj in kube.objects.items():
        if kind != "RLJob":
            ref = obj["metadata"]["ownerReferences"][0]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
                "RLJob",
                "demo",
                "uid-demo",
                True,
            ), name
            assert obj["metadata"]["labels"][c.LABEL_NAME] == "demo"
    status = kube.objects[("RLJob", "ns", "demo")]["status"]
    assert status["phase"] == "Pending" and status["jobSetName"] == "demo"
    assert status["restarts"] == {"used": 0, "left": 3}


def test_second_reconcile_writes_nothing() -> None:
    rec, kube = setup(rljob())
    run(rec.reconcile(("ns", "demo")))
    before = len(kube.writes)
    rec.observe_rljob("MODIFIED", kube.objects[("RLJob", "ns", "demo")])  # our own status write's event
    run(rec.reconcile(("ns", "demo")))
    assert kube.writes[before:] == []


def test_jobset_status_change_gives_one_status_write() -> None:
    rec, kube = setup(rljob())
    run(rec.reconcile(("ns", "demo")))
    js = kube.objects[("JobSet", "ns", "demo")]
    js["status"] = {
        "replicatedJobsStatus": [{"name": "trainer", "ready": 1}, {"name": "sampler", "ready": 1}]
    }
    js["metadata"]["resourceVersion"] = "999"
    rec.observe_jobset("MODIFIED", js)
    before = len(kube.writes)
    run(rec.reconcile(("ns", "demo")))
    assert [w[0] for w in kube.writes[before:]] == ["status"]
    assert kube.objects[("RLJob", "ns", "demo")]["status"]["phase"] == "Running"


def test_suspend_patches_the_jobset() -> None:
    rec, kube = setup(rljob())
    run(rec.reconcile(("ns", "demo")))
    body = copy.deepcopy(kube.objects[("RLJob", "ns", "demo")])
    body["spec"]["suspend"] = True
    body["metadata"].update(generation=2, resourceVersion="500")
    kube.objects[("RLJob", "ns", "demo")] = body
    rec.observe_rljob("MODIFIED", body)
    before = len(kube.writes)
    run(rec.reconcile(("ns", "demo")))
    assert [w[0] for w in kube.writes[before:]][:2] == ["patch", "status"]
    assert kube.objects[("JobSet", "ns", "demo")]["spec"]["suspend"] is True
    assert kube.objects[("RLJob", "ns", "demo")]["status"]["phase"] == "Suspended"


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_terminal_phase_never_creates_a_jobset(phase: str) -> None:
    body = rljob()
    body["status"] = {"phase": phase, "jobSetName": "demo"}
    rec, kube = setup(body)
    run(rec.reconcile(("ns", "demo")))
    assert not [w for w in kube.writes if w[0] in ("create", "apply")]


def test_children_left_by_an_interrupted_run_are_applied_not_created() -> None:
    rec, kube = setup(rljob())
    run(
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": "demo-rljob", "namespace": "ns"},
            }
        )
    )
    kube.writes.clear()
    run(rec.reconcile(("ns", "demo")))
    verbs = {w[1]: w[0] for w in kube.writes if w[0] in ("create", "apply")}
    assert verbs["ServiceAccount"] == "apply"
    assert verbs["JobSet"] == "create" and verbs["RoleBinding"] == "create"


def test_plan_cache_renders_each_input_once() -> None:
    calls: list[str] = []

    def counting(job: Any) -> Any:
        calls.append(job.metadata.name)
        return render(job)

    cache = PlanCache(size=2)
    body = rljob()
    first = cache.make_plan(body, counting)
    again = cache.make_plan({**body, "metadata": {**body["metadata"], "annotations": {"a": "b"}}}, counting)
    assert calls == ["demo"] and again == first
    assert again.objects[0] is not first.objects[0]  # no caller shares a mutable object
    cache.make_plan(rljob(suspend=True), counting)  # another spec
    cache.make_plan({**body, "metadata": {**body["metadata"], "generation": 2}}, counting)
    assert len(calls) == 3
    cache.make_plan(body, counting)  # evicted (size 2)
    assert len(calls) == 4


def test_invalid_spec_fails_without_children() -> None:
    rec, kube = setup(rljob(lora={"rank": 7}))
    run(rec.reconcile(("ns", "demo")))
    assert [w[0] for w in kube.writes] == ["status", "event"]
    status = kube.objects[("RLJob", "ns", "demo")]["status"]
    assert status["phase"] == "Failed"
    accepted = next(x for x in status["conditions"] if x["type"] == c.ACCEPTED)
    assert accepted["status"] == "False" and accepted["message"].startswith("spec.lora.rank:")


def test_make_plan_reads_max_restarts_and_names_fields() -> None:
    assert make_plan(rljob(failurePolicy={"maxRestarts": 7}), render).max_restarts == 7
    plan = make_plan(rljob(trainer={"tpu": "v5p-8", "mesh": {"fsdp": 3}}), render)
    assert plan.error is not None and plan.error.startswith("spec.trainer.mesh:")
    plan = make_plan(rljob(unknownField=1), render)
    assert plan.error is not None and "spec.unknownField" in plan.error


def test_work_queue_dedups_and_requeues_dirty_keys() -> None:
    async def scenario() -> list[tuple[str, str]]:
        q = WorkQueue()
        q.add(("a", "1"))
        q.add(("a", "1"))
        assert len(q) == 1
        key = await q.get()
        q.add(key)  # changed while being reconciled
        assert len(q) == 0
        q.done(key)
        assert len(q) == 1
        return [await q.get()]

    assert run(scenario()) == [("a", "1")]


@pytest.mark.parametrize(
    ("new", "old", "expected"),
    [("10", "9", True), ("9", "10", False), ("10", "10", True), ("x", "10", True), ("5", None, True)],
)
def test_newer(new: str, old: str | None, expected: bool) -> None:
    assert newer(new, old) is expected


def test_first_failure_of_the_newest_attempt_is_kept() -> None:
    from datetime import UTC, datetime, timedelta

    from rljob.operator.reconcile import Caches
    from rljob.operator.status import PodFailure
    from rljob.recipes.api import FailureClass

    t = datetime(2026, 1, 1, tzinfo=UTC)
    caches, key = Caches(), ("ns", "demo")
    first = PodFailure(FailureClass.PREEMPTION, "Preempted", "node gone", t, 0, "trainer")
    assert caches.put_failure(key, first)
    assert not caches.put_failure(
        key, PodFailure(FailureClass.CRASH, "Crashed", "later", t + timedelta(seconds=5), 0, "sampler")
    )
    assert caches.failures[key] is first
    newer_attempt = PodFailure(
        FailureClass.CRASH, "Crashed", "exit 1", t + timedelta(minutes=1), 1, "trainer"
    )
    assert caches.put_failure(key, newer_attempt) and caches.failures[key] is newer_attempt


def test_plan_api_url_of_a_service_run() -> None:
    """status.url comes from the rendered Service: the run's name, namespace and spec.service.port."""
    body = rljob(service={"api": "tinker", "port": 9090}, trainer={"tpu": "v5p-8"}, sampler={"tpu": "v5p-8"})
    plan = make_plan(body, render)
    assert plan.error is None, plan.error
    assert plan.api_url == "http://demo-api.ns.svc:9090"
    assert make_plan(rljob(), render).api_url is None
    assert k8s.kind_of(next(o for o in plan.objects if o["kind"] == "Service")) is k8s.SERVICE
