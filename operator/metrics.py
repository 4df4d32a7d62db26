"""Prometheus metrics of the operator, served at :<port>/metrics (chart value `metrics.port`).

In the chart's Deployment the endpoint is HTTPS (the webhook's certificate) and answers only callers the
API server authorizes (`Authorizer`); a local process (tests, development) serves plain HTTP on the
address it is given."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from rljob.recipes.api import Phase

API_REQUESTS: Final = Counter(
    "rljob_operator_api_requests",
    "Requests the operator made to the API server outside kopf's watches, by verb, resource and HTTP code.",
    ["verb", "resource", "code"],
)
RECONCILES: Final = Counter(
    "rljob_operator_reconciles", "Reconciles of one RLJob, by result (ok, error).", ["result"]
)
RECONCILE_SECONDS: Final = Histogram(
    "rljob_operator_reconcile_seconds",
    "Duration of one reconcile (render, writes, status).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
PLANS: Final = Counter(
    "rljob_operator_plans",
    "Plans (parse + render) the webhook and the reconcile asked for, by result: hit (reused), miss (made).",
    ["result"],
)
QUEUE_DEPTH: Final = Gauge("rljob_operator_queue_depth", "RLJobs waiting to be reconciled.")
RLJOBS: Final = Gauge("rljob_operator_rljobs", "RLJobs known to the operator, by phase.", ["phase"])

# (namespace, name, status) of every RLJob the operator knows (its cache; the status as stored, camelCase).
RunSource = Callable[[], Iterable[tuple[str, str, Mapping[str, Any]]]]
RUN_LABELS = ("namespace", "name")


class RunCollector:
    """Series per RLJob (docs/operator.md, "Metrics"), made at each scrape from the operator's cache of
    RLJobs and their status: an RLJob deleted (gone from the cache) has no series from the next scrape
    on, so nothing has to be removed. A series without a value yet (no step reported) is left out."""

    def __init__(self) -> None:
        self.source: RunSource = lambda: ()
        self.clock: Callable[[], float] = time.time

    def describe(self) -> list[Metric]:
        return []  # not collected at registration (the cache does not exist yet)

    def collect(self) -> Iterator[Metric]:
        def family(name: str, text: str, *extra: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, text, labels=[*RUN_LABELS, *extra])

        step = family("rljob_run_step", "The trainer's last completed optimizer step (status.progress.step).")
        reward = family("rljob_run_reward_mean", "Mean reward of the last step's rollouts.")
        checkpoint = family("rljob_run_last_checkpoint_step", "Step of the run's newest checkpoint.")
        since = family(
            "rljob_run_seconds_since_last_step",
            "Seconds since the trainer's last progress report (status.progress.updateTime), one per step.",
        )
        restarts = family(
            "rljob_run_restarts",
            "Counted restarts per role: trainer (of the whole run; under samplerFailure RestartRun also a "
            "sampler crash) and sampler (of single sampler Jobs).",
            "role",
        )
        phase = family("rljob_run_phase", "1 for the RLJob's phase, 0 for the others.", "phase")
        now = self.clock()
        for namespace, name, status in self.source():
            labels = [namespace, name]
            progress = status.get("progress") or {}
            if isinstance(progress.get("step"), int):
                step.add_metric(labels, progress["step"])
            if isinstance(progress.get("rewardMean"), int | float):
                reward.add_metric(labels, float(progress["rewardMean"]))
            if isinstance(progress.get("lastCheckpointStep"), int):
                checkpoint.add_metric(labels, progress["lastCheckpointStep"])
            when = _timestamp(progress.get("updateTime"))
            if when is not None:
                since.add_metric(labels, max(0.0, now - when))
            for role, counted in (status.get("restarts") or {}).items():
                if role in ("trainer", "sampler") and isinstance(counted, Mapping):
                    restarts.add_metric([*labels, role], int(counted.get("used") or 0))
            current = str(status.get("phase") or Phase.PENDING.value)
            for p in Phase:
                phase.add_metric([*labels, p.value], 1.0 if p.value == current else 0.0)
        yield from (step, reward, checkpoint, since, restarts, phase)


def _timestamp(value: Any) -> float | None:
    """Seconds since the epoch of an RFC 3339 time as the API stores it, else None."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


RUNS: Final = RunCollector()
REGISTRY.register(RUNS)


