"""The Tinker service's own storage (rljob.trainer.tinker.server): a save_state overwrite writes the new
state before the old one goes (a SIGKILL between the halves loses nothing), sampler weights re-saved
under one name are a new version with a new adapter name (the samplers serve the new weights), the
registry is snapshotted and written under one lock, and the sampling-session table is bounded, dropped
with its session and restored after a restart.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.jax

import httpx  # noqa: E402
import tinker  # noqa: E402
from fixtures.tinker import API_KEY, Served, serve_tinker, tinker_run_config  # noqa: E402
from tinker import types  # noqa: E402

TESTED_MODULES = (
    "rljob.trainer.tinker.server",
    "rljob.local.tinker_cpu",
)


@pytest.fixture(scope="module")
def served(gcs_emulator: Any, cpu_policy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = f"gs://{gcs_emulator.new_bucket('tinker-store')}"
    progress = tmp_path_factory.mktemp("tinker-store") / "progress.json"
    with serve_tinker(lambda port: tinker_run_config(root, port, progress), cpu_policy) as s:
        yield s


def datum(seq: list[int], weights: list[float] | None = None) -> Any:
    inputs: dict[str, Any] = {"target_tokens": seq[1:]}
    if weights is not None:
        inputs["weights"] = weights
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)


def test_resaved_sampler_weights_are_served_new(served: Served) -> None:
    """save_weights_for_sampler twice under one name: the second save is a new version (directory and
    adapter name), so a sampler that served the first loads the second; sampling clients of the name
    follow it, and the old version's files are gone."""
    from rljob.common.storage import open_store

    prompt = [1, 5, 17, 6]
    greedy = types.SamplingParams(max_tokens=1, temperature=0.0)
    with tinker.ServiceClient(base_url=served.url, api_key=API_KEY) as client:
        tc = client.create_lora_training_client(
            base_model=served.service.cfg.base_model, rank=8, seed=3
        ).result()

        def check(sc: Any) -> None:
            """The sampler's log-prob of its greedy token is the trainer's under the current weights."""
            seq = sc.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
            fwd = tc.forward([datum([*prompt, seq.tokens[0]])], "cross_entropy").result()
            want = float(fwd.loss_fn_outputs[0]["logprobs"].data[-1])
            assert seq.logprobs[0] == pytest.approx(want, abs=1e-4)

        path = tc.save_weights_for_sampler("same").result().path
        first = client.create_sampling_client(model_path=path).result()
        check(first)  # the samplers now hold version 1
        svc = served.service
        v1 = svc.sampling[first._sampling_session_id]
        for _ in range(3):
            tc.forward_backward([datum([*prompt, 9, 9], [1.0] * 5)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=0.2)).result()
        assert tc.save_weights_for_sampler("same").result().path == path
        second = client.create_sampling_client(model_path=path).result()
        v2 = svc.sampling[second._sampling_session_id]
        check(second)  # the new weights, not the adapter the samplers cached under the old name
        check(first)  # a sampling client of the name follows it
        folder_of = {v.uri.rsplit("/", 1)[0] for v in (v1, v2)}
        assert v2.adapter != v1.adapter and v2.uri != v1.uri and len(folder_of) == 1
        folder = open_store(v1.uri.rsplit("/", 1)[0])
        assert {k.split("/")[0] for k in folder.list()} == {v2.uri.rsplit("/", 1)[1]}  # one version left


def _service(tmp_path: Path, **cfg: Any) -> Any:
    """A Service over local storage with a stand-in engine (a dict of models): for its registry and table."""
    from rljob.trainer.tinker.server import Service, ServiceConfig

    engine = SimpleNamespace(models={}, max_models=4, unload=lambda m: None)
    config = ServiceConfig(
        base_model="m",
        checkpoints=str(tmp_path / "ckpt"),
        adapters=str(tmp_path / "adapters"),
        samplers=["http://127.0.0.1:1"],
        max_context=32,
        api_keys=frozenset({"tml-key-1"}),
        **cfg,
    )
    return Service(engine, config)  # type: ignore[arg-type]


class _Model:
    """A registry entry whose config() holds thread 'first' until ``written`` is set (or 2 s pass)."""

    def __init__(self, model_id: str, entered: threading.Event, written: threading.Event) -> None:
        self.model_id, self.entered, self.written = model_id, entered, written

    def config(self) -> dict[str, Any]:
        if threading.current_thread().name == "first":
            self.entered.set()
            self.written.wait(2.0)
        return {"model_id": self.model_id}


def test_registry_writes_land_in_snapshot_order(tmp_path: Path) -> None:
    """Two registry writes racing: the first snapshot is slow, the second is newer. The file must end as
    the newer state (a snapshot taken outside the lock was written after the newer one and lost m2)."""
    svc = _service(tmp_path)
    entered, written = threading.Event(), threading.Event()
    svc.engine.models["m1"] = _Model("m1", entered, written)
    first = threading.Thread(target=svc._save_registry, name="first")
    first.start()
    assert entered.wait(10)
    svc.engine.models["m2"] = _Model("m2", entered, written)

    def second() -> None:
        svc._save_registry()
        written.set()

    t2 = threading.Thread(target=second, name="second")
    t2.start()
    first.join(20)
    t2.join(20)
    reg = json.loads((tmp_path / "ckpt" / "tinker" / "registry.json").read_bytes())
    assert sorted(reg["models"]) == ["m1", "m2"]


