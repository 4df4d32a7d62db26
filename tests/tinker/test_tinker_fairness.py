"""Fair share between the keys of one Tinker service (docs/tinker.md, "Limits"): what one key sends or holds
is bounded, a key over a quota is answered 429 naming the limit, and no key takes another's state.

The served tests run the service as `serve_tinker` runs it with two keys: API_KEY (the hostile tenant
here) and OTHER_KEY (the one it must not harm). Each hostile request is counted in TALLY (tried, refused);
``test_tally`` (last) prints the counts.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fixtures.tinker import API_KEY, OTHER_KEY, Served, serve_tinker, tinker_run_config

TESTED_MODULES = (
    "rljob.trainer.tinker.engine",
    "rljob.trainer.tinker.sampling",
    "rljob.trainer.tinker.server.core",
    "rljob.trainer.tinker.server.futures",
    "rljob.trainer.tinker.server.quotas",
    "rljob.trainer.tinker.server.training",
    "rljob.trainer.tinker.server.worker",
    "rljob.trainer.tinker.wire",
)

pytestmark = pytest.mark.jax

TALLY: Counter[str] = Counter()


def hostile(refused: bool) -> None:
    TALLY["tried"] += 1
    TALLY["refused"] += int(refused)


@pytest.fixture(scope="module")
def served(gcs_emulator: Any, cpu_policy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = f"gs://{gcs_emulator.new_bucket('tinker-fair')}"
    progress = tmp_path_factory.mktemp("tinker-fair") / "progress.json"

    def rc(port: int) -> Any:
        return tinker_run_config(root, port, progress, service={"maxTrainingClients": 8})

    with serve_tinker(rc, cpu_policy) as s:
        yield s


def _http(served: Served, key: str) -> Any:
    return httpx.Client(base_url=f"{served.url}/api/v1", headers={"X-API-Key": key}, timeout=120)


def _session(http: Any) -> str:
    body = {"tags": [], "user_metadata": {}, "sdk_version": "t", "type": "create_session"}
    return str(http.post("/create_session", json=body).raise_for_status().json()["session_id"])


def _result(http: Any, answer: Any) -> Any:
    """The future's result (JSON, or protobuf bytes) of a request answered with a request_id."""
    return _poll(http, answer.raise_for_status().json()["request_id"])


def _poll(http: Any, rid: str) -> Any:
    while True:
        r = http.post("/retrieve_future", json={"request_id": rid}).raise_for_status()
        if r.headers["content-type"].startswith("application/json"):
            body = r.json()
            if body.get("type") != "try_again":
                return body
        else:
            return r.content


def _create_model(http: Any, sid: str, seq: int, base: str) -> Any:
    req = {
        "session_id": sid,
        "model_seq_id": seq,
        "base_model": base,
        "lora_config": {"rank": 4, "seed": 1},
        "type": "create_model",
    }
    return http.post("/create_model", json=req)


# ---------------------------------------------------------------------------------------- unit: policies


def test_echoes_and_messages_are_bounded() -> None:
    from rljob.trainer.tinker.server.quotas import MAX_ECHO, MAX_MESSAGE, bounded, echo

    huge = "x" * 5_000_000
    assert len(echo(huge)) < MAX_ECHO + 40 and echo(huge).endswith("(5000002 characters)")
    assert echo("short") == "'short'"
    assert len(bounded(huge)) < MAX_MESSAGE + 40


def test_the_worker_takes_keys_in_turn() -> None:
    """Key a queues five tasks, then key b one: b's runs second, not sixth (a FIFO ran it last)."""
    from rljob.trainer.tinker.server.worker import FairWorker

    w = FairWorker()
    gate = threading.Event()
    order: list[str] = []
    try:
        first = w.submit("gate", gate.wait)  # holds the thread while the rest queue

        def task(name: str) -> Any:
            return lambda: order.append(name)

        futs = [w.submit("a", task(f"a{i}")) for i in range(5)]
        futs.append(w.submit("b", lambda: order.append("b0")))
        gate.set()
        for f in [first, *futs]:
            f.result(10)
    finally:
        w.shutdown()
    assert order == ["a0", "b0", "a1", "a2", "a3", "a4"]
    assert [x for x in order if x.startswith("a")] == [f"a{i}" for i in range(5)]  # a key's order kept


