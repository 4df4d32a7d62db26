"""The sampler's adapter status route and adapter agent (rljob.sampler.main.status_app on aiohttp.web): the
routes, statuses and bodies the trainer's Tinker service and `rljob drill` read, behind the run's token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rljob.common.credentials import bearer, new_token
from rljob.common.http import NO_RETRY, HttpStatusError, HttpUnavailable, shared
from rljob.common.ports import free_port
from rljob.recipes.runconfig import ADAPTER_AGENT_PATH
from rljob.sampler.adapters import ServerError
from rljob.sampler.main import StatusServer, status_app

TOKEN = new_token()


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
    srv = StatusServer(port, Watcher(), agent, "127.0.0.1", token=TOKEN)  # type: ignore[arg-type]
    yield f"http://127.0.0.1:{port}", agent
    srv.shutdown()


def _answer(method: str, url: str, body: Any = None, token: str | None = TOKEN) -> tuple[int, Any]:
    """Status and JSON body of one request (with ``token``), whatever the status."""
    try:
        r = shared().request(method, url, json=body, headers=bearer(token), retry=NO_RETRY)
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


def test_the_real_agent_takes_only_this_runs_adapters_under_their_own_names(tmp_path: Path) -> None:
    """rljob.sampler.adapters.AdapterAgent behind the route: a name is one bounded segment (`..` once
    deleted the served adapters' folder), a uri lies below the run's `{adapters}/tinker/`, and the name is
    the one the service gives that directory (a fake preloaded under a predictable name is refused)."""
    from rljob.recipes.runconfig import named_adapter
    from rljob.sampler.adapters import AdapterAgent, LoraEndpoint

    allowed = str(tmp_path / "adapters" / "tinker")
    good = f"{allowed}/s-1_3atrain_3a0/w/0123abcd"
    store = tmp_path / "adapters" / "tinker" / "s-1_3atrain_3a0" / "w" / "0123abcd"
    store.mkdir(parents=True)
    (store / "adapter_config.json").write_text("{}")
    served = tmp_path / "named"
    (served / "kept").mkdir(parents=True)
    # the server behind the agent is down: a request that passes the checks fails at its load (502)
    agent = AdapterAgent(LoraEndpoint(f"http://127.0.0.1:{free_port()}", timeout=2), served, 2, allowed)
    port = free_port()
    srv = StatusServer(port, Watcher(), agent, "127.0.0.1", token=TOKEN)  # type: ignore[arg-type]
    url = f"http://127.0.0.1:{port}{ADAPTER_AGENT_PATH}"
    try:
        refused = [
            ("..", good, "name:"),
            (".", good, "name:"),
            ("../kept", good, "name:"),
            ("a/b", good, "name:"),
            (".hidden", good, "name:"),
            ("x" * 129, good, "name:"),
            ("tinker-a b", good, "name:"),
            (named_adapter("gs://elsewhere/w"), "gs://elsewhere/w", "uri:"),
            (named_adapter(f"{allowed}/../w"), f"{allowed}/../w", "uri:"),
            (named_adapter(f"{allowed}/a/../../w"), f"{allowed}/a/../../w", "uri:"),
            (named_adapter(f"{allowed}2/w"), f"{allowed}2/w", "uri:"),
            (named_adapter(allowed), allowed, "uri:"),
            ("tinker-000000000000000000000000", good, "is not the name of"),  # a preloaded fake's name
        ]
        for name, uri, match in refused:
            status, body = _answer("POST", url, {"name": name, "uri": uri})
            assert status == 400 and match in body["error"], (name, uri, status, body)
        assert (served / "kept").is_dir() and agent.loaded == {}
        status, body = _answer("POST", url, {"name": named_adapter(good), "uri": good})
        assert status == 502 and "ServerError" in body["error"], body
    finally:
        srv.shutdown()


def test_every_request_needs_the_runs_token(server: tuple[str, Agent]) -> None:
    """Without the run's token, or with another, every request (the status GET too) is 401 and never reaches
    the agent; with it the same requests are served."""
    base, agent = server
    agent_url = f"{base}{ADAPTER_AGENT_PATH}"
    body = {"name": "a", "uri": "gs://b/a"}
    unauthorized = (401, {"error": "Authorization: missing or not accepted"})
    for headers in ({}, bearer("not-the-token"), bearer(TOKEN + "x"), {"Authorization": TOKEN}):
        for method, url, payload in (("POST", agent_url, body), ("GET", f"{base}/rljob/v1/adapter", None)):
            try:
                r = shared().request(method, url, json=payload, headers=headers, retry=NO_RETRY)
                answer: tuple[int, Any] = (r.status, r.json())
            except (HttpStatusError, HttpUnavailable) as e:
                answer = (e.status or 0, json.loads(e.body))
            assert answer == unauthorized, (method, headers)
    assert agent.calls == []
    assert _answer("POST", agent_url, body) == (200, {"name": "a", "loaded": True})
    assert _answer("GET", f"{base}/rljob/v1/adapter")[0] == 200
    assert agent.calls == [("a", "gs://b/a")]


def test_no_agent_without_a_token() -> None:
    with pytest.raises(ValueError, match="no token"):
        status_app(Watcher(), Agent(), "")  # type: ignore[arg-type]
