"""The reconcile service: desired state (the recipe render) vs actual state (caches), then one status write.

Level-based, as kopf's own docs recommend for serious operators (docs/reconciliation.rst): kopf's watch
streams only feed in-memory caches (`Caches`, operator/cache.py) and mark the owning RLJob dirty in a
de-duplicating work queue (`WorkQueue`, operator/workqueue.py, client-go's semantics: a key is queued at
most once, and a key that changes while being reconciled is reconciled again afterwards). A fixed pool of
workers then reconciles one RLJob at a time per key:

1. read the RLJob, its JobSet, its progress report and the newest pod failure from the caches (no GETs);
2. if the run is not finished and its JobSet does not exist: with the compile preflight on
   (spec.trainer.preflight.compile), create the run's objects and the preflight Job first, and the JobSet
   only once that Job succeeded (a refusal or a failure creates nothing more: no TPU is requested); then
   render (`rljob.recipes.render`, the same
   function `rljob render` prints; the admission webhook's render of the same input is reused, see
   `PlanCache` in operator/plans.py) and create the objects, the progress ConfigMap and the JobSet, with
   owner references, labels and the fixed field manager (server-side apply for any that exists already); if
   `suspend` or `queueName` differ: patch the JobSet;
3. derive the complete new status (`rljob.operator.status.phase.derive_status`, pure);
4. write it with exactly one server-side apply of `.status` if it differs from what is stored;
5. post the events of the transitions, after the status write.

Write responses update the caches at once, so a reconcile triggered by our own write's watch event finds
nothing to do. With no changes, a reconcile makes no API call at all.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pydantic
from rljob.common.credentials import new_token
from rljob.operator import conditions as c
from rljob.operator import k8s, kueue, metrics
from rljob.operator.cache import Caches, ProgressEntry, RLJobEntry
from rljob.operator.jobset_gate import RestartJobGate
from rljob.operator.plans import Plan, PlanCache, Renderer
from rljob.operator.status.observed import Observed
from rljob.operator.status.phase import TERMINAL, derive_status, status_body
from rljob.operator.status.pods import classify_pod, pod_create_error
from rljob.operator.status.preflight import preflight_outcome, preflight_pod
from rljob.operator.status.restarts import stop_jobset
from rljob.operator.status.views import JobSetView
from rljob.operator.workqueue import Key, WorkQueue
from rljob.recipes import naming
from rljob.recipes.api import (
    API_VERSION,
    KIND,
    Phase,
    PreflightState,
    PreflightStatus,
    ProgressReport,
    RLJobStatus,
)
from rljob.recipes.render import run_labels
from rljob.recipes.runconfig import RUN_TOKEN_SECRET_KEY

logger = logging.getLogger(__name__)

# How often a run that waits for its pods has its Jobs' FailedCreate events read (and is looked at again).
POD_CREATE_POLL_S = 20.0


def owned(obj: Mapping[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    """`obj` with the RLJob's labels and a controller owner reference (garbage collection on delete)."""
    out: dict[str, Any] = json.loads(json.dumps(obj))
    meta = out.setdefault("metadata", {})
    omd = owner["metadata"]
    meta["namespace"] = omd["namespace"]
    meta.setdefault("labels", {})[c.LABEL_NAME] = omd["name"]
    meta["ownerReferences"] = [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": omd["name"],
            "uid": omd["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    return out


def progress_configmap(owner: Mapping[str, Any]) -> dict[str, Any]:
    """The `<rljob>-progress` ConfigMap (contract 4); the trainer patches key progress.json in it."""
    name = naming.progress_configmap(owner["metadata"]["name"])
    cm = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": {c.LABEL_PROGRESS: "true"}},
    }
    return owned(cm, owner)


def credentials_secret(owner: Mapping[str, Any]) -> dict[str, Any]:
    """The `<rljob>-credentials` Secret: a new random token (rljob.common.credentials), which every port of
    the run requires and every container gets through a secretKeyRef of the render. Immutable; created once
    (k8s.Kube.create keeps an existing one of this RLJob: its pods may hold the token already)."""
    name = owner["metadata"]["name"]
    token = base64.b64encode(new_token().encode()).decode()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": naming.credentials_secret(name), "labels": run_labels(name)},
        "type": "Opaque",
        "immutable": True,
        "data": {RUN_TOKEN_SECRET_KEY: token},
    }
    return owned(secret, owner)


