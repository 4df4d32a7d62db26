"""What the watches told the operator: RLJobs, their JobSets, compile preflight Jobs, progress reports and pod
failures,
keyed by the owning RLJob, the newest resourceVersion winning. The reconcile reads only these (no GETs)."""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from rljob.operator import conditions as c
from rljob.operator import metrics
from rljob.operator.plans import Plan
from rljob.operator.status.pods import PodFailure
from rljob.operator.status.preflight import PreflightPod, PreflightView
from rljob.operator.status.views import JobSetView, controller_uid
from rljob.operator.workqueue import Key
from rljob.recipes.api import API_VERSION, KIND, Phase


def newer(rv_new: str, rv_old: str | None) -> bool:
    """Whether resourceVersion `rv_new` is at least as new as `rv_old`.

    Kubernetes >= 1.35 documents resourceVersions as comparable integers (KEP-5504); anything that is not
    an integer is treated as newer, so the cache always moves forward."""
    if not rv_old:
        return True
    try:
        return int(rv_new) >= int(rv_old)
    except ValueError:
        return True


@dataclasses.dataclass(slots=True)
class RLJobEntry:
    body: dict[str, Any]  # apiVersion, kind, metadata (name, namespace, uid, generation, rv), spec, status

    @property
    def rv(self) -> str:
        return str(self.body["metadata"].get("resourceVersion", ""))

    @property
    def generation(self) -> int:
        return int(self.body["metadata"].get("generation") or 0)

    @property
    def status(self) -> dict[str, Any] | None:
        s = self.body.get("status")
        return s if isinstance(s, dict) else None


@dataclasses.dataclass(slots=True)
class ProgressEntry:
    rv: str
    report: dict[str, Any] | None
    owner_uid: str = ""  # the controller owner's uid: only the RLJob's own ConfigMap counts


def slim_rljob(body: Mapping[str, Any]) -> dict[str, Any]:
    """Only what the reconcile reads (no managedFields, annotations or server noise): memory at scale."""
    meta = body.get("metadata") or {}
    keep = ("name", "namespace", "uid", "generation", "resourceVersion", "deletionTimestamp", "labels")
    return {
        "apiVersion": body.get("apiVersion", API_VERSION),
        "kind": body.get("kind", KIND),
        "metadata": {k: meta[k] for k in keep if k in meta},
        "spec": body.get("spec") or {},
        "status": body.get("status"),
    }


def _phase_of(entry: RLJobEntry | None) -> str | None:
    if entry is None:
        return None
    return str((entry.status or {}).get("phase") or Phase.PENDING.value)