def test_futures_are_bounded_per_key() -> None:
    from rljob.trainer.tinker.server.futures import FutureTable
    from rljob.trainer.tinker.server.quotas import MAX_MESSAGE, QuotaExceeded

    async def run() -> None:
        table = FutureTable(pending_per_key=3, kept_per_key=5)
        for _ in range(3):
            table.new("x", "a")
        with pytest.raises(QuotaExceeded, match="3 requests in flight") as err:
            table.new("x", "a")
        hostile(True)
        assert err.value.response().status == 429
        table.new("x", "b")  # another key is not refused
        for f in list(table.futures.values()):
            f.fail("e" * 10_000_000, "user")
            f.done.set()
        kept = [table.new("x", "a", admit=False) for _ in range(4)]
        mine = [f for f in table.futures.values() if f.owner == "a"]
        assert len(mine) == 5 and all(f in mine for f in kept)  # its own oldest went
        assert [f for f in table.futures.values() if f.owner == "b"]  # never another key's
        assert table.retained_bytes("a") <= 5 * (MAX_MESSAGE + 40)

    asyncio.run(run())


def test_request_size_is_bounded() -> None:
    from rljob.trainer.tinker import wire
    from rljob.trainer.tinker.engine import RequestError
    from rljob.trainer.tinker.server.quotas import MAX_DATUMS_PER_REQUEST, MAX_TOKENS_PER_REQUEST
    from rljob.trainer.tinker.server.training import check_request_size
    from tinker.proto import tinker_public_pb2 as pb

    def call(datums: int, tokens: int) -> Any:
        msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
        for _ in range(datums):
            d = msg.data.add()
            d.model_input.add().encoded_text.tokens = b"\x01\x00\x00\x00" * tokens
        return wire.parse_forward_backward(msg.SerializeToString())

    check_request_size(call(8, 4))
    for datums, tokens, field in [
        (MAX_DATUMS_PER_REQUEST + 1, 1, "datums"),
        (2, MAX_TOKENS_PER_REQUEST // 2 + 1, "tokens"),
    ]:
        with pytest.raises(RequestError, match=rf"^data: \d+ (model_input )?{field}"):
            check_request_size(call(datums, tokens))
        hostile(True)


def test_a_sampler_fault_is_not_retried_for_minutes_and_bad_input_not_at_all() -> None:
    """A sampler answering 500 fails the request after a few attempts (it was retried until the 600 s
    deadline); a 400 (the client's input) fails at once, as the client's fault."""
    from aiohttp import web
    from rljob.common.ports import free_port
    from rljob.trainer.tinker.sampling import SamplerError, SamplerPool

    async def run() -> None:
        seen: Counter[int] = Counter()

        async def answer(request: web.Request) -> web.Response:
            status = int(request.query.get("s", "0")) or (await request.json())["status"]
            seen[status] += 1
            return web.json_response({"error": "no"}, status=status)

        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        pool = SamplerPool([f"http://127.0.0.1:{port}"], timeout=20, retry_s=0.01)
        try:
            for status, user in [(500, False), (400, True)]:
                t0 = time.monotonic()
                with pytest.raises(SamplerError) as err:
                    await pool.complete([1, 2], n=1, params={"status": status}, model="m", adapter_uri=None)
                assert time.monotonic() - t0 < 5 and err.value.user is user, status
                assert f"HTTP {status}" in str(err.value)
            assert seen[400] == 1 and 1 < seen[500] <= 5
        finally:
            await pool.close()
            await runner.cleanup()

    asyncio.run(run())


# ---------------------------------------------------------------------------------------- served


def test_a_long_field_is_not_echoed_whole(served: Served) -> None:
    """A 500 kB checkpoint name: the failed future's message is bounded; a body over its route's limit is
    refused before it is read (413)."""
    from rljob.trainer.tinker.server.quotas import MAX_ECHO, MAX_MESSAGE

    base = served.service.cfg.base_model
    with _http(served, API_KEY) as http:
        sid = _session(http)
        model = _result(http, _create_model(http, sid, 0, base))["model_id"]
        long = "a" * 500_000
        req = {"model_id": model, "path": long, "seq_id": 1, "type": "save_weights"}
        body = _result(http, http.post("/save_weights", json=req))
        hostile("error" in body)
        assert body["category"] == "user" and body["error"].startswith("path: ")
        assert len(body["error"]) < MAX_ECHO + 200 <= MAX_MESSAGE
        big = {"model_id": model, "path": "b" * (2 << 20), "seq_id": 2, "type": "save_weights"}
        r = http.post("/save_weights", json=big)
        hostile(r.status_code == 413)
        assert r.status_code == 413 and "at most" in r.json()["error"]
        http.post(f"/sessions/{sid}/finish", json={}).raise_for_status()


def test_sampling_sessions_of_one_key_never_evict_another_keys(served: Served) -> None:
    import dataclasses

    svc = served.service
    saved = svc.cfg
    svc.cfg = dataclasses.replace(svc.cfg, max_sampling_sessions=len(svc.sampling) + 6)
    base = svc.cfg.base_model
    try:
        with _http(served, OTHER_KEY) as other, _http(served, API_KEY) as http:
            osid = _session(other)
            req = {"session_id": osid, "sampling_session_seq_id": 0, "base_model": base}
            theirs = (
                other.post("/create_sampling_session", json=req)
                .raise_for_status()
                .json()["sampling_session_id"]
            )
            sid = _session(http)
            for i in range(20):
                req = {"session_id": sid, "sampling_session_seq_id": i, "base_model": base}
                http.post("/create_sampling_session", json=req).raise_for_status()  # room from its own
            assert other.get(f"/samplers/{theirs}").status_code == 200
            mine = [s for s in svc.sampling.values() if s.session == sid]
            assert 1 <= len(mine) <= svc.cfg.max_sampling_sessions // 2
            http.post(f"/sessions/{sid}/finish", json={}).raise_for_status()
            other.post(f"/sessions/{osid}/finish", json={}).raise_for_status()
    finally:
        svc.cfg = saved


def test_training_clients_are_shared_per_key(served: Served) -> None:
    """With a pool of 2 (two keys: one each), a key's second client is refused 429 naming the limit while
    a slot is free, and the other key still gets its own."""
    svc = served.service
    eng = svc.engine
    base = svc.cfg.base_model
    limit = eng.max_models
    with _http(served, OTHER_KEY) as other, _http(served, API_KEY) as http:
        sid = _session(http)
        osid = _session(other)
        try:
            eng.max_models = len(eng.models) + 2
            first = _result(http, _create_model(http, sid, 0, base))
            assert "model_id" in first, first
            eng.max_models = len(eng.models) + 1
            r = _create_model(http, sid, 1, base)
            hostile(r.status_code == 429)
            assert r.status_code == 429 and "spec.service.maxTrainingClients" in r.json()["error"]
            assert r.headers["x-should-retry"] == "false"
            theirs = _result(other, _create_model(other, osid, 0, base))
            assert "model_id" in theirs, theirs
        finally:
            eng.max_models = limit
            http.post(f"/sessions/{sid}/finish", json={}).raise_for_status()
            other.post(f"/sessions/{osid}/finish", json={}).raise_for_status()


def _ppo_body(model: str, seq: int, clip: float, good: bool) -> bytes:
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id=model, seq_id=seq, loss_fn="ppo")
    msg.loss_fn_config["clip_low_threshold"] = clip
    msg.loss_fn_config["clip_high_threshold"] = 1.2
    d = msg.data.add()
    tokens = [1, 5, 17]
    d.model_input.add().encoded_text.tokens = b"".join(t.to_bytes(4, "little") for t in tokens)
    targets = [5, 17, 6] if good else [9, 9, 9]  # not next-token targets: refused
    for name, values, dtype in [
        ("target_tokens", targets, pb.DTYPE_INT64),
        ("logprobs", [-1.0] * 3, pb.DTYPE_FLOAT32),
        ("advantages", [1.0] * 3, pb.DTYPE_FLOAT32),
    ]:
        import numpy as np

        arr = np.asarray(values, np.int64 if dtype == pb.DTYPE_INT64 else np.float32)
        t = d.loss_fn_inputs[name]
        t.dtype, t.dense = dtype, arr.tobytes()
        t.shape.append(3)
    return bytes(msg.SerializeToString())


