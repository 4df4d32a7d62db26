"""The reconcile service's decisions and API writes, against an in-memory API (`MemoryKube`).

The real API is exercised in test_operator_cluster.py; here each case checks which writes one reconcile
makes: children created once with owner references, exactly one status write, none when nothing
changed, never a JobSet after a terminal phase.
"""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fixtures.memkube import MemoryKube, run, setup
from fixtures.operator import stored_rljob as rljob
from rljob.operator import conditions as c
from rljob.operator import k8s
from rljob.operator.cache import newer
from rljob.operator.plans import PlanCache, make_plan
from rljob.operator.reconcile import POD_CREATE_POLL_S, Reconciler, owned
from rljob.operator.status.views import controller_uid
from rljob.operator.workqueue import WorkQueue
from rljob.recipes.render import render

TESTED_MODULES = (
    "rljob.operator.cache",
    "rljob.operator.plans",
    "rljob.operator.workqueue",
)


def test_first_reconcile_creates_children_and_writes_status_once() -> None:
    rec, kube = setup(rljob())
    run(rec.reconcile(("ns", "demo")))
    created = [w[1] for w in kube.writes if w[0] in ("create", "apply")]
    # The progress ConfigMap, credentials Secret, SA, Role, run ConfigMap and NetworkPolicy together; the
    # RoleBinding after its Role (the API server resolves the Role to check escalation); the JobSet last. All
    # created (POST), none applied.
    assert created == [
        "ConfigMap",
        "Secret",
        "ServiceAccount",
        "Role",
        "ConfigMap",
        "NetworkPolicy",
        "RoleBinding",
        "JobSet",
    ]
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
    assert status["restarts"] == {
        "used": 0,
        "left": 3,
        "trainer": {"used": 0, "left": 3},
        "sampler": {"used": 0, "left": 10},
    }


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
    body = rljob()
    rec, kube = setup(body)
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "demo-rljob", "namespace": "ns"}}
    run(kube.create(owned(sa, body)))
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

    from rljob.operator.cache import Caches
    from rljob.operator.status.pods import PodFailure
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
    body = rljob(
        service={"api": "tinker", "port": 9090, "apiKeySecret": "tk-keys"},
        trainer={"tpu": "v5p-8"},
        sampler={"tpu": "v5p-8"},
    )
    plan = make_plan(body, render)
    assert plan.error is None, plan.error
    assert plan.api_url == "http://demo-api.ns.svc:9090"
    assert make_plan(rljob(), render).api_url is None
    assert k8s.kind_of(next(o for o in plan.objects if o["kind"] == "Service")) is k8s.SERVICE


# ------------------------------------------------------------------ ownership, failures to create, upgrades


def _foreign(kind: str, name: str, owner: str | None, **extra: Any) -> dict[str, Any]:
    """An object with a child's name that this RLJob did not create (another owner, or none)."""
    api = {"JobSet": "jobset.x-k8s.io/v1alpha2", "ConfigMap": "v1", "Secret": "v1"}[kind]
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "uid": f"foreign-{name}",
        "resourceVersion": "50",
        # The label the operator's watches select on: anyone can set it.
        "labels": {c.LABEL_NAME: "demo", c.LABEL_PROGRESS: "true"},
    }
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": "rljob.dev/v1alpha1",
                "kind": "RLJob",
                "name": "demo",
                "uid": owner,
                "controller": True,
            }
        ]
    return {"apiVersion": api, "kind": kind, "metadata": meta, **extra}


def _status(kube: MemoryKube) -> dict[str, Any]:
    status: dict[str, Any] = kube.objects[("RLJob", "ns", "demo")]["status"]
    return status


def _condition(kube: MemoryKube, ctype: str) -> dict[str, Any]:
    return next(x for x in _status(kube)["conditions"] if x["type"] == ctype)


def _events(kube: MemoryKube) -> list[str]:
    return [w[1] for w in kube.writes if w[0] == "event"]