class Caches:
    """What the watches told us, keyed by the owning RLJob, newest resourceVersion wins."""

    def __init__(self) -> None:
        self.rljobs: dict[Key, RLJobEntry] = {}
        self.jobsets: dict[Key, JobSetView] = {}
        self.progress: dict[Key, ProgressEntry] = {}
        self.failures: dict[Key, PodFailure] = {}
        # Compile preflight Jobs per RLJob, by name (a run whose compiled programs change gets a new one),
        # and the newest failed preflight pod's word (its exit code and termination message).
        self.preflights: dict[Key, dict[str, PreflightView]] = {}
        self.preflight_pods: dict[Key, PreflightPod] = {}
        self.plans: dict[Key, Plan] = {}  # the last plan per RLJob (error text and maxRestarts only)
        # RLJobs per phase (an RLJob without a status yet counts as Pending): the gauge rljob_operator_rljobs.
        self.phases: collections.Counter[str] = collections.Counter({p.value: 0 for p in Phase})
        for phase in self.phases:
            metrics.RLJOBS.labels(phase).set(0)
        metrics.RUNS.source = self.statuses  # the series per RLJob (rljob_run_*)

    def statuses(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(namespace, name, status) of every RLJob known, for the series per RLJob."""
        return [(ns, name, entry.status or {}) for (ns, name), entry in list(self.rljobs.items())]

    def _count(self, old: RLJobEntry | None, new: RLJobEntry | None) -> None:
        before, after = _phase_of(old), _phase_of(new)
        if before == after:
            return
        for phase, delta in ((before, -1), (after, 1)):
            if phase is not None:
                self.phases[phase] += delta
                metrics.RLJOBS.labels(phase).set(self.phases[phase])

    def put_rljob(self, body: Mapping[str, Any]) -> bool:
        """Store; True if the RLJob is new or changed in a way that needs a reconcile."""
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        old = self.rljobs.get(key)
        if old is not None and old.body["metadata"].get("uid") == meta.get("uid"):
            if not newer(str(meta.get("resourceVersion", "")), old.rv):
                return False
            changed = old.generation != int(meta.get("generation") or 0) or old.status != body.get("status")
            changed = changed or ("deletionTimestamp" in meta) != (
                "deletionTimestamp" in old.body["metadata"]
            )
        else:
            changed = True
        self.rljobs[key] = RLJobEntry(slim_rljob(body))
        self._count(old, self.rljobs[key])
        return changed

    def drop_rljob(self, key: Key) -> None:
        self._count(self.rljobs.get(key), None)
        stores = (self.rljobs, self.jobsets, self.progress, self.failures, self.plans, self.preflights)
        for store in (*stores, self.preflight_pods):
            store.pop(key, None)

    def put_jobset(self, key: Key, body: Mapping[str, Any]) -> bool:
        view = JobSetView.from_body(body)
        old = self.jobsets.get(key)
        if old is not None and old.uid == view.uid and not newer(view.resource_version, old.resource_version):
            return False
        self.jobsets[key] = view
        return old != view

    def drop_jobset(self, key: Key, uid: str) -> None:
        old = self.jobsets.get(key)
        if old is not None and (not uid or old.uid == uid):
            del self.jobsets[key]

    def put_preflight(self, key: Key, body: Mapping[str, Any]) -> bool:
        view = PreflightView.from_body(body)
        jobs = self.preflights.setdefault(key, {})
        old = jobs.get(view.name)
        if old is not None and old.uid == view.uid and not newer(view.resource_version, old.resource_version):
            return False
        jobs[view.name] = view
        return old != view

    def drop_preflight(self, key: Key, name: str, uid: str) -> None:
        jobs = self.preflights.get(key) or {}
        old = jobs.get(name)
        if old is not None and (not uid or old.uid == uid):
            del jobs[name]

    def put_preflight_pod(self, key: Key, pod: PreflightPod) -> bool:
        if self.preflight_pods.get(key) == pod:
            return False
        self.preflight_pods[key] = pod
        return True

    def put_progress(self, key: Key, body: Mapping[str, Any]) -> bool:
        rv = str((body.get("metadata") or {}).get("resourceVersion", ""))
        old = self.progress.get(key)
        if old is not None and not newer(rv, old.rv):
            return False
        raw = (body.get("data") or {}).get(c.PROGRESS_KEY)
        report: dict[str, Any] | None = None
        if raw:
            try:
                loaded = json.loads(raw)
                report = loaded if isinstance(loaded, dict) else None
            except ValueError:
                report = None
        owner = controller_uid(body.get("metadata") or {})
        self.progress[key] = ProgressEntry(rv, report, owner)
        return old is None or (old.report, old.owner_uid) != (report, owner)

    def put_failure(self, key: Key, failure: PodFailure) -> bool:
        """Keep the first failure of the newest attempt: the cause, not the pods it took down."""
        old = self.failures.get(key)
        if old is not None and (
            old.attempt > failure.attempt or (old.attempt == failure.attempt and old.time <= failure.time)
        ):
            return False
        self.failures[key] = failure
        return True

    def key_of_child(self, body: Mapping[str, Any]) -> Key | None:
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        name = labels.get(c.LABEL_NAME)
        if name is None:
            jobset = labels.get(c.JOBSET_NAME_LABEL)
            if jobset is None:
                return None
            name = jobset  # JobSet name == RLJob name (rljob.recipes.naming.jobset)
        return (str(meta.get("namespace", "")), str(name))