# ------------------------------------------------------------------------------------------ service


class Reconciler:
    """Caches + work queue + workers; `reconcile(key)` is the one place that decides and writes."""

    def __init__(
        self,
        kube: k8s.Kube,
        render: Renderer,
        *,
        workers: int = 8,
        resync_s: float = 600.0,
        plans: PlanCache | None = None,
        namespaces: Sequence[str] = (),
        gate: RestartJobGate | None = None,
    ) -> None:
        self.kube = kube
        self.namespaces = tuple(namespaces)  # () serves every namespace
        self.render = render
        self.plans = plans if plans is not None else PlanCache()
        self.caches = Caches()
        # What the cluster's JobSet admits (an input of `render`): when it flips, every cached plan goes.
        self.gate = gate
        if gate is not None:
            gate.changed = self.forget_plans
        self.queue = WorkQueue()
        self.workers = workers
        self.resync_s = resync_s
        self._tasks: list[asyncio.Task[None]] = []
        self._retries: dict[Key, int] = {}
        # RLJobs whose queued JobSet's Workload this operator deactivated (spec.suspend), by JobSet uid.
        self._deactivated: dict[Key, str] = {}
        # The last read of a waiting run's FailedCreate events: (monotonic time, message).
        self._pod_create: dict[Key, tuple[float, str | None]] = {}

    # ----------------------------------------------------------------------------- watch callbacks

    def observe_rljob(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        if event_type == "DELETED":
            self.caches.drop_rljob(key)
            self._deactivated.pop(key, None)
            self._pod_create.pop(key, None)
            return
        if self.caches.put_rljob(body):
            self.queue.add(key)

    def observe_jobset(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = self.caches.key_of_child(body)
        if key is None:
            return
        if event_type == "DELETED":
            self.caches.drop_jobset(key, str((body.get("metadata") or {}).get("uid", "")))
            self.queue.add(key)
        elif self.caches.put_jobset(key, body):
            self.queue.add(key)

    def observe_progress(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = self.caches.key_of_child(body)
        if key is None:
            return
        if event_type == "DELETED":
            self.caches.progress.pop(key, None)
            self.queue.add(key)
        elif self.caches.put_progress(key, body):
            self.queue.add(key)

    def observe_preflight(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = self.caches.key_of_child(body)
        if key is None:
            return
        if event_type == "DELETED":
            meta = body.get("metadata") or {}
            self.caches.drop_preflight(key, str(meta.get("name", "")), str(meta.get("uid", "")))
            self.queue.add(key)
        elif self.caches.put_preflight(key, body):
            self.queue.add(key)

    def observe_pod(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        key = self.caches.key_of_child(body)
        if c.PREFLIGHT_LABEL in ((body.get("metadata") or {}).get("labels") or {}):
            # A compile preflight pod: its termination message is the preflight's outcome, not a failure
            # of the run's JobSet.
            said = preflight_pod(body)
            if key is not None and said is not None and self.caches.put_preflight_pod(key, said):
                self.queue.add(key)
            return
        failure = classify_pod(body)
        if failure is None or key is None:
            return
        js = self.caches.jobsets.get(key)
        if js is None or not js.owns_pod(body):
            return  # not a pod of the run's JobSet: its label alone does not make it one
        if self.caches.put_failure(key, failure):
            self.queue.add(key)

    # ------------------------------------------------------------------------------------ lifecycle

    async def prefill(self) -> None:
        """List what exists before any worker runs, so a restarted operator never acts on a half-filled
        cache (e.g. re-applying a JobSet it has not seen yet)."""
        scopes: Sequence[str | None] = self.namespaces or (None,)
        for ns in scopes:
            for body in await self.kube.list(k8s.JOBSET, namespace=ns, label_selector=c.LABEL_NAME):
                self.observe_jobset(None, body)
        for ns in scopes:
            for body in await self.kube.list(k8s.JOB, namespace=ns, label_selector=c.PREFLIGHT_LABEL):
                self.observe_preflight(None, body)
        for ns in scopes:
            for body in await self.kube.list(k8s.CONFIGMAP, namespace=ns, label_selector=c.LABEL_PROGRESS):
                self.observe_progress(None, body)
        for ns in scopes:
            for body in await self.kube.list(k8s.RLJOB, namespace=ns):
                self.observe_rljob(None, body)

    def start(self) -> None:
        for i in range(self.workers):
            self._tasks.append(asyncio.create_task(self._worker(), name=f"rljob-reconcile-{i}"))
        self._tasks.append(asyncio.create_task(self._resync(), name="rljob-resync"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.resync_s)
            for key in list(self.caches.rljobs):
                self.queue.add(key)

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            started = time.perf_counter()
            try:
                await self.reconcile(key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                tries = self._retries.get(key, 0) + 1
                self._retries[key] = tries
                delay = min(60.0, 0.5 * 2**tries)
                metrics.RECONCILES.labels("error").inc()
                logger.warning("reconcile %s/%s failed (retry in %.1fs): %s", key[0], key[1], delay, exc)
                self.queue.add_after(key, delay)
            else:
                self._retries.pop(key, None)
                metrics.RECONCILES.labels("ok").inc()
            finally:
                metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)
                self.queue.done(key)

    # ------------------------------------------------------------------------------------ reconcile

    def forget_plans(self) -> None:
        """Drop every plan made so far (the render's inputs changed: rljob.operator.jobset_gate)."""
        self.plans.clear()
        self.caches.plans.clear()

    def plan_for(self, key: Key, entry: RLJobEntry) -> Plan:
        plan = self.caches.plans.get(key)
        if plan is None or plan.generation != entry.generation:
            plan = self.plans.make_plan(entry.body, self.render)
            # Keep only the error and maxRestarts in memory; the objects are rendered again if needed.
            self.caches.plans[key] = dataclasses.replace(plan, objects=())
        return plan

    async def reconcile(self, key: Key) -> None:
        entry = self.caches.rljobs.get(key)
        if entry is None or "deletionTimestamp" in entry.body["metadata"]:
            return
        body = entry.body
        uid = str(body["metadata"].get("uid") or "")
        prior = _prior_status(entry.status)
        latched = prior is not None and prior.phase in TERMINAL
        spec = body.get("spec") or {}
        plan = self.plan_for(key, entry)
        created = False
        preflight: PreflightStatus | None = None  # this plan's compile preflight (None: off, or not yet)
        preflight_created = False
        create_error: tuple[str, str] | None = None
        refused = False  # a Job the API server refuses: not retried until the RLJob or a resync changes it

        # Only children whose controller owner reference is this RLJob (by uid) are ever read, patched or
        # counted; another object of the same name is reported, never adopted (k8s.Kube.create).
        js = self._owned_jobset(key, uid)
        if not latched and js is None and not (prior and prior.job_set_name):
            if plan.error is None:
                preflight = self._preflight(key, uid, plan, prior)
                try:
                    if plan.preflight_job is not None and preflight is None:
                        await self._create_children(key, body, plan, preflight_only=True)
                        preflight_created = True
                        preflight = PreflightStatus(job=plan.preflight_job, state=PreflightState.RUNNING)
                    elif preflight is None or preflight.state == PreflightState.SUCCEEDED:
                        await self._create_children(key, body, plan)
                        created = True
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    create_error = _create_error(exc)
                    refused = isinstance(exc, JobRefused)
                    if self.gate is not None and self.gate.refused(str(exc)):
                        refused = False  # planned again without RestartJob at the retry
        elif not latched and js is not None:
            if self._owned_progress(key, uid) is None:
                try:
                    self.caches.put_progress(key, await self.kube.create(progress_configmap(body)))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    create_error = _create_error(exc)
            # The two mutable fields need no plan: also done for a JobSet tracked after an upgrade that
            # can no longer plan its spec.
            await self._reconcile_mutable(key, js, spec, prior)

        js = self._owned_jobset(key, uid)
        progress = self._owned_progress(key, uid)
        report = None
        if progress is not None and progress.report is not None:
            report = _parse_progress(progress.report)
        pod_create = await self._pod_create_error(key, js, prior, latched, created)
        failure = self.caches.failures.get(key)
        if failure is not None and (js is None or failure.jobset_uid != js.uid):
            failure = None  # a pod of another JobSet (an earlier run's, or one that is not ours)
        max_restarts, max_sampler_restarts = plan.max_restarts, plan.max_sampler_restarts
        if plan.error is not None and js is not None and js.max_restarts is not None:
            max_restarts = js.max_restarts
            max_sampler_restarts = js.max_sampler_restarts or 0
        derived = derive_status(
            Observed(
                generation=entry.generation,
                now=datetime.now(UTC).replace(microsecond=0),
                prior=prior,
                spec_error=plan.error,
                suspend=bool(spec.get("suspend", False)),
                queue_name=spec.get("queueName") or (js.queue_name if js is not None else None),
                max_restarts=max_restarts,
                max_sampler_restarts=max_sampler_restarts,
                jobset_name=(plan.jobset or {}).get("metadata", {}).get("name") if plan.objects else None,
                jobset=js,
                failure=failure,
                progress=report,
                api_url=plan.api_url if plan.objects else None,
                create_error=create_error,
                pod_create_error=pod_create,
                preflight=preflight,
                sampler_failure=plan.sampler_failure,
            )
        )
        new_status = status_body(derived.status)
        if prior is None or status_body(prior) != new_status:
            try:
                resp = await self.kube.apply_status(k8s.RLJOB, key[0], key[1], new_status)
            except k8s.ApiError as exc:
                if exc.status == 404:
                    return  # deleted meanwhile
                raise
            self.caches.put_rljob(resp)
        events = list(derived.events)
        if preflight_created:
            note = f"created Job {plan.preflight_job}: the compile preflight, before the JobSet"
            await self.kube.post_event(body, type_="Normal", reason=c.EVENT_PREFLIGHT_CREATED, note=note)
        if created:
            # One event for a new run: the creation, with the phase it starts in.
            note = f"created JobSet {key[1]}; phase {derived.status.phase}"
            events = [e for e in events if e.reason != c.EVENT_SUSPENDED]
            await self.kube.post_event(body, type_="Normal", reason=c.EVENT_JOBSET_CREATED, note=note)
        for ev in events:
            await self.kube.post_event(body, type_=ev.type, reason=ev.reason, note=ev.message)
        if stop_jobset(derived.status, js) and js is not None:
            # After the Failed status is written (latched): a role past its restart budget stops the run.
            # Suspended (through Kueue's Workload when queued), not deleted: the operator deletes nothing,
            # and the JobSet stays for inspection until the RLJob is deleted.
            await self._reconcile_mutable(key, js, {**spec, "suspend": True}, prior)
        if create_error is not None and not refused:
            # After the status and the event: the worker retries with backoff.
            raise ChildError(create_error[1])

    async def _pod_create_error(
        self, key: Key, js: JobSetView | None, prior: RLJobStatus | None, latched: bool, created: bool
    ) -> str | None:
        """While a run's JobSet waits for its pods (Pending, not suspended), the Job controller's newest
        FailedCreate of its Jobs: the API server refused their pods (Pod Security admission, a quota), which
        the JobSet does not report. Read at most every POD_CREATE_POLL_S per run, and the run looked at
        again then, so that the refusal shows within that time and clears when the pods come. Not read by the
        reconcile that created the JobSet: its Jobs cannot have refused pods yet."""
        waiting = prior is None or prior.phase in (Phase.PENDING, Phase.RESTARTING)
        if latched or js is None or js.suspended or js.completed or js.failed or not waiting:
            self._pod_create.pop(key, None)
            return None
        now = time.monotonic()
        last = self._pod_create.get(key)
        if last is not None and now - last[0] < POD_CREATE_POLL_S:
            return last[1]
        if created:
            self._pod_create[key] = (now, None)
            self.queue.add_after(key, POD_CREATE_POLL_S)
            return None
        try:
            events = await self.kube.list(
                k8s.CORE_EVENT, namespace=key[0], field_selector="involvedObject.kind=Job,reason=FailedCreate"
            )
        except k8s.ApiError as exc:  # e.g. an operator installed without `list events`: say nothing
            logger.debug("listing FailedCreate events in %s: %s", key[0], exc)
            events = []
        message = pod_create_error(events, js, datetime.now(UTC))
        self._pod_create[key] = (now, message)
        self.queue.add_after(key, POD_CREATE_POLL_S)
        return message

    def _preflight(self, key: Key, uid: str, plan: Plan, prior: RLJobStatus | None) -> PreflightStatus | None:
        """Where this plan's compile preflight stands: from its Job (this RLJob's own, by uid) and its failed
        pod's termination message; else the outcome the status kept (the Job gone after its TTL); None
        when the preflight is off or its Job must be created (also when a running one disappeared)."""
        name = plan.preflight_job
        if name is None:
            return None
        view = (self.caches.preflights.get(key) or {}).get(name)
        if view is not None and uid and view.owner_uid == uid:
            return preflight_outcome(view, self.caches.preflight_pods.get(key))
        kept = prior.preflight if prior is not None else None
        if kept is not None and kept.job == name and kept.state != PreflightState.RUNNING:
            return kept
        return None

    def _owned_jobset(self, key: Key, uid: str) -> JobSetView | None:
        js = self.caches.jobsets.get(key)
        return js if js is not None and uid and js.owner_uid == uid else None

    def _owned_progress(self, key: Key, uid: str) -> ProgressEntry | None:
        entry = self.caches.progress.get(key)
        return entry if entry is not None and uid and entry.owner_uid == uid else None

    async def _create_children(
        self, key: Key, body: Mapping[str, Any], plan: Plan, *, preflight_only: bool = False
    ) -> None:
        """Every object of a new run. In waves: the ServiceAccount, Role, ConfigMaps (the progress one too)
        and the run's credentials Secret concurrently; then the RoleBinding (the API server resolves its
        Role to check escalation: 404 before it exists); then the JobSet, whose pods need all of them, or
        with ``preflight_only`` the compile preflight's Job instead (its pod mounts the run ConfigMap).
        Created (POST), or server-side applied where one of ours exists already (k8s.Kube.create; NotOwned
        for one that is not ours)."""
        if not plan.objects:
            plan = self.plans.make_plan(body, self.render)
        await self._dry_run_jobs(body, plan)
        first = self._owned_progress(key, str(body["metadata"].get("uid") or "")) is None
        for i, wave in enumerate(_waves(plan.objects)):
            wave = [owned(obj, body) for obj in wave]
            if i == 0:
                wave.insert(0, credentials_secret(body))
            if first:
                wave.insert(0, progress_configmap(body))
            resps = await asyncio.gather(*(self.kube.create(obj) for obj in wave))
            if first:
                self.caches.put_progress(key, resps[0])
                first = False
        if preflight_only:
            self.caches.put_preflight(key, await self.kube.create(owned(plan.preflight or {}, body)))
            return
        resp = await self.kube.create(owned(plan.jobset or {}, body))
        self.caches.put_jobset(key, resp)

    async def _dry_run_jobs(self, body: Mapping[str, Any], plan: Plan) -> None:
        """Before anything is created: a server-side dry run of the Job each replicated job of the JobSet
        makes (`jobs_of`). The JobSet controller creates them later, and when the API server refuses one it
        only posts an event on the JobSet: the run would stay Pending with no reason. JobRefused carries
        the API server's message into the status instead."""
        for rj_name, job in jobs_of(owned(plan.jobset or {}, body)):
            try:
                await self.kube.dry_run_create(k8s.JOB, job)
            except k8s.ApiError as exc:
                if exc.status in (400, 403, 422):  # invalid, or refused by an admission webhook or policy
                    raise JobRefused(rj_name, str(exc)) from None
                raise

    async def _reconcile_mutable(
        self, key: Key, js: JobSetView, spec: Mapping[str, Any], prior: RLJobStatus | None
    ) -> None:
        """The two mutable spec fields, in one merge patch of the JobSet when either differs.

        spec.queueName → label kueue.x-k8s.io/queue-name (the CRD allows changing it only while suspended);
        a queue label the operator did not ask for (Kueue's LocalQueue defaulting) is left in place.
        spec.suspend → JobSet spec.suspend, unless the JobSet has a queue: Kueue owns that one's
        spec.suspend, and the operator suspends and resumes through the Workload instead
        (rljob.operator.kueue), so it never unsuspends a JobSet Kueue holds nor re-suspends one it admitted.
        """
        if js.completed or js.failed:
            return
        patch: dict[str, Any] = {}
        queue = spec.get("queueName") or None
        if queue is not None and queue != js.queue_name:
            patch["metadata"] = {"labels": {c.QUEUE_LABEL: queue}}
        want = bool(spec.get("suspend", False))
        if queue or js.queue_name:
            by_user = prior is not None and any(
                x.type == c.SUSPENDED and x.status == "True" and x.reason == c.REASON_SUSPENDED_BY_USER
                for x in prior.conditions
            )
            deactivated = self._deactivated.get(key) == js.uid
            outcome = await kueue.reconcile_suspend(
                self.kube, js, want=want, by_user=by_user, deactivated=deactivated
            )
            if outcome.deactivated:
                self._deactivated[key] = js.uid
            else:
                self._deactivated.pop(key, None)
            patch.update(kueue.outcome_patch(outcome))
        elif js.suspended != want:
            patch["spec"] = {"suspend": want}
        if patch:
            resp = await self.kube.merge_patch(k8s.JOBSET, key[0], js.name, patch)
            self.caches.put_jobset(key, resp)


class ChildError(Exception):
    """A child could not be created; the status says why, the worker retries with backoff."""


class JobRefused(Exception):
    """The API server refuses a Job the JobSet would create (a dry run): permanent for this generation."""

    def __init__(self, replicated_job: str, message: str) -> None:
        self.replicated_job = replicated_job
        super().__init__(
            f"the API server refuses the Jobs of replicated job {replicated_job} (a dry run; nothing was "
            f"created): {message}"
        )


def jobs_of(jobset: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(replicated job name, the first Job the JobSet controller makes of it), as JobSet builds them: the
    replicated job's template with the JobSet's namespace, the name {jobset}-{replicatedJob}-0 and the
    JobSet's labels (what the API server validates is the Job's spec and pod template)."""
    meta = jobset.get("metadata") or {}
    out = []
    for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        template = rj.get("template") or {}
        job_meta = dict(template.get("metadata") or {})
        job_meta.update(
            name=f"{meta.get('name')}-{rj.get('name')}-0",
            namespace=meta.get("namespace"),
            labels={**(meta.get("labels") or {}), **(job_meta.get("labels") or {})},
        )
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": job_meta,
            "spec": template.get("spec") or {},
        }
        out.append((str(rj.get("name")), job))
    return out


def _create_error(exc: Exception) -> tuple[str, str]:
    """(reason, message) of a failed create, for the Ready condition and a Warning event."""
    if isinstance(exc, k8s.NotOwned):
        return c.REASON_NOT_OWNED, str(exc)
    if isinstance(exc, JobRefused):
        return c.REASON_CREATE_FAILED, " ".join(str(exc).split())[:1000]
    if isinstance(exc, k8s.ApiError) and exc.status == 404:
        # POST to a collection that does not exist: the kind is not installed (no JobSet CRD).
        return c.REASON_CREATE_FAILED, f"{exc}: is the JobSet CRD ({naming.JOBSET_API_VERSION}) installed?"
    text = " ".join(str(exc).split())[:900] or type(exc).__name__
    return c.REASON_CREATE_FAILED, f"creating the run's objects failed (retrying): {text}"


_LATER = {"RoleBinding": 1, "Job": 2, "JobSet": 2}


def _waves(objects: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Children other than the JobSet and the preflight Job, grouped by what must exist before them (see
    reconcile)."""
    waves: list[list[dict[str, Any]]] = [[], []]
    for obj in objects:
        rank = _LATER.get(str(obj.get("kind")), 0)
        if rank < 2:
            waves[rank].append(obj)
    return [w for w in waves if w]


def _prior_status(raw: Mapping[str, Any] | None) -> RLJobStatus | None:
    if not raw:
        return None
    try:
        return RLJobStatus.model_validate(raw)
    except pydantic.ValidationError:
        logger.warning("ignoring an unreadable status: %s", raw)
        return None


def _parse_progress(raw: Mapping[str, Any]) -> ProgressReport | None:
    try:
        return ProgressReport.model_validate(raw)
    except pydantic.ValidationError:
        return None