@pytest.mark.parametrize("owner", [None, "uid-of-another-rljob"], ids=["no owner", "another owner"])
def test_a_jobset_of_the_same_name_is_never_adopted_nor_its_outcome_counted(owner: str | None) -> None:
    from rljob.operator.reconcile import ChildError

    rec, kube = setup(rljob())
    done = {"status": {"conditions": [{"type": "Completed", "status": "True"}], "terminalState": "Completed"}}
    js = _foreign("JobSet", "demo", owner, spec={"suspend": True}, **done)
    kube.objects[("JobSet", "ns", "demo")] = copy.deepcopy(js)
    rec.observe_jobset("ADDED", js)
    with pytest.raises(ChildError):
        run(rec.reconcile(("ns", "demo")))
    # Not Succeeded although that JobSet says Completed; not patched (suspend), not applied over.
    status = _status(kube)
    assert status["phase"] == "Pending" and "jobSetName" not in status
    ready = _condition(kube, c.READY)
    assert ready["reason"] == c.REASON_NOT_OWNED and "JobSet ns/demo exists" in ready["message"]
    assert _events(kube) == [c.REASON_NOT_OWNED]
    assert not [w for w in kube.writes if w[1] == "JobSet" and w[0] in ("create", "apply", "patch")]
    assert kube.objects[("JobSet", "ns", "demo")] == js
    # Retried: the same problem again writes nothing new (no second status write, no second event).
    before = len(kube.writes)
    with pytest.raises(ChildError):
        run(rec.reconcile(("ns", "demo")))
    assert [w for w in kube.writes[before:] if w[0] in ("status", "event")] == []
    # Once it is gone, the run starts.
    del kube.objects[("JobSet", "ns", "demo")]
    rec.observe_jobset("DELETED", js)
    run(rec.reconcile(("ns", "demo")))
    assert _status(kube)["jobSetName"] == "demo"
    assert controller_uid(kube.objects[("JobSet", "ns", "demo")]["metadata"]) == "uid-demo"
    assert _events(kube)[-1] == c.EVENT_JOBSET_CREATED


def _token(kube: MemoryKube, name: str = "demo-credentials") -> str:
    import base64

    return base64.b64decode(kube.objects[("Secret", "ns", name)]["data"]["token"]).decode()


def test_each_run_gets_its_own_credentials_secret_which_its_pods_reference() -> None:
    """The operator creates `<rljob>-credentials` before the JobSet: owned by the RLJob (garbage-collected
    with it), labelled as the run's other objects, immutable, a random token of its own per run; every
    trainer and sampler container of the JobSet takes RLJOB_RUN_TOKEN from it."""
    tokens = set()
    for _ in range(2):
        rec, kube = setup(rljob())
        run(rec.reconcile(("ns", "demo")))
        secret = kube.objects[("Secret", "ns", "demo-credentials")]
        created = [w[1] for w in kube.writes if w[0] == "create"]
        assert created.index("Secret") < created.index("JobSet")  # its owner: the first test's check
        labels = secret["metadata"]["labels"]
        assert labels[c.LABEL_NAME] == "demo" and labels["app.kubernetes.io/instance"] == "demo"
        assert secret["type"] == "Opaque" and secret["immutable"] is True and set(secret["data"]) == {"token"}
        tokens.add(_token(kube))
        js = kube.objects[("JobSet", "ns", "demo")]
        for rj in js["spec"]["replicatedJobs"]:
            for container in rj["template"]["spec"]["template"]["spec"]["containers"]:
                env = {e["name"]: e.get("valueFrom") for e in container["env"]}
                assert env["RLJOB_RUN_TOKEN"] == {
                    "secretKeyRef": {"name": "demo-credentials", "key": "token"}
                }, rj["name"]
    assert len(tokens) == 2 and all(len(t) >= 43 for t in tokens)


