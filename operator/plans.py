"""Plans: an RLJob body -> its rendered objects or the error naming the field, cached by input.

The admission webhook and the reconcile share one `PlanCache`, so the webhook's render of a new RLJob is
reused by the reconcile that follows it. Planning is pure (rljob.recipes); this module only adapts it to
API bodies and bounds what it keeps.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rljob.operator import metrics
from rljob.recipes import failure, naming
from rljob.recipes.api import API_VERSION, KIND, RLJob
from rljob.recipes.failure import SamplerFailure
from rljob.recipes.plan import PlanError, parse_object

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What rendering one generation of an RLJob gives: its objects, or the error naming the field."""

    generation: int
    error: str | None = None
    objects: tuple[dict[str, Any], ...] = ()
    max_restarts: int = 3  # spec.failurePolicy.maxRestarts (the run's budget)
    max_sampler_restarts: int = 10  # spec.failurePolicy.maxSamplerRestarts
    preflight_job: str | None = None  # the compile preflight Job's name (spec.trainer.preflight.compile)
    sampler_failure: SamplerFailure | None = None  # what a sampler crash restarts (rljob.recipes.failure)

    @property
    def jobset(self) -> dict[str, Any] | None:
        return next((o for o in self.objects if o.get("kind") == "JobSet"), None)

    @property
    def preflight(self) -> dict[str, Any] | None:
        return next((o for o in self.objects if o.get("kind") == "Job"), None)

    @property
    def api_url(self) -> str | None:
        """In-cluster URL of the API Service of a run with spec.service (status.url)."""
        svc = next((o for o in self.objects if o.get("kind") == "Service"), None)
        if svc is None:
            return None
        meta, ports = svc["metadata"], svc["spec"]["ports"]
        return naming.service_url(meta["name"], meta["namespace"], int(ports[0]["port"]))


Renderer = Callable[[RLJob], Sequence[dict[str, Any]]]


def parse(body: Mapping[str, Any]) -> RLJob:
    """The RLJob model of an API body (server-added metadata is ignored; status is not parsed): bounded
    and strictly typed, PlanError with every problem (rljob.recipes.plan.parse_object)."""
    return parse_object(_parse_input(body))


def _parse_input(body: Mapping[str, Any]) -> dict[str, Any]:
    """What `parse` reads. Not annotations: the reconcile's cache drops them (`slim_rljob`: kubectl's
    last-applied-configuration alone is a copy of the manifest), so the admission webhook, which shares
    `PlanCache` with the reconcile, must not read them either; the render does not use them."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion", API_VERSION),
        "kind": body.get("kind", KIND),
        "metadata": {k: meta[k] for k in ("name", "namespace", "labels", "uid", "generation") if k in meta},
        "spec": body.get("spec") or {},
    }


class PlanCache:
    """The last plans made, by everything `parse` reads, so that the admission webhook's render of a new
    RLJob is reused by the reconcile that follows it instead of being made again (parse + render take
    ~3 ms of the event loop, which also serves the webhook). Bounded (LRU; a reconcile that lags the
    webhook by more than `size` RLJobs renders again); the objects are kept as JSON text (~14 KB a
    plan) and decoded on every hit, so no caller shares a mutable dict."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._plans: collections.OrderedDict[str, tuple[Plan, str]] = collections.OrderedDict()

    def clear(self) -> None:
        self._plans.clear()

    def make_plan(self, body: Mapping[str, Any], render: Renderer) -> Plan:
        key = json.dumps(_parse_input(body), sort_keys=True, separators=(",", ":"))
        hit = self._plans.get(key)
        if hit is not None:
            metrics.PLANS.labels("hit").inc()
            self._plans.move_to_end(key)
            plan, objects = hit
            return dataclasses.replace(plan, objects=tuple(json.loads(objects)))
        metrics.PLANS.labels("miss").inc()
        plan = make_plan(body, render)
        self._plans[key] = (dataclasses.replace(plan, objects=()), json.dumps(plan.objects))
        while len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return plan


def _generation(body: Mapping[str, Any]) -> int:
    value = (body.get("metadata") or {}).get("generation")
    return value if type(value) is int else 0


def make_plan(body: Mapping[str, Any], render: Renderer) -> Plan:
    """Parse and render; every failure becomes `Plan.error` (a permanent, user-facing error).

    Planning is pure, so any failure is permanent for this generation: an unexpected exception (a bug in
    rljob) is reported like a refusal, naming itself as internal, instead of an HTTP 500 from the webhook
    or a reconcile retried forever."""
    generation = _generation(body)
    try:
        objects = tuple(render(parse(body)))
    except PlanError as exc:
        return Plan(generation, error="\n".join(exc.problems))
    except Exception as exc:
        meta = body.get("metadata") or {}
        logger.exception("planning %s/%s failed", meta.get("namespace"), meta.get("name"))
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return Plan(generation, error=f"spec: rljob failed to plan this RLJob (internal error, {detail})")
    plan = Plan(generation, objects=objects)
    js = plan.jobset
    if js is None:
        return Plan(generation, error="render produced no JobSet")
    budgets = failure.budgets_of(js)
    pre = plan.preflight
    return dataclasses.replace(
        plan,
        max_restarts=budgets[0],
        max_sampler_restarts=budgets[1],
        sampler_failure=failure.sampler_failure_of(js),
        preflight_job=str(pre["metadata"]["name"]) if pre else None,
    )


def warm_up(render: Renderer) -> None:
    """Plan one small RLJob and load every catalog recipe, so that the caches the plan path builds on first
    use (the templates, JobSet's schema validator, MaxText's key sets, pydantic's validators) are built at
    start-up rather than in the first admission request (about half a second on a loaded 2-core machine;
    bench/webhook_worst_case.py)."""
    from rljob.recipes import recipe_catalog

    for name in recipe_catalog.names():
        recipe_catalog.load(name)
    body = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "warm-up", "namespace": "default", "uid": "0", "generation": 1},
        "spec": {
            "model": {"name": "Qwen/Qwen3-8B"},
            "trainer": {"tpu": "v5p-8"},
            "sampler": {"tpu": "v5p-8"},
            "storage": {"root": "gs://warm-up"},
        },
    }
    plan = make_plan(body, render)
    if plan.error is not None:
        logger.warning("the start-up plan failed: %s", plan.error)
