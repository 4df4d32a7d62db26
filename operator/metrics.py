"""Prometheus metrics of the operator, served at :<port>/metrics (chart value `metrics.port`)."""

from __future__ import annotations

from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

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


async def _metrics(_: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def start_server(host: str, port: int) -> web.AppRunner:
    """Serve /metrics on host:port in the operator's event loop; the caller cleans the runner up."""
    app = web.Application()
    app.router.add_get("/metrics", _metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