def test_a_credentials_secret_left_by_an_interrupted_run_keeps_its_token() -> None:
    """A run interrupted after its Secret was created: the next reconcile keeps that Secret as it is (its
    token is never replaced) and creates the rest."""
    body = rljob()
    rec, kube = setup(body)
    run(rec.reconcile(("ns", "demo")))
    token = _token(kube)
    for kind, name in [("JobSet", "demo"), ("RoleBinding", "demo-progress")]:
        del kube.objects[(kind, "ns", name)]
    rec.caches.jobsets.clear()
    kube.objects[("RLJob", "ns", "demo")].pop("status")
    rec.observe_rljob(
        "MODIFIED",
        {
            **kube.objects[("RLJob", "ns", "demo")],
            "metadata": {**kube.objects[("RLJob", "ns", "demo")]["metadata"], "resourceVersion": "900"},
        },
    )
    kube.writes.clear()
    run(rec.reconcile(("ns", "demo")))
    assert ("create", "JobSet", "ns", "demo") in kube.writes
    assert not [w for w in kube.writes if w[1] == "Secret" and w[0] != "create"]
    assert _token(kube) == token


def test_a_credentials_secret_not_ours_stops_the_run_in_its_status() -> None:
    """A Secret of that name that another owner controls is never adopted (its token could be anyone's):
    ChildNotOwned, no JobSet, and the worker retries (a refused create: the next test's rbac-secret)."""
    from rljob.operator.reconcile import ChildError

    rec, kube = setup(rljob())
    fake = _foreign("Secret", "demo-credentials", "uid-else", data={"token": "a25vd24="})
    kube.objects[("Secret", "ns", "demo-credentials")] = copy.deepcopy(fake)
    with pytest.raises(ChildError):
        run(rec.reconcile(("ns", "demo")))
    ready = _condition(kube, c.READY)
    assert ready["reason"] == c.REASON_NOT_OWNED and "Secret ns/demo-credentials exists" in ready["message"]
    assert kube.objects[("Secret", "ns", "demo-credentials")] == fake
    assert ("JobSet", "ns", "demo") not in kube.objects


def test_a_progress_configmap_not_ours_is_not_the_runs_progress() -> None:
    from rljob.operator.reconcile import ChildError

    rec, kube = setup(rljob())
    fake = _foreign("ConfigMap", "demo-progress", "uid-else", data={"progress.json": '{"step": 99}'})
    kube.objects[("ConfigMap", "ns", "demo-progress")] = copy.deepcopy(fake)
    rec.observe_progress("ADDED", fake)
    with pytest.raises(ChildError):
        run(rec.reconcile(("ns", "demo")))
    assert "progress" not in _status(kube)
    assert _condition(kube, c.READY)["reason"] == c.REASON_NOT_OWNED
    assert kube.objects[("ConfigMap", "ns", "demo-progress")] == fake  # never overwritten


def test_a_pod_failure_of_another_jobset_is_not_counted() -> None:
    from datetime import UTC, datetime, timedelta

    from rljob.operator.status.pods import PodFailure
    from rljob.recipes.api import FailureClass

    rec, kube = setup(rljob())
    run(rec.reconcile(("ns", "demo")))
    js = kube.objects[("JobSet", "ns", "demo")]
    js["status"] = {"restarts": 1, "restartsCountTowardsMax": 1}
    js["metadata"]["resourceVersion"] = "900"
    rec.observe_jobset("MODIFIED", js)
    t = datetime.now(UTC) + timedelta(hours=1)
    other = PodFailure(FailureClass.BAD_CONFIGURATION, "BadConfiguration", "exit 2", t, 0, "trainer", "x")
    rec.caches.put_failure(("ns", "demo"), other)
    run(rec.reconcile(("ns", "demo")))
    last = _status(kube)["lastFailure"]
    assert last["class"] == "crash" and "not observed" in last["message"]  # from the JobSet's counter
    ours = PodFailure(
        FailureClass.PREEMPTION, "Preempted", "node gone", t, 0, "trainer", js["metadata"]["uid"]
    )
    rec.caches.failures.clear()
    rec.caches.put_failure(("ns", "demo"), ours)
    run(rec.reconcile(("ns", "demo")))
    assert _status(kube)["lastFailure"]["class"] == "preemption"


