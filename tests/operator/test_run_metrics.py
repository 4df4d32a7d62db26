"""The series per RLJob (rljob_run_*) on the operator's /metrics: scraped over HTTP and parsed as
Prometheus parses the exposition text, with the values of each RLJob's status, and gone once the RLJob is
deleted (dropped from the cache). On a cluster, through the real operator:
test_restart_gate_cluster.py::test_run_series_follow_the_rljob."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rljob.operator import metrics
from rljob.operator.cache import Caches
from rljob.recipes.api import Phase

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _body(name: str, status: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name, "namespace": "team-a", "uid": f"u-{name}", "resourceVersion": "1"},
        "spec": {},
    }
    if status is not None:
        body["status"] = status
    return body


def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics of a server started for the call; the rljob_run_* samples by (name, sorted labels)."""

    async def get() -> str:
        port = _free_port()
        runner = await metrics.start_server("127.0.0.1", port)
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/metrics") as resp,
            ):
                assert resp.status == 200
                return await resp.text()
        finally:
            await runner.cleanup()

    out = {}
    for family in text_string_to_metric_families(asyncio.run(get())):
        for s in family.samples:
            if s.name.startswith("rljob_run_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_series_per_rljob_are_scraped_and_gone_after_delete() -> None:
    caches = Caches()
    metrics.RUNS.clock = lambda: NOW
    running = {
        "phase": "Running",
        "restarts": {
            "used": 1,
            "left": 2,
            "trainer": {"used": 1, "left": 2},
            "sampler": {"used": 4, "left": 6},
        },
        "progress": {
            "step": 42,
            "rewardMean": 0.625,
            "lastCheckpointStep": 40,
            "updateTime": "2027-01-15T07:58:20Z",  # 100 s before NOW
        },
    }
    caches.put_rljob(_body("run", running))
    caches.put_rljob(_body("fresh", None))  # no status yet: Pending, no progress series
    got = scrape()
    run = (("name", "run"), ("namespace", "team-a"))
    fresh = (("name", "fresh"), ("namespace", "team-a"))
    assert got[("rljob_run_step", run)] == 42
    assert got[("rljob_run_reward_mean", run)] == 0.625
    assert got[("rljob_run_last_checkpoint_step", run)] == 40
    assert got[("rljob_run_seconds_since_last_step", run)] == 100
    assert got[("rljob_run_restarts", (*run, ("role", "trainer")))] == 1
    assert got[("rljob_run_restarts", (("name", "run"), ("namespace", "team-a"), ("role", "sampler")))] == 4
    phases = {p.value: got[("rljob_run_phase", (*run, ("phase", p.value)))] for p in Phase}
    assert phases == {**dict.fromkeys(phases, 0.0), "Running": 1.0}
    assert got[("rljob_run_phase", (*fresh, ("phase", "Pending")))] == 1
    assert not [k for k in got if k[1][:2] == fresh and k[0] != "rljob_run_phase"]

    caches.drop_rljob(("team-a", "run"))  # the watch's DELETED event
    got = scrape()
    assert not [k for k in got if ("name", "run") in k[1]]
    assert got[("rljob_run_phase", (*fresh, ("phase", "Pending")))] == 1
    caches.drop_rljob(("team-a", "fresh"))
    assert scrape() == {}