def test_refused_requests_add_no_ppo_variant(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """16 refused PPO requests with distinct clip settings leave the compiled set as it was; a key adds at
    most its share of new settings."""
    from rljob.trainer.tinker.engine import MAX_LOSS_VARIANTS
    from rljob.trainer.tinker.server import core

    svc = served.service
    base = svc.cfg.base_model
    before = set(svc.engine._loss_variants)
    monkeypatch.setattr(core, "VARIANTS_PER_KEY", 1)
    with _http(served, API_KEY) as http:
        sid = _session(http)
        model = _result(http, _create_model(http, sid, 0, base))["model_id"]
        headers = {"Content-Type": "application/x-protobuf"}
        for i in range(MAX_LOSS_VARIANTS):
            clip = 0.5 + i / 100
            body = _result(
                http,
                http.post("/forward_backward", content=_ppo_body(model, i + 1, clip, False), headers=headers),
            )
            hostile(isinstance(body, dict) and body.get("category") == "user")
            assert "target_tokens" in body["error"]
        assert svc.engine._loss_variants == before
        seq = MAX_LOSS_VARIANTS + 1
        ok = _result(
            http, http.post("/forward_backward", content=_ppo_body(model, seq, 0.31, True), headers=headers)
        )
        assert isinstance(ok, bytes), ok
        refused = _result(
            http,
            http.post("/forward_backward", content=_ppo_body(model, seq + 1, 0.32, True), headers=headers),
        )
        hostile(isinstance(refused, dict))
        assert "per-key limit" in refused["error"]
        http.post(f"/sessions/{sid}/finish", json={}).raise_for_status()


def test_create_model_racing_finish_session_leaves_no_model(served: Served) -> None:
    """The worker is held; create_model is queued, then finish_session; the worker is released. The model
    the create made is unloaded by the finish (before: it stayed, in no live session, never swept)."""
    svc = served.service
    base = svc.cfg.base_model
    gate = threading.Event()
    with _http(served, API_KEY) as http:
        sid = _session(http)
        held = svc.worker.submit("test-gate", lambda: gate.wait(60))
        rid = _create_model(http, sid, 0, base).raise_for_status().json()["request_id"]
        time.sleep(0.5)  # the create's work is queued on the worker
        finished: dict[str, Any] = {}
        t = threading.Thread(target=lambda: finished.update(r=http.post(f"/sessions/{sid}/finish", json={})))
        t.start()
        deadline = time.monotonic() + 30
        while sid not in svc.finished and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sid in svc.finished  # the finish began while the create waited
        gate.set()
        held.result(30)
        t.join(60)
        assert finished["r"].status_code == 200
        body = _poll(http, rid)
        hostile(not [m for m in svc.engine.models if m.startswith(sid)])
        assert not [m for m in svc.engine.models if m.startswith(sid)], body
        assert not [m for m, s in svc.model_session.items() if s == sid]


def test_sampling_inputs_are_validated(served: Served) -> None:
    """Token ids outside the vocabulary, a NaN temperature, a 2^80 seed: HTTP 400 naming each field, before
    any sampler sees them."""
    base = served.service.cfg.base_model
    vocab = served.service.engine.policy.vocab_size
    with _http(served, API_KEY) as http:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"prompt": [1, vocab + 5]}, "prompt: token"),
            ({"temperature": math.nan}, "sampling_params.temperature"),
            ({"temperature": -1.0}, "sampling_params.temperature"),
            ({"seed": 2**80}, "sampling_params.seed"),
            ({"top_p": 0.0}, "sampling_params.top_p"),
        ]
        for case, field in cases:
            sp = {"max_tokens": 2, "temperature": 1.0, **{k: v for k, v in case.items() if k != "prompt"}}
            prompt = case.get("prompt", [1, 2])
            req = {
                "base_model": base,
                "num_samples": 1,
                "prompt": {"chunks": [{"tokens": prompt, "type": "encoded_text"}]},
                "sampling_params": sp,
                "type": "sample",
            }
            r = http.post("/asample", content=json.dumps(req), headers={"Content-Type": "application/json"})
            hostile(r.status_code == 400)
            assert r.status_code == 400 and r.json()["error"].startswith(field), (case, r.text)