def _failed_pod(
    uid_label: str | None, owner: dict[str, Any] | None, message: str, attempt: str = "0"
) -> dict[str, Any]:
    """A failed trainer pod labelled with run `demo`'s names: `uid_label` its jobset-uid label, `owner` its
    controller owner reference (None: none), exit 2 with `message` as its termination message."""
    labels = {
        c.JOBSET_NAME_LABEL: "demo",
        c.REPLICATED_JOB_LABEL: "trainer",
        c.RESTART_ATTEMPT_LABEL: attempt,
    }
    if uid_label is not None:
        labels[c.JOBSET_UID_LABEL] = uid_label
    meta: dict[str, Any] = {"name": "p", "namespace": "ns", "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "controller": True, "uid": "job-uid", **owner}]
    term = {"exitCode": 2, "finishedAt": "2026-11-29T19:55:00Z", "message": message}
    status = {"phase": "Failed", "containerStatuses": [{"name": "trainer", "state": {"terminated": term}}]}
    return {"metadata": meta, "status": status}


def test_a_pod_labelled_with_another_runs_name_cannot_set_its_last_failure() -> None:
    """Anyone who creates pods in the namespace can label one with run `demo`'s JobSet name and uid. Only
    a pod whose controller is one of the JobSet's Jobs (exact name) and whose jobset-uid label is the
    JobSet's uid is the run's: the forged ones (a higher restart attempt, so that the old "first failure of
    the newest attempt" kept them over the real one) set nothing."""
    rec, kube = setup(rljob())
    run(rec.reconcile(("ns", "demo")))
    js = kube.objects[("JobSet", "ns", "demo")]
    uid = js["metadata"]["uid"]
    js["status"] = {"restarts": 1, "restartsCountTowardsMax": 1}  # attempt 0 ended
    js["metadata"]["resourceVersion"] = "900"
    rec.observe_jobset("MODIFIED", js)
    job = {"kind": "Job", "name": "demo-trainer-0"}
    forged = [
        _failed_pod(None, None, "spec.a: forged by label"),
        _failed_pod(uid, None, "spec.b: forged with the uid label"),
        _failed_pod(uid, {"kind": "Job", "name": "demo-b-trainer-0"}, "spec.c: another run's Job"),
        _failed_pod(uid, {"kind": "Job", "name": "demo-trainer-0x"}, "spec.d: a name with a prefix"),
        _failed_pod(uid, {"kind": "ReplicaSet", "name": "demo-trainer-0"}, "spec.e: not a Job"),
        _failed_pod("uid-else", job, "spec.f: another JobSet's uid"),
        _failed_pod("", job, "spec.g: no uid"),
    ]
    for pod in forged:
        rec.observe_pod("MODIFIED", {**pod, "metadata": {**pod["metadata"]}})
        pod["metadata"]["labels"][c.RESTART_ATTEMPT_LABEL] = "99"
        rec.observe_pod("MODIFIED", pod)
    assert rec.caches.failures.get(("ns", "demo")) is None  # 14 tried, 14 refused
    rec.observe_pod("MODIFIED", _failed_pod(uid, job, "spec.model: the real cause"))
    run(rec.reconcile(("ns", "demo")))
    last = _status(kube)["lastFailure"]
    assert last["class"] == "badConfiguration" and last["message"].endswith("spec.model: the real cause")


@pytest.mark.parametrize(
    ("kind", "error", "expected"),
    [
        (
            "JobSet",
            k8s.ApiError(403, {"message": "jobsets.jobset.x-k8s.io is forbidden: cannot create"}),
            "forbidden",
        ),
        (
            "JobSet",
            k8s.ApiError(422, {"message": 'JobSet.jobset.x-k8s.io "demo" is invalid: x'}),
            "is invalid",
        ),
        ("JobSet", k8s.ApiError(404, {"message": "the server could not find the requested resource"}), "CRD"),
        # The run's credentials Secret, created before the JobSet: no JobSet without it.
        ("Secret", k8s.ApiError(403, {"message": "secrets is forbidden: cannot create"}), "forbidden"),
    ],
    ids=["rbac", "invalid", "no-crd", "rbac-secret"],
)
def test_a_child_that_cannot_be_created_is_a_condition_and_an_event_and_is_retried(
    kind: str, error: Exception, expected: str
) -> None:
    from rljob.operator.reconcile import ChildError

    rec, kube = setup(rljob())
    kube.fail[kind] = error
    with pytest.raises(ChildError):
        run(rec.reconcile(("ns", "demo")))
    ready = _condition(kube, c.READY)
    assert (_status(kube)["phase"], ready["status"], ready["reason"]) == (
        "Pending",
        "False",
        c.REASON_CREATE_FAILED,
    )
    assert expected in ready["message"]
    assert _events(kube) == [c.REASON_CREATE_FAILED]
    assert ("JobSet", "ns", "demo") not in kube.objects
    # The worker retries with backoff (client-go style: 1 s, 2 s, ... capped at 60 s).
    delays: list[float] = []
    rec.queue.add_after = lambda key, delay: delays.append(delay)  # type: ignore[method-assign]

    async def one_attempt() -> None:
        rec.queue.add(("ns", "demo"))
        worker = asyncio.create_task(rec._worker())
        while rec.queue._active or len(rec.queue):
            await asyncio.sleep(0.01)
        worker.cancel()

    run(one_attempt())
    run(one_attempt())
    assert delays == [1.0, 2.0]
    del kube.fail[kind]
    run(one_attempt())
    # Created: no more backoff; the run, now waiting for its pods, is looked at again after the poll.
    assert delays == [1.0, 2.0, POD_CREATE_POLL_S] and rec._retries == {}
    assert _status(kube)["jobSetName"] == "demo" and _events(kube)[-1] == c.EVENT_JOBSET_CREATED


def test_a_job_the_api_server_refuses_is_a_condition_and_an_event_and_nothing_is_created() -> None:
    """The JobSet controller would create the Jobs and only post an event when one is refused: the dry run
    of each replicated job's Job before anything is created puts the API server's message in the status.
    Permanent for the generation: not retried with backoff (a resync or a new generation tries again)."""
    rec, kube = setup(rljob())
    message = (
        'Job.batch "demo-trainer-0" is invalid: spec.template.spec.volumes[0].secret.secretName: Invalid'
    )
    kube.fail["Job dry run"] = k8s.ApiError(422, {"message": message})
    run(rec.reconcile(("ns", "demo")))  # no ChildError: no retry loop
    ready = _condition(kube, c.READY)
    assert (_status(kube)["phase"], ready["status"], ready["reason"]) == (
        "Pending",
        "False",
        c.REASON_CREATE_FAILED,
    )
    assert "replicated job trainer" in ready["message"] and "secretName: Invalid" in ready["message"]
    assert _events(kube) == [c.REASON_CREATE_FAILED]
    assert [w for w in kube.writes if w[0] in ("create", "apply")] == []  # nothing created
    # The dry runs are the JobSet's Jobs, one per replicated job, named as JobSet names them.
    del kube.fail["Job dry run"]
    run(rec.reconcile(("ns", "demo")))
    assert [w[3] for w in kube.writes if w[0] == "dry-run"][-2:] == ["demo-trainer-0", "demo-sampler-0"]
    assert _status(kube)["jobSetName"] == "demo" and _events(kube)[-1] == c.EVENT_JOBSET_CREATED


def test_jobs_of_builds_the_jobs_jobset_makes() -> None:
    from rljob.operator.reconcile import jobs_of

    js = {
        "metadata": {"name": "r", "namespace": "ns", "labels": {"a": "1"}},
        "spec": {
            "replicatedJobs": [
                {"name": "trainer", "template": {"metadata": {"labels": {"b": "2"}}, "spec": {"x": 1}}}
            ]
        },
    }
    ((name, job),) = jobs_of(js)
    assert name == "trainer"
    assert job == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "r-trainer-0", "namespace": "ns", "labels": {"a": "1", "b": "2"}},
        "spec": {"x": 1},
    }


