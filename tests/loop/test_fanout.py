"""SamplerClient.complete against stand-in replicas (rljob.sampler.standin): all replicas at once, at most
`inflight` requests and `max_seqs` sequences per replica in flight, every completion back on its prompt,
work moved off a dead replica or one behind on the adapter version, a refusal surfaced."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from rljob.common.ports import free_port
from rljob.sampler.standin import StandinReplica
from rljob.trainer.data import Prompt
from rljob.trainer.sampler_client import SamplerClient, SamplerClosed, SamplerRejected

pytestmark = pytest.mark.jax  # rljob.trainer.loop imports jax


@pytest.fixture
def replicas(request: pytest.FixtureRequest) -> Iterator[list[StandinReplica]]:
    n, delay = getattr(request, "param", (4, 0.0))
    with ExitStack() as stack:
        yield [stack.enter_context(StandinReplica("job", delay_s=delay)) for _ in range(n)]


def _prompts(k: int) -> list[Prompt]:
    return [Prompt(tokens=[i % 200, i % 200 + 1], text="", answer="") for i in range(k)]


@pytest.mark.parametrize(
    ("n_prompts", "n", "max_seqs", "requests"), [(8, 2, 256, 4), (32, 4, 16, 8), (3, 1, 256, 3)]
)
def test_all_replicas_at_once_every_completion_on_its_prompt(
    replicas: list[StandinReplica], n_prompts: int, n: int, max_seqs: int, requests: int
) -> None:
    # The first wave of requests must be in flight together: each waits for the others at a barrier
    # (a client that asks the replicas one after another breaks it and its request fails).
    wave = threading.Barrier(min(requests, len(replicas)))
    for r in replicas:
        r.barrier = wave
    client = SamplerClient([r.url for r in replicas], "job", max_seqs=max_seqs)
    comps = client.complete(_prompts(n_prompts), n, 3, 1.0, 0)
    assert len(comps) == n_prompts * n
    assert [c.prompt_index for c in comps] == sorted(i for i in range(n_prompts) for _ in range(n))
    for c in comps:
        last = c.prompt_index % 200 + 1
        assert c.prompt_tokens == [c.prompt_index % 200, last]
        assert c.tokens == [last + 1, last + 2, last + 3] and c.adapter == "job-v0"
    assert sum(r.requests for r in replicas) == requests  # of at most max_seqs sequences each
    assert all(r.sequences <= max(max_seqs, n) * r.requests for r in replicas)
    assert all(r.max_active <= 1 for r in replicas)  # back-pressure: one request per replica at a time


def test_the_barrier_catches_a_sequential_client(replicas: list[StandinReplica]) -> None:
    """Broken variant: the same requests one after another (as complete() did before) never fill the wave."""
    wave = threading.Barrier(2)
    for r in replicas:
        r.barrier, r.barrier_timeout_s = wave, 1.0
    client = SamplerClient([replicas[0].url], "job", timeout=20.0)
    with pytest.raises(Exception):  # noqa: B017 - the stand-in drops the request
        client._request(f"{replicas[0].url}/v1/completions", {"prompt": [[1]], "model": "job-v0"})


@pytest.mark.parametrize("replicas", [(4, 0.05)], indirect=True)
def test_inflight_slots_bound_each_replica_across_concurrent_calls(replicas: list[StandinReplica]) -> None:
    client = SamplerClient([r.url for r in replicas], "job", max_seqs=4, inflight=2)
    out: list[int] = []
    calls = [
        threading.Thread(target=lambda: out.append(len(client.complete(_prompts(16), 2, 1, 1.0, 0))))
        for _ in range(3)
    ]
    for t in calls:
        t.start()
    for t in calls:
        t.join()
    assert out == [32, 32, 32]
    assert max(r.max_active for r in replicas) == 2  # never above the two slots of a replica


@pytest.mark.parametrize("replicas", [(2, 0.05)], indirect=True)
def test_a_dead_replica_and_one_behind_on_the_version_leave_their_work_to_the_others(
    replicas: list[StandinReplica],
) -> None:
    replicas[1].version = 0  # still serves v0 while the call needs v1
    replicas[0].version = 1
    dead = f"http://127.0.0.1:{free_port()}"
    client = SamplerClient([replicas[0].url, dead, replicas[1].url], "job", retry_s=0.02)
    comps = client.complete(_prompts(6), 2, 1, 1.0, 1)
    assert len(comps) == 12 and {c.adapter for c in comps} == {"job-v1"}
    assert replicas[0].requests == 3 and replicas[1].requests == 0
    assert client.waited_s > 0  # the dead replica's first request waited, then went elsewhere


def test_close_ends_a_wait_for_replicas_that_never_answer() -> None:
    nobody = SamplerClient([f"http://127.0.0.1:{free_port()}"] * 2, "job", retry_s=0.02)
    threading.Timer(0.3, nobody.close).start()
    with pytest.raises(SamplerClosed):
        nobody.complete(_prompts(2), 1, 1, 1.0, 0)


def test_a_4xx_is_a_rejection_not_a_wait() -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Refuse(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = b'{"data": [{"id": "job-v0"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            data = b'{"error": "seed: JAX does not support per-request seed."}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            return

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = SamplerClient([f"http://127.0.0.1:{srv.server_address[1]}"], "job")
        with pytest.raises(SamplerRejected, match=r"HTTP 400: .*per-request seed"):
            client.complete(_prompts(2), 1, 1, 1.0, 0)
    finally:
        srv.shutdown()
        srv.server_close()


def test_an_answer_without_a_log_prob_per_token_is_refused(
    replicas: list[StandinReplica], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Broken variant: `logprobs: 0`, which vLLM's TPU engine answers without log-probs (the stand-in does the
    same): the client refuses the answer, naming the counts, instead of training on rollouts without them."""
    from rljob.trainer import sampler_client

    good = SamplerClient([replicas[0].url], "job").complete(_prompts(2), 1, 3, 1.0, 0)
    assert [c.logprobs for c in good] == [[-1.0] * 3] * 2
    monkeypatch.setattr(sampler_client, "SAMPLED_LOGPROBS", 0)
    with pytest.raises(SamplerRejected, match="3 tokens but 0 log-probs"):
        SamplerClient([replicas[0].url], "job").complete(_prompts(2), 1, 3, 1.0, 0)
