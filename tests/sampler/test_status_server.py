"""The sampler's adapter status route and adapter agent (rljob.sampler.main.status_app on aiohttp.web): the
routes, statuses and bodies the trainer's Tinker service and `rljob drill` read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from rljob.common.http import NO_RETRY, HttpStatusError, HttpUnavailable, shared
from rljob.common.ports import free_port
from rljob.recipes.runconfig import ADAPTER_AGENT_PATH
from rljob.sampler.adapters import ServerError
from rljob.sampler.main import StatusServer


class Watcher:
    def status(self) -> dict[str, Any]:
        return {"version": 3, "name": "job-v3"}


class Agent:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def ensure(self, name: str, uri: str) -> bool:
        self.calls.append((name, uri))
        if uri == "bad":
            raise ValueError("uri: not gs:// or a directory")
        if uri == "down":
            raise ServerError("load_lora_adapter: HTTP 500")
        return True


@pytest.fixture
def server() -> Iterator[tuple[str, Agent]]:
    agent, port = Agent(), free_port()
    srv = StatusServer(port, Watcher(), agent, "127.0.0.1")  # type: ignore[arg-type]
    yield f"http://127.0.0.1:{port}", agent
    srv.shutdown()


def _answer(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    """Status and JSON body of one request, whatever the status."""
    try:
        r = shared().request(method, url, json=body, retry=NO_RETRY)
        return r.status, r.json()
    except (HttpStatusError, HttpUnavailable) as e:
        return e.status or 0, json.loads(e.body)


def test_routes_and_answers(server: tuple[str, Agent]) -> None:
    base, agent = server
    version = {"version": 3, "name": "job-v3"}
    assert _answer("GET", f"{base}/rljob/v1/adapter") == (200, version)
    assert _answer("GET", f"{base}/other") == (404, version)
    agent_url = f"{base}{ADAPTER_AGENT_PATH}"
    assert _answer("POST", agent_url, {"name": "a", "uri": "gs://b/a"}) == (
        200,
        {"name": "a", "loaded": True},
    )
    assert agent.calls == [("a", "gs://b/a")]
    too_big = "body: a JSON object {name, uri} of at most 64 KiB"
    cases = [
        (f"{base}/nope", {"name": "a", "uri": "x"}, 404, {"error": "no route /nope"}),
        (agent_url, {"name": "a"}, 400, {"error": "body: a JSON object {name, uri}"}),
        (agent_url, {"name": "a", "uri": "bad"}, 400, {"error": "uri: not gs:// or a directory"}),
        (agent_url, {"name": "a", "uri": "x" * 70000}, 400, {"error": too_big}),
        (agent_url, {"name": "a", "uri": "down"}, 502, {"error": "ServerError: load_lora_adapter: HTTP 500"}),
    ]
    for url, body, status, answer in cases:
        assert _answer("POST", url, body) == (status, answer), (url, body)
    assert [uri for _, uri in agent.calls] == ["gs://b/a", "bad", "down"]