def test_a_plan_that_crashes_fails_the_run_once_with_the_reason() -> None:
    """A bug in planning is permanent for the generation: Failed with the reason, never retried forever."""

    def broken(job: Any) -> Any:
        raise ZeroDivisionError("division by zero")

    plan = make_plan(rljob(), broken)
    assert plan.error is not None and plan.error.startswith("spec: rljob failed to plan this RLJob")
    assert "ZeroDivisionError" in plan.error
    kube = MemoryKube()
    kube.objects[("RLJob", "ns", "demo")] = rljob()
    rec = Reconciler(kube, broken)  # type: ignore[arg-type]
    rec.observe_rljob(None, rljob())
    run(rec.reconcile(("ns", "demo")))
    assert (
        _status(kube)["phase"] == "Failed" and _status(kube)["lastFailure"]["reason"] == c.REASON_INVALID_SPEC
    )
    assert not [w for w in kube.writes if w[0] in ("create", "apply")]


def test_an_upgrade_that_cannot_plan_a_running_run_tracks_its_jobset_to_the_end() -> None:
    """An RLJob admitted by an older operator whose spec this version refuses: its JobSet keeps running
    and is followed (phase, restarts, outcome), never recreated; Accepted=False says why."""
    from rljob.recipes.plan import PlanError

    rec, kube = setup(rljob(failurePolicy={"maxRestarts": 5}))
    run(rec.reconcile(("ns", "demo")))
    js = kube.objects[("JobSet", "ns", "demo")]

    def stricter(job: Any) -> Any:
        raise PlanError(["spec.trainer.maxtext.remat_policy: not a MaxText 0.2.6 config key"])

    upgraded = Reconciler(kube, stricter)  # type: ignore[arg-type]
    upgraded.observe_jobset(None, js)
    upgraded.observe_progress(None, kube.objects[("ConfigMap", "ns", "demo-progress")])
    upgraded.observe_rljob(None, kube.objects[("RLJob", "ns", "demo")])
    kube.writes.clear()
    run(upgraded.reconcile(("ns", "demo")))
    status = _status(kube)
    accepted = _condition(kube, c.ACCEPTED)
    # The budgets come from the JobSet's annotations (the spec no longer plans).
    assert status["phase"] == "Pending" and status["restarts"] == {
        "used": 0,
        "left": 5,
        "trainer": {"used": 0, "left": 5},
        "sampler": {"used": 0, "left": 10},
    }
    assert (accepted["status"], accepted["reason"]) == ("False", c.REASON_SPEC_NO_LONGER_PLANS)
    assert "remat_policy" in accepted["message"]
    assert _events(kube) == [c.REASON_SPEC_NO_LONGER_PLANS]
    assert not [w for w in kube.writes if w[0] in ("create", "apply")]
    # The JobSet finishes: the run succeeds.
    js["status"] = {"terminalState": "Completed", "conditions": [{"type": "Completed", "status": "True"}]}
    js["metadata"]["resourceVersion"] = "999"
    upgraded.observe_jobset("MODIFIED", js)
    run(upgraded.reconcile(("ns", "demo")))
    assert _status(kube)["phase"] == "Succeeded"


