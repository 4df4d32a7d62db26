"""Rewards from an HTTP service (spec.dataset.rewardUrl, rljob.trainer.remote_reward): the request body,
the answer's forms, retries with backoff on failures that may pass, and a stop (RewardUnavailable) on the
ones that will not; the loop's grading through it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
from fixtures.recipes import manifest, problems, resolve
from rljob.trainer.data import Prompt, SuccessorTask
from rljob.trainer.remote_reward import RemoteReward, RewardUnavailable

Answer = tuple[int, bytes]


class Service:
    """A reward service on a loopback port: ``answer(body)`` gives (status, body) for each request."""

    def __init__(self, answer: Callable[[dict[str, Any]], Answer]) -> None:
        self.requests: list[dict[str, Any]] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append(body)
                status, out = answer(body)
                self.send_response(status)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/grade"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service() -> Iterator[Callable[[Callable[[dict[str, Any]], Answer]], Service]]:
    started: list[Service] = []

    def start(answer: Callable[[dict[str, Any]], Answer]) -> Service:
        started.append(Service(answer))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _prefix(body: dict[str, Any]) -> Answer:
    return 200, json.dumps(1.0 if body["completion"].startswith(body["reference"]) else 0.0).encode()


PROMPTS = [Prompt(None, "say ab", "ab", id="1"), Prompt([5, 6], None, [5], id="2")]


def test_grades_through_the_service(service: Any) -> None:
    svc = service(_prefix)
    remote = RemoteReward(SuccessorTask(), svc.url)
    try:
        assert remote.reward(PROMPTS[0], [97], "abc") == 1.0
        assert svc.requests[0] == {"completion": "abc", "reference": "ab", "prompt": "say ab", "id": "1"}
        graded: list[tuple[Prompt, list[int], str]] = [
            (PROMPTS[0], [], "xy"),
            (PROMPTS[0], [], "ab"),
            (PROMPTS[0], [], "a"),
        ] * 10
        assert remote.rewards(graded) == [0.0, 1.0, 0.0] * 10  # concurrent, in order
        svc2 = service(lambda body: (200, b'{"reward": 0.25}'))
        remote2 = RemoteReward(SuccessorTask(), svc2.url)
        assert remote2.reward(PROMPTS[1], [5], "") == 0.25
        assert svc2.requests[0]["prompt"] is None and svc2.requests[0]["reference"] == [5]
        remote2.close()
    finally:
        remote.close()


def test_retries_what_may_pass_then_stops(service: Any) -> None:
    statuses = iter([503, 429, 500])
    svc = service(lambda body: (next(statuses, 200), b"0.5"))
    remote = RemoteReward(SuccessorTask(), svc.url, backoff=0.01)
    assert remote.reward(PROMPTS[0], [], "x") == 0.5
    assert len(svc.requests) == 4  # three failures, then the answer
    down = service(lambda body: (503, b"busy"))
    remote = RemoteReward(SuccessorTask(), down.url, backoff=0.01, attempts=3)
    with pytest.raises(RewardUnavailable, match=r"did not grade a completion in 3 attempts \(HTTP 503\)$"):
        remote.reward(PROMPTS[0], [], "x")
    assert len(down.requests) == 3


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (400, b"no reference", r"HTTP 400: no reference$"),
        (200, b'"1.0"', r"""b'"1.0"', not a finite number or \{"reward": number\}$"""),
        (200, b'{"score": 1}', r"b'\{\"score\": 1\}', not a finite number"),
        (200, b"NaN", r"b'NaN', not a finite number"),
        (200, b"true", r"b'true', not a finite number"),
        (200, b"0" * 70000, r"more than 65536 bytes, not a finite number"),
    ],
)
def test_answers_it_will_never_fix_stop_at_once(service: Any, status: int, body: bytes, message: str) -> None:
    svc = service(lambda _: (status, body))
    with pytest.raises(
        RewardUnavailable,
        match=r"^spec\.dataset\.rewardUrl: http://127\.0\.0\.1:\d+/grade answered " + message,
    ):
        RemoteReward(SuccessorTask(), svc.url, backoff=0.01).reward(PROMPTS[0], [], "x")
    assert len(svc.requests) == 1


def test_nothing_listening_is_retried_then_stops() -> None:
    remote = RemoteReward(SuccessorTask(), "http://127.0.0.1:9/grade", backoff=0.01, attempts=2, timeout=2)
    with pytest.raises(RewardUnavailable, match=r"in 2 attempts \(.*(refused|Errno)"):
        remote.reward(PROMPTS[0], [], "x")


@pytest.mark.jax
def test_the_loop_grades_a_batch_through_the_service(service: Any) -> None:
    from rljob.trainer.rollouts import Batch, SamplerSource
    from rljob.trainer.sampler_client import Completion, SamplerClient

    svc = service(_prefix)
    task = RemoteReward(SuccessorTask(), svc.url)
    src = SamplerSource(
        SamplerClient(["http://127.0.0.1:9"], "job"),
        task,
        steps=1,
        group_size=2,
        groups_per_batch=1,
        logprobs=lambda *a: None,
    )
    comps = [Completion(0, [1], [0.0], text, "job-v0") for text in ("abz", "zz")]
    batch = Batch(0, [PROMPTS[0]], comps, np.zeros(0, np.float32), 0.0)
    np.testing.assert_array_equal(src.grade(batch), [1.0, 0.0])
    # One request per completion, sent concurrently: the service may see them in either order.
    assert sorted(r["completion"] for r in svc.requests) == ["abz", "zz"]
    src.close()


def test_the_manifest_takes_a_reward_url() -> None:
    rc = resolve(manifest({"dataset": {"rewardUrl": "http://grader.sandbox.svc:8080/grade"}}))
    assert rc.spec.dataset and rc.spec.dataset.reward_url == "http://grader.sandbox.svc:8080/grade"
    for bad in ("grader:8080", "ftp://x/y", "http:// x", "http://" + "a" * 2050):
        found = problems(manifest({"dataset": {"rewardUrl": bad}}))
        assert len(found) == 1 and found[0].startswith("spec.dataset.rewardUrl: "), (bad, found)