def test_sampling_sessions_are_bounded_dropped_with_their_session_and_restored(served: Served) -> None:
    """create_sampling_session beyond the bound keeps the newest; a restarted service has them (one object
    each); ending the session drops them all (table and storage)."""
    from rljob.common.storage import join, open_store
    from rljob.trainer.tinker.server import SAMPLING_DIR, Service

    svc = served.service
    cap = 5
    saved = svc.cfg
    svc.cfg = dataclasses.replace(svc.cfg, max_sampling_sessions=cap)
    store = open_store(join(svc.cfg.checkpoints, "tinker", SAMPLING_DIR))
    before = set(svc.sampling)
    try:
        with httpx.Client(
            base_url=f"{served.url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60
        ) as http:
            body = {"tags": [], "user_metadata": {}, "sdk_version": "t", "type": "create_session"}
            sid = http.post("/create_session", json=body).raise_for_status().json()["session_id"]
            ids = []
            for i in range(3 * cap):
                req = {"session_id": sid, "sampling_session_seq_id": i, "base_model": svc.cfg.base_model}
                ids.append(
                    http.post("/create_sampling_session", json=req)
                    .raise_for_status()
                    .json()["sampling_session_id"]
                )
            mine = [k for k in svc.sampling if k not in before]
            assert len(svc.sampling) <= cap and set(mine) <= set(ids[-cap:])
            assert len(store.list()) == len(svc.sampling)
            # a restarted service (same storage) has the table and the session with its owner (its
            # engine restores no model here: the table is what is checked)
            from rljob.trainer.tinker.engine import RequestError

            def no_models() -> Any:
                raise RequestError("not restored in this test")

            again = Service(SimpleNamespace(models={}, max_models=4, abstract_state=no_models), svc.cfg)  # type: ignore[arg-type]
            again.restore()
            assert (
                set(again.sampling) == set(svc.sampling)
                and again.session_owner[sid] == svc.session_owner[sid]
            )
            http.post(f"/sessions/{sid}/finish", json={}).raise_for_status()
            assert not [k for k in svc.sampling if k.startswith(sid)]
            assert all(json.loads(store.read(k) or b"{}").get("session") != sid for k in store.list())
    finally:
        svc.cfg = saved


# ------------------------------------------------------------------------- SIGKILL inside an overwrite

_KILLER = """
import os, signal, sys
from pathlib import Path
from rljob.trainer import checkpoint

marker, point = Path(sys.argv[1]), sys.argv[2]
original = checkpoint.Checkpointer.save
named = {"saves": 0}


def save(self, step, state, meta):
    is_named = "/weights/" in self.directory
    if is_named:
        named["saves"] += 1
    if is_named and named["saves"] == 2 and point == "before-write":
        marker.write_text(point)
        os.kill(os.getpid(), signal.SIGKILL)
    original(self, step, state, meta)
    if is_named and named["saves"] == 2 and point == "after-write":
        marker.write_text(point)
        os.kill(os.getpid(), signal.SIGKILL)


checkpoint.Checkpointer.save = save
from rljob.trainer.tinker.main import main

sys.exit(main(sys.argv[3:]))
"""


def _serve(args: list[str], log: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        args,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        stdout=subprocess.PIPE,
        stderr=log.open("ab"),
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{") and json.loads(line).get("event") == "serving":
            return proc, json.loads(line)
    raise AssertionError(f"the service exited ({proc.wait()}); see {log}")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before-write", "after-write"])
def test_a_kill_inside_a_save_state_overwrite_loses_nothing(
    gcs_emulator: Any, tmp_path: Path, point: str
) -> None:
    """save_state("ck"), train, save_state("ck", overwrite=True) in a service that SIGKILLs itself inside
    that overwrite: before its new state is written, or after it committed. The kill happened (exit -9,
    the marker), and a restarted service lists "ck" and loads it: the old state (before) or the new one
    (after), never nothing."""
    from rljob.common.ports import free_port
    from rljob.local.tinker_cpu import local_service_config, service_command

    rc = local_service_config(
        f"gs://{gcs_emulator.new_bucket('tinker-kill')}", free_port(span=2), tmp_path / "p.json", toy=True
    )
    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json())
    port, log, marker = free_port(), tmp_path / "service.log", tmp_path / "killed"
    args = [sys.executable, "-c", _KILLER, str(marker), point, *service_command(cfg, port)[3:]]
    proc, ready = _serve(args, log)
    probe = [datum([1, 5, 17, 6, 9])]
    batch = [datum([1, 4, 20, 3, 5], [1.0] * 4)]
    client = tinker.ServiceClient(base_url=ready["url"], api_key=API_KEY)
    tc = client.create_lora_training_client(base_model=ready["base_model"], rank=8, seed=5).result()

    def lp(c: Any) -> np.ndarray:
        return np.asarray(c.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data)

    try:
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        path = tc.save_state("ck").result().path
        old = lp(tc)
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        new = lp(tc)
        assert not np.array_equal(old, new)
        tc.save_state("ck", overwrite=True)  # not awaited: the service dies inside it
        assert proc.wait(timeout=300) == -signal.SIGKILL
        assert marker.read_text() == point  # the fault happened where it was placed
    finally:
        if proc.poll() is None:
            proc.kill()
    proc, ready = _serve(service_command(cfg, port), log)
    try:
        with tinker.ServiceClient(base_url=ready["url"], api_key=API_KEY) as again:
            rest = tinker.RestClient(base_url=ready["url"], api_key=API_KEY)
            listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
            assert listed == [path]
            for p in listed:  # every listed name loads
                loaded = again.create_training_client_from_state(p).result()
                np.testing.assert_array_equal(lp(loaded), old if point == "before-write" else new)
            client.close("success").result(timeout=60)  # the first client's session was restored too
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        time.sleep(0)