def test_the_start_up_warm_up_plans_without_a_problem(caplog: pytest.LogCaptureFixture) -> None:
    """rljob.operator.plans.warm_up builds the plan path's caches at start-up; its RLJob must plan (a
    refusal would be logged, and the caches it meant to fill would stay cold)."""
    from rljob.operator.plans import warm_up

    with caplog.at_level("WARNING", logger="rljob.operator.reconcile"):
        warm_up(render)
    assert caplog.records == []


def failed_create(job: str, message: str, seconds_ago: float = 5.0) -> dict[str, Any]:
    """A core/v1 Event as the Job controller records a refused pod."""
    when = (datetime.now(UTC) - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "involvedObject": {"kind": "Job", "name": job, "namespace": "ns"},
        "reason": "FailedCreate",
        "type": "Warning",
        "message": message,
        "lastTimestamp": when,
    }


PSA = (
    'Error creating: pods "demo-trainer-0-0-x" is forbidden: violates PodSecurity "restricted:latest": '
    'allowPrivilegeEscalation != false (container "trainer" must set '
    "securityContext.allowPrivilegeEscalation=false)"
)


def test_pods_the_api_server_refuses_are_a_condition_and_an_event_until_they_come(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Job controller records a pod create the API server refused (Pod Security admission, a quota) as
    a FailedCreate event of the Job; the JobSet says nothing. While the run waits for pods, the reconcile
    reads those events of the run's Jobs: Ready=False (PodCreateFailed) with the API server's message and a
    Warning event, re-read every POD_CREATE_POLL_S (the key is requeued); gone when the events stop."""
    rec, kube = setup(rljob())
    requeued: list[tuple[Any, float]] = []
    monkeypatch.setattr(rec.queue, "add_after", lambda key, delay: requeued.append((key, delay)))
    run(rec.reconcile(("ns", "demo")))
    rec.observe_jobset("ADDED", kube.objects[("JobSet", "ns", "demo")])
    rec.observe_rljob("MODIFIED", kube.objects[("RLJob", "ns", "demo")])
    kube.events = [
        failed_create("demo-trainer-0", PSA),
        failed_create("other-trainer-0", "another run's refusal"),  # not this run's Job
        failed_create("demo-sampler-0", "an old refusal that stopped", seconds_ago=3600),
    ]
    rec._pod_create.clear()  # as after POD_CREATE_POLL_S
    run(rec.reconcile(("ns", "demo")))
    assert ("events", "involvedObject.kind=Job,reason=FailedCreate") in kube.lists
    ready = _condition(kube, c.READY)
    assert (_status(kube)["phase"], ready["status"], ready["reason"]) == (
        "Pending",
        "False",
        c.REASON_POD_CREATE_FAILED,
    )
    assert (
        ready["message"].startswith("Job demo-trainer-0: Error creating")
        and "PodSecurity" in ready["message"]
    )
    assert _events(kube)[-1] == c.REASON_POD_CREATE_FAILED
    assert requeued[-1] == (("ns", "demo"), POD_CREATE_POLL_S)  # looked at again later
    # Within the poll interval the list is not repeated.
    lists = len(kube.lists)
    rec.observe_rljob("MODIFIED", kube.objects[("RLJob", "ns", "demo")])
    run(rec.reconcile(("ns", "demo")))
    assert len(kube.lists) == lists
    # The namespace is fixed, the pods come: no new refusal, the condition is back to waiting.
    kube.events = []
    rec._pod_create.clear()
    rec.observe_rljob("MODIFIED", kube.objects[("RLJob", "ns", "demo")])
    run(rec.reconcile(("ns", "demo")))
    assert _condition(kube, c.READY)["reason"] == c.REASON_WAITING_FOR_PODS


def test_failed_create_events_match_the_runs_jobs_by_exact_name() -> None:
    """RLJob `a`'s Jobs are a-trainer-0 and a-sampler-0; RLJob `a-b`'s (a-b-trainer-0, ...) and a Job named
    like a prefix of `a`'s are another's: their refusals are not `a`'s."""
    from rljob.operator.status.pods import pod_create_error
    from rljob.operator.status.views import JobSetView

    js = JobSetView.from_body(
        {
            "metadata": {"name": "a", "uid": "u"},
            "spec": {
                "replicatedJobs": [{"name": "trainer", "replicas": 1}, {"name": "sampler", "replicas": 2}]
            },
        }
    )
    now = datetime.now(UTC)
    others = ["a-b-trainer-0", "a-trainer-0-x", "a-sampler-2", "a-trainer", "b-trainer-0"]
    assert pod_create_error([failed_create(n, "not a's") for n in others], js, now) is None  # 5 refused
    for name in ("a-trainer-0", "a-sampler-0", "a-sampler-1"):
        got = pod_create_error(
            [failed_create(n, "not a's") for n in others] + [failed_create(name, PSA)], js, now
        )
        assert got is not None and got.startswith(f"Job {name}: Error creating")


def test_a_suspended_or_running_run_reads_no_events() -> None:
    rec, kube = setup(rljob(suspend=True))
    run(rec.reconcile(("ns", "demo")))
    rec.observe_jobset("ADDED", kube.objects[("JobSet", "ns", "demo")])
    run(rec.reconcile(("ns", "demo")))
    assert [x for x in kube.lists if x[0] == "events"] == []
