"""The Tinker API's security model (docs/tinker.md, "Security"): it fails closed, and every session, training
client, checkpoint, sampler weights, sampling session and future belongs to the key that created it.

The service runs as `serve_tinker` runs it (the CPU sampler with its adapter agent, storage on the GCS
emulator) with two accepted keys: API_KEY (the owner) and OTHER_KEY (another tenant of the same service).
Every call the SDK can make is made with the unmodified SDK; the calls it cannot make with another key
(training calls on another key's model id, another key's session id) go over HTTP as the SDK would send
them. Each refused call is counted; ``test_the_owner_is_unharmed`` (last) checks the owner's objects and
prints the tally.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.jax

import httpx  # noqa: E402
import tinker  # noqa: E402
from fixtures.tinker import API_KEY, OTHER_KEY, Served, serve_tinker, tinker_run_config  # noqa: E402
from tinker import types  # noqa: E402

TALLY: Counter[str] = Counter()


@pytest.fixture(scope="module")
def served(gcs_emulator: Any, cpu_policy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = f"gs://{gcs_emulator.new_bucket('tinker-sec')}"
    progress = tmp_path_factory.mktemp("tinker-sec") / "progress.json"

    def rc(port: int) -> Any:
        return tinker_run_config(root, port, progress, service={"maxTrainingClients": 8})

    with serve_tinker(rc, cpu_policy) as s:
        yield s


def datum(seq: list[int]) -> Any:
    inputs: dict[str, Any] = {"target_tokens": seq[1:]}
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)


PROBE = [datum([1, 5, 17, 6, 9])]


def lp(tc: Any) -> np.ndarray:
    return np.asarray(tc.forward(PROBE, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)


@pytest.fixture(scope="module")
def owner(served: Served) -> Iterator[dict[str, Any]]:
    """What API_KEY created: a session, a training client, a named checkpoint, sampler weights, a sampling
    client, and a finished future."""
    with tinker.ServiceClient(base_url=served.url, api_key=API_KEY) as client:
        tc = client.create_lora_training_client(
            base_model=served.service.cfg.base_model, rank=4, seed=9
        ).result()
        tc.forward_backward([datum([1, 5, 17, 6, 9])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        state = tc.save_state("owned").result().path
        weights = tc.save_weights_for_sampler("owned-s").result().path
        sc = client.create_sampling_client(model_path=weights).result()
        yield {
            "client": client,
            "tc": tc,
            "session": client.holder.get_session_id(),
            "state": state,
            "weights": weights,
            "sc": sc,
            "lp": lp(tc),
        }


def _http(served: Served, key: str | None) -> Any:
    headers = {"X-API-Key": key} if key is not None else {}
    return httpx.Client(base_url=f"{served.url}/api/v1", headers=headers, timeout=60)


# --------------------------------------------------------------------------------------- fail closed


def test_the_service_refuses_to_start_without_a_key(
    gcs_emulator: Any, cpu_policy: Any, tmp_path: Path
) -> None:
    from rljob.trainer.main import BadConfig
    from rljob.trainer.tinker.main import build

    rc = tinker_run_config(f"gs://{gcs_emulator.new_bucket('tinker-closed')}", 1, tmp_path / "p.json")
    for value, why in [
        ("", "it lists no key"),
        (" , ,, ", "it lists no key"),
        ("secret", "entry 1 is not a key"),
        ("tml-", "entry 1 is not a key"),
        ("tml-good, bad", "entry 2 is not a key"),
    ]:
        with pytest.raises(BadConfig) as err:
            build(rc, "tiny", policy=cpu_policy, api_keys=value)
        assert str(err.value).startswith("spec.service.apiKeySecret: ") and why in str(err.value), value
        assert "tml-good" not in str(err.value)  # keys are never echoed
    # the CLI exits 2 (bad config) with that line, and never serves
    from rljob.trainer.tinker import main as tmain

    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json())
    assert tmain.main(["--config", str(cfg), "--model", "tiny", "--port", "1"]) == 2


UNAUTHENTICATED = [
    ("POST", "/client/config", {}),
    ("GET", "/get_server_capabilities", None),
    (
        "POST",
        "/create_session",
        {"tags": [], "user_metadata": {}, "sdk_version": "x", "type": "create_session"},
    ),
    ("POST", "/session_heartbeat", {"session_id": "s-1", "type": "session_heartbeat"}),
    ("POST", "/create_model", {"session_id": "s-1", "model_seq_id": 0, "base_model": "x"}),
    ("POST", "/optim_step", {"model_id": "m", "adam_params": {"learning_rate": 0.1}}),
    ("POST", "/retrieve_future", {"request_id": "r"}),
    ("GET", "/training_runs", None),
    ("GET", "/training_runs/m/checkpoints", None),
    ("DELETE", "/training_runs/m/checkpoints/weights/x", None),
    ("POST", "/weights_info", {"tinker_path": "tinker://m/weights/x"}),
    ("GET", "/samplers/x", None),
    ("POST", "/asample", {}),
]


@pytest.mark.parametrize("key", [None, "", "tml-not-listed", "not-a-tml-key", API_KEY + "x"])
def test_calls_without_an_accepted_key_are_refused(served: Served, key: str | None) -> None:
    with _http(served, key) as http:
        for method, path, body in UNAUTHENTICATED:
            r = http.request(method, path, json=body)
            TALLY["no key: tried"] += 1
            assert r.status_code == 401, (method, path, r.status_code)
            TALLY["no key: refused"] += 1
        assert http.get("/healthz").status_code == 200  # the probe needs no key
    if key and key.startswith("tml-"):  # the SDK itself: refused at its first call
        with pytest.raises(tinker.AuthenticationError):
            TALLY["no key: tried"] += 1
            tinker.ServiceClient(base_url=served.url, api_key=key).create_lora_training_client(
                base_model=served.service.cfg.base_model, rank=4
            ).result()
        TALLY["no key: refused"] += 1


# -------------------------------------------------------------------------------------- another key


def _refused_by_sdk(call: Any) -> None:
    TALLY["other key: tried"] += 1
    with pytest.raises(tinker.NotFoundError):
        out = call()
        if hasattr(out, "result"):
            out.result(timeout=60)
    TALLY["other key: refused"] += 1


def test_another_key_sees_nothing_through_the_sdk(served: Served, owner: dict[str, Any]) -> None:
    tc, state, weights = owner["tc"], owner["state"], owner["weights"]
    rest = tinker.RestClient(base_url=served.url, api_key=OTHER_KEY)
    runs = rest.list_training_runs(limit=100).result()
    TALLY["other key: tried"] += 1
    assert tc.model_id not in [r.training_run_id for r in runs.training_runs] and runs.cursor.total_count == 0
    TALLY["other key: refused"] += 1
    with tinker.ServiceClient(base_url=served.url, api_key=OTHER_KEY) as other:
        for call in [
            lambda: rest.get_training_run(tc.model_id),
            lambda: rest.get_training_run_by_tinker_path(state),
            lambda: rest.list_checkpoints(tc.model_id),
            lambda: rest.get_weights_info_by_tinker_path(state),
            lambda: rest.get_weights_info_by_tinker_path(weights),
            lambda: rest.delete_checkpoint_from_tinker_path(state),
            lambda: rest.delete_checkpoint_from_tinker_path(weights),
            lambda: rest.get_sampler(owner["sc"]._sampling_session_id),
            lambda: other.create_training_client_from_state(state),
            lambda: other.create_training_client_from_state_with_optimizer(state),
            lambda: other.create_sampling_client(model_path=weights),
            # a path that climbs out of the service's folder names no run of this key
            lambda: other.create_training_client_from_state("tinker://../weights/owned"),
            lambda: other.create_sampling_client(model_path="tinker://../sampler_weights/owned-s"),
            lambda: rest.list_checkpoints(".."),
        ]:
            _refused_by_sdk(call)
        # the owner's sampling session, by its handle, with the other key
        handle = owner["sc"].get_sampler_handle()
        stolen = tinker.SamplingClient.from_sampler_handle(handle, api_key=OTHER_KEY)
        prompt = types.ModelInput.from_ints([1, 5, 17])
        _refused_by_sdk(lambda: stolen.sample(prompt, 1, types.SamplingParams(max_tokens=1)))


def test_another_key_cannot_touch_the_owners_session_model_or_futures(
    served: Served, owner: dict[str, Any]
) -> None:
    """What the SDK never sends with another key, sent as it would: each 404 (410 for a future)."""
    tc, sid = owner["tc"], owner["session"]
    mid = tc.model_id
    with _http(served, API_KEY) as mine:  # a future of the owner's
        rid = mine.post(
            "/optim_step", json={"model_id": mid, "seq_id": 0, "adam_params": {"learning_rate": 0.0}}
        )
        assert rid.status_code == 200
        rid = rid.json()["request_id"]
    with _http(served, OTHER_KEY) as http:
        calls = [
            ("POST", "/session_heartbeat", {"session_id": sid, "type": "session_heartbeat"}, 404),
            ("POST", f"/sessions/{sid}/finish", {}, 404),
            (
                "POST",
                "/create_model",
                {
                    "session_id": sid,
                    "model_seq_id": 99,
                    "base_model": served.service.cfg.base_model,
                    "lora_config": {"rank": 4},
                },
                404,
            ),
            ("POST", "/create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 99}, 404),
            ("POST", "/get_info", {"model_id": mid, "type": "get_info"}, 404),
            (
                "POST",
                "/optim_step",
                {"model_id": mid, "seq_id": 99, "adam_params": {"learning_rate": 1.0}},
                404,
            ),
            ("POST", "/save_weights", {"model_id": mid, "path": "theirs", "seq_id": 98}, 404),
            ("POST", "/save_weights_for_sampler", {"model_id": mid, "path": "theirs", "seq_id": 97}, 404),
            (
                "POST",
                "/load_weights",
                {"model_id": mid, "path": owner["state"], "seq_id": 96, "optimizer": False},
                404,
            ),
            ("POST", "/retrieve_future", {"request_id": rid}, 410),
            # a session id the service never assigned (the client may not choose one)
            (
                "POST",
                "/create_model",
                {
                    "session_id": "a_b",
                    "model_seq_id": 0,
                    "base_model": served.service.cfg.base_model,
                    "lora_config": {"rank": 4},
                },
                404,
            ),
        ]
        for method, path, body, status in calls:
            r = http.request(method, path, json=body)
            TALLY["other key: tried"] += 1
            assert r.status_code == status, (path, r.status_code, r.text)
            assert "of this API key" in r.text or status == 410, r.text  # refused for ownership, not shape
            TALLY["other key: refused"] += 1
        # forward_backward: protobuf, as the SDK sends it
        from tinker.proto import tinker_public_pb2 as pb

        req = pb.ForwardBackwardRequest()
        req.model_id = mid
        req.seq_id = 95
        r = http.post(
            "/forward_backward",
            content=req.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
        )
        TALLY["other key: tried"] += 1
        assert r.status_code == 404, r.text
        TALLY["other key: refused"] += 1


def test_the_owner_is_unharmed(served: Served, owner: dict[str, Any]) -> None:
    """After every refused call: the owner's session, model (same weights), checkpoints and sampler work."""
    tc, client = owner["tc"], owner["client"]
    svc = served.service
    assert owner["session"] in svc.sessions and tc.model_id in svc.engine.models
    np.testing.assert_array_equal(lp(tc), owner["lp"])  # nobody stepped, saved over or loaded into it
    rest = tinker.RestClient(base_url=served.url, api_key=API_KEY)
    ids = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert ids == ["weights/owned", "sampler_weights/owned-s"]
    tc2 = client.create_training_client_from_state(owner["state"]).result()
    np.testing.assert_array_equal(lp(tc2), owner["lp"])
    out = (
        owner["sc"]
        .sample(types.ModelInput.from_ints([1, 5, 17]), 1, types.SamplingParams(max_tokens=1))
        .result()
    )
    assert len(out.sequences[0].tokens) == 1
    # the registry and indexes name owners by a digest, never by the key
    from rljob.common.storage import join, open_store

    reg = open_store(join(svc.cfg.checkpoints, "tinker")).read("registry.json")
    assert reg is not None and API_KEY.encode() not in reg and OTHER_KEY.encode() not in reg
    assert json.loads(reg)["models"][tc.model_id]["owner"].startswith("k-")
    print(json.dumps({"tinker_security_calls": dict(TALLY)}))
    assert TALLY["no key: tried"] == TALLY["no key: refused"] > 0
    assert TALLY["other key: tried"] == TALLY["other key: refused"] > 0


def test_storage_keys_are_one_to_one_and_contained(tmp_path: Path) -> None:
    """storage_key: distinct model ids never share a folder (`a_b:train:0` and `a:b:train:0` did), and
    none climbs out of the service's folder on local storage."""
    from rljob.trainer.tinker.server import storage_key

    ids = [
        "a_b:train:0",
        "a:b:train:0",
        "a/b:train:0",
        "a.b:train:0",
        "..",
        ".",
        "../weights/x",
        "a_3ab",
        "a:b",
    ]
    keys = [storage_key(i) for i in ids]
    assert len(set(keys)) == len(ids), dict(zip(ids, keys, strict=True))
    root = tmp_path / "tinker"
    for k in keys:
        assert "/" not in k and k not in (".", "..") and (root / k).resolve().parent == root.resolve()