def test_ended_sessions_are_pruned(served: Served) -> None:
    """An ended session's object is deleted at once, its id forgotten after FINISHED_TTL_S."""
    from rljob.common.storage import join, open_store
    from rljob.trainer.tinker.server import SESSIONS_DIR
    from rljob.trainer.tinker.server.core import FINISHED_TTL_S

    svc = served.service
    store = open_store(join(svc.cfg.checkpoints, "tinker", SESSIONS_DIR))
    with _http(served, API_KEY) as http:
        sid = _session(http)
        held = len(store.list())
        assert held >= 1
        http.post(f"/sessions/{sid}/finish", json={}).raise_for_status()
        assert len(store.list()) == held - 1 and sid in svc.finished
        svc.finished[sid] -= FINISHED_TTL_S + 1  # ended an hour ago
        deadline = time.monotonic() + 30
        while sid in svc.session_owner and time.monotonic() < deadline:
            time.sleep(0.2)  # the service's own sweep (every 5 s)
        assert sid not in svc.finished and sid not in svc.session_owner


# ---------------------------------------------------------------------------------------- TLS


def _self_signed() -> tuple[str, str]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), pem_key.decode()


def test_the_api_serves_tls_when_a_certificate_is_given(tmp_path: Any) -> None:
    """With the certificate and key variables set the API answers HTTPS only (a plain HTTP request gets no
    answer); one variable alone is refused naming the other."""
    import ssl

    from aiohttp import web
    from rljob.recipes.runconfig import TLS_CERT_ENV, TLS_KEY_ENV
    from rljob.trainer.main import BadConfig
    from rljob.trainer.tinker.main import serve, tls_context

    cert, key = _self_signed()
    assert tls_context({}) is None
    with pytest.raises(BadConfig, match=f"^{TLS_KEY_ENV}: not set"):
        tls_context({TLS_CERT_ENV: cert})
    with pytest.raises(BadConfig, match=f"^{TLS_CERT_ENV}/{TLS_KEY_ENV}: not a PEM"):
        tls_context({TLS_CERT_ENV: cert, TLS_KEY_ENV: "nope"})
    ctx = tls_context({TLS_CERT_ENV: cert, TLS_KEY_ENV: key})

    async def healthz(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    class _App:
        def app(self) -> web.Application:
            a = web.Application()
            a.router.add_get("/api/v1/healthz", healthz)
            return a

    async def run() -> None:
        stop = asyncio.Event()
        urls: list[str] = []
        task = asyncio.ensure_future(serve(_App(), "127.0.0.1", 0, urls.append, stop, tls=ctx))
        while not urls:
            await asyncio.sleep(0.05)
        url = urls[0]
        assert url.startswith("https://")
        (tmp_path / "ca.pem").write_text(cert)
        trust = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        async with httpx.AsyncClient(verify=trust) as c:
            assert (await c.get(f"{url}/api/v1/healthz")).json() == {"status": "ok"}
        async with httpx.AsyncClient() as c:
            with pytest.raises(httpx.HTTPError):
                await c.get(url.replace("https://", "http://") + "/api/v1/healthz")
        hostile(True)  # plain HTTP to a TLS service
        stop.set()
        await task

    asyncio.run(run())


def test_tally() -> None:
    print(f"\nhostile requests: tried {TALLY['tried']}, refused {TALLY['refused']}")
    assert TALLY["tried"] >= 1 and TALLY["refused"] == TALLY["tried"]