async def _metrics(_: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


class Authorizer:
    """Who may read /metrics, decided by the API server as for any Kubernetes endpoint: the caller's bearer
    token is checked with a TokenReview, then a SubjectAccessReview asks whether that user may `get` the
    non-resource URL /metrics (grant it with a ClusterRole rule `nonResourceURLs: ["/metrics"], verbs:
    ["get"]`, as Prometheus' own ServiceAccount usually has). controller-runtime protects its metrics the
    same way (filters.WithAuthenticationAndAuthorization). Answers are cached by a hash of the token, an
    allowed one for `ttl_s` (a scrape every few seconds costs two API calls a minute), a refusal for
    `denied_ttl_s` (a permission just granted works within seconds).

    A flood of unknown tokens cannot starve the reconcile nor lock the scrapers out: the answers are kept
    in two bounded LRU caches, the allowed ones apart (`size` each; a full cache drops its least recently
    used entry, never all of them), so refusals never evict an allowed scraper; at most `concurrency`
    reviews are in flight and at most `rate_per_s` start a second (a bucket of `burst`): a token that would
    need a review beyond that is answered 429 at once, with no API call. The operator gives it an API client
    of its own (handlers.on_startup), so its reviews never queue behind the reconcile's requests."""

    def __init__(
        self,
        request: Requester,
        *,
        ttl_s: float = 60.0,
        denied_ttl_s: float = 5.0,
        size: int = 256,
        concurrency: int = 4,
        rate_per_s: float = 5.0,
        burst: int = 20,
    ) -> None:
        self._request = request
        self._ttl = ttl_s
        self._denied_ttl = denied_ttl_s
        self._size = size
        self._allowed: OrderedDict[str, float] = OrderedDict()
        self._denied: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._slots = asyncio.Semaphore(concurrency)
        self._rate, self._burst = rate_per_s, float(burst)
        self._tokens, self._filled = float(burst), time.monotonic()

    def _take(self, now: float) -> bool:
        """One review from the bucket, if there is one left."""
        self._tokens = min(self._burst, self._tokens + max(0.0, now - self._filled) * self._rate)
        self._filled = now
        if self._tokens < 1 or self._slots.locked():
            return False
        self._tokens -= 1
        return True

    async def status(self, authorization: str | None) -> int:
        """200 when the token may read /metrics, 401 without a valid token, 403 without the permission, 429
        when a review is needed and the reviews' budget is spent."""
        token = (authorization or "").removeprefix("Bearer ").strip()
        if not authorization or not authorization.startswith("Bearer ") or not token:
            return 401
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        until = self._allowed.get(key)
        if until is not None and until > now:
            self._allowed.move_to_end(key)
            return 200
        hit = self._denied.get(key)
        if hit is not None and hit[0] > now:
            self._denied.move_to_end(key)
            return hit[1]
        if not self._take(now):
            return 429
        async with self._slots:
            code = await self._review(token)
        now = time.monotonic()
        if code == 200:
            self._denied.pop(key, None)
            _put(self._allowed, key, now + self._ttl, self._size)
        else:
            self._allowed.pop(key, None)
            _put(self._denied, key, (now + self._denied_ttl, code), self._size)
        return code

    async def _review(self, token: str) -> int:
        review = await self._request(
            "POST",
            "/apis/authentication.k8s.io/v1/tokenreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}},
        )
        status = review.get("status") or {}
        if not status.get("authenticated"):
            return 401
        user = status.get("user") or {}
        access = await self._request(
            "POST",
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": user.get("username"),
                    "uid": user.get("uid"),
                    "groups": user.get("groups") or [],
                    "extra": user.get("extra") or {},
                    "nonResourceAttributes": {"path": "/metrics", "verb": "get"},
                },
            },
        )
        return 200 if (access.get("status") or {}).get("allowed") else 403


def _put(cache: OrderedDict[str, Any], key: str, value: Any, size: int) -> None:
    """`key` -> `value` as the most recently used entry; the least recently used one goes past `size`."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


# (method, path, body) -> the API's JSON answer (k8s.Kube.request bound to a resource label).
Requester = Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]


def _guard(auth: Authorizer) -> Any:
    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            code = await auth.status(request.headers.get("Authorization"))
        except Exception as exc:  # the API server is unreachable: refuse, say why
            return web.Response(status=503, text=f"cannot check the caller's access: {exc}\n")
        if code != 200:
            reason = {
                401: "a bearer token is required",
                429: "too many callers to review: retry later",
            }.get(code, "get on /metrics is not allowed")
            headers = {"Retry-After": "1"} if code == 429 else None
            return web.Response(status=code, text=f"{reason}\n", headers=headers)
        response: web.StreamResponse = await handler(request)
        return response

    return guard


async def start_server(
    host: str, port: int, *, auth: Authorizer | None = None, ssl_context: ssl.SSLContext | None = None
) -> web.AppRunner:
    """Serve /metrics on host:port in the operator's event loop (HTTPS with `ssl_context`, only to callers
    `auth` allows when given); the caller cleans the runner up."""
    app = web.Application(middlewares=[_guard(auth)] if auth is not None else [])
    app.router.add_get("/metrics", _metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner
