"""The Tinker service on a trainer of two processes (as two hosts of a TPU slice: jax.distributed through a
localhost coordinator, gloo collectives on CPU, as tests/trainer/test_multihost.py runs the loop): process
0 answers HTTP, process 1 runs the same device operations (rljob.trainer.tinker.collective). Driven with
the official `tinker` SDK, it computes what the one-process service computes on the same seed:
forward_backward's loss and log-probs, optim_step's update, save_state / load_state (orbax over both
processes), the PEFT export of sampler weights (gathered over both), prompt log-probs on the trainer
(compute_logprobs; the CPU sampler of make tinker-cpu serves the samples); a refused request does not
stop process 1; stopping process 0 ends process 1; a restarted pair restores a live client.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.tinker import tinker_run_config

pytestmark = [pytest.mark.jax, pytest.mark.slow]

import tinker  # noqa: E402
from tinker import types  # noqa: E402

KEY = "tml-multihost"
BASE = "rljob/tiny-qwen3"


def _port() -> int:
    from rljob.common.ports import free_port

    return int(free_port())


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _datum(seq: list[int], weights: list[float] | None = None) -> Any:
    inputs: dict[str, Any] = {"target_tokens": seq[1:]}
    if weights is not None:
        inputs["weights"] = weights
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs=inputs)


BATCH = [_datum([1, 5, 17, 6, 9, 9], [0, 0, 1, 1, 1]), _datum([1, 4, 20, 3, 5])]


def _lps(out: Any) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].data, np.float32) for o in out.loss_fn_outputs]


class _Service:
    """``processes`` processes of `python -m rljob.trainer.tinker.main` on one run config (``tmp``'s, made
    once: a second service on the same folder is a restart) on ``port``; process 0 serves. ``sampler``:
    the CPU sampler of make tinker-cpu beside it (the same base model)."""

    def __init__(self, tmp: Path, processes: int, *, port: int = 0, sampler: bool = True) -> None:
        cfg = tmp / "run.json"
        if not cfg.exists():
            tmp.mkdir()
            rc = tinker_run_config("gs://rljob-test", _port(), tmp / "progress.json")
            store = str(tmp / "store")  # local storage, every process on this machine
            paths = {
                k: str(v).replace("gs://rljob-test", store, 1) for k, v in rc.storage.model_dump().items()
            }
            rc = rc.model_copy(update={"storage": rc.storage.model_copy(update=paths)})
            cfg.write_text(rc.model_dump_json(indent=1))
        sampler_port = int(json.loads(cfg.read_text())["endpoints"]["samplers"][0].rsplit(":", 1)[1])
        coordinator = f"127.0.0.1:{_port()}"
        cmd = [sys.executable, "-m", "rljob.trainer.tinker.main", "--config", str(cfg), "--model", "tiny"]
        cmd += ["--dev-any-key", "--host", "127.0.0.1", "--port", str(port)]
        self.procs: list[subprocess.Popen[str]] = []
        self.logs = [tmp / f"process{i}.log" for i in range(processes)]
        from rljob.common.credentials import token_env
        from rljob.local.localrun import sampler_command

        # One run token for the sampler and every service process (the sampler refuses calls without it).
        base = {**os.environ, "PYTHONSAFEPATH": "1", "JAX_PLATFORMS": "cpu", **token_env()}
        env = dict(base)
        self.sampler: subprocess.Popen[bytes] | None = None
        if sampler:
            with (tmp / "sampler.log").open("a") as err:
                self.sampler = subprocess.Popen(sampler_command(cfg), env=env, stdout=err, stderr=err)
        for i in range(processes):
            env = dict(base)
            if processes > 1:
                env.update(
                    RLJOB_NUM_PROCESSES=str(processes), RLJOB_PROCESS_ID=str(i), RLJOB_COORDINATOR=coordinator
                )
            with self.logs[i].open("a") as err:
                self.procs.append(
                    subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
                )
        ready: dict[str, Any] = {}

        def read() -> None:
            out = self.procs[0].stdout
            assert out is not None
            for line in out:
                if line.startswith("{") and json.loads(line).get("event") == "serving":
                    ready.update(json.loads(line))
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(600)
        assert ready, f"process 0 did not serve: {self.logs[0].read_text()[-3000:]}"
        self.url = str(ready["url"])
        assert ready["processes"] == processes
        self.restored: list[str] = ready["restored"]
        deadline = time.monotonic() + 300
        while self.sampler is not None and not _listening(sampler_port):
            assert self.sampler.poll() is None and time.monotonic() < deadline, (
                tmp / "sampler.log"
            ).read_text()
            time.sleep(0.5)

    def stop(self) -> list[int | None]:
        if self.sampler is not None:
            self.sampler.terminate()
            self.sampler.wait(60)
        self.procs[0].send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=120))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(None)
        return codes


def _session(url: str) -> dict[str, Any]:
    """What the SDK computes against the service at ``url``: losses, log-probs and metrics of a few steps,
    a save_state / load_state round trip, sampler weights."""
    out: dict[str, Any] = {}
    with tinker.ServiceClient(base_url=url, api_key=KEY) as client:
        base = BASE
        tc = client.create_lora_training_client(base_model=base, rank=4, seed=5).result()
        fb = tc.forward_backward(BATCH, "cross_entropy").result()
        out["loss0"] = fb.metrics["loss:sum"]
        out["lp0"] = _lps(fb)
        step = tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        out["grad_norm"] = step.metrics["optim/grad_norm"]
        out["lp1"] = _lps(tc.forward(BATCH, "cross_entropy").result())
        path = tc.save_state("one").result().path
        with pytest.raises(tinker.RequestFailedError, match="exists"):  # refused inside an operation
            tc.save_state("one").result()
        tc.forward_backward(BATCH, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        out["lp2"] = _lps(tc.forward(BATCH, "cross_entropy").result())
        tc.load_state_with_optimizer(path).result()
        out["lp_loaded"] = _lps(tc.forward(BATCH, "cross_entropy").result())
        again = client.create_training_client_from_state_with_optimizer(path).result()
        out["lp_from_state"] = _lps(again.forward(BATCH, "cross_entropy").result())
        out["sampler_path"] = tc.save_weights_for_sampler("w").result().path
        # prompt log-probs on the trainer (the sampler weights' adapter loaded on every process)
        sc = client.create_sampling_client(model_path=out["sampler_path"])
        out["prompt_lp"] = np.asarray(
            sc.compute_logprobs(types.ModelInput.from_ints([1, 5, 17, 6, 9])).result()[1:]
        )
        with pytest.raises(tinker.RequestFailedError, match="rank"):  # refused before any collective
            client.create_lora_training_client(base_model=base, rank=10_000).result()
        out["lp_after_refusals"] = _lps(tc.forward(BATCH, "cross_entropy").result())
    return out


def test_two_processes_serve_like_one(tmp_path: Path) -> None:
    results = []
    for processes in (1, 2):
        svc = _Service(tmp_path / f"p{processes}", processes)
        try:
            results.append(_session(svc.url))
        finally:
            codes = svc.stop()
        assert codes == [0] * processes, [log.read_text()[-3000:] for log in svc.logs]
    one, two = results
    assert two["loss0"] == pytest.approx(one["loss0"], rel=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    np.testing.assert_allclose(two["prompt_lp"], one["prompt_lp"], rtol=1e-5, atol=1e-6)
    for key in ("lp0", "lp1", "lp2", "lp_loaded", "lp_from_state", "lp_after_refusals"):
        for a, b in zip(two[key], one[key], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=key)
    for r in results:
        assert not np.allclose(r["lp1"][0], r["lp0"][0])  # the step changed the adapter
        for a, b in zip(r["lp_loaded"], r["lp1"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)  # the saved state came back
        for a, b in zip(r["lp_from_state"], r["lp1"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        for a, b in zip(r["lp_after_refusals"], r["lp_loaded"], strict=True):
            np.testing.assert_array_equal(a, b)
        # the sampler weights are the loaded state's: their prompt log-probs are forward's
        np.testing.assert_allclose(r["prompt_lp"], r["lp_loaded"][0][:4], rtol=1e-5, atol=1e-6)
    # the sampler weights of the two-process service: the whole adapter, as the one-process service wrote
    from safetensors.numpy import load as st_load

    weights = []
    for d in ("p1", "p2"):
        files = sorted((tmp_path / d / "store").rglob("adapter_model.safetensors"))
        assert len(files) == 1, files
        weights.append(dict(st_load(files[0].read_bytes())))
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        np.testing.assert_allclose(weights[1][k], weights[0][k], rtol=1e-5, atol=1e-6, err_msg=k)


# make test-long (50 s): make test keeps a one-process service killed and restored
# (tests/tinker/test_tinker_slow.py::test_save_state_kill_and_continue_step_exactly) and two processes
# serving as one (above).
@pytest.mark.long
def test_a_restarted_two_process_service_restores_its_clients(tmp_path: Path) -> None:
    """Two processes stopped with a training client live (its session not ended), then started again on
    the same storage: both restore the client from its automatic checkpoint (an orbax restore over both
    processes), and the client's next requests continue from it."""
    port = _port()
    svc = _Service(tmp_path / "run", 2, port=port, sampler=False)
    running = [svc]
    try:
        # closed (its session finished) while the restarted service runs
        with tinker.ServiceClient(base_url=svc.url, api_key=KEY) as client:
            tc = client.create_lora_training_client(base_model=BASE, rank=4, seed=9).result()
            tc.forward_backward(BATCH, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
            want = _lps(tc.forward(BATCH, "cross_entropy").result())
            running.remove(svc)
            assert svc.stop() == [0, 0]
            again = _Service(tmp_path / "run", 2, port=port, sampler=False)
            running.append(again)
            assert again.restored == [tc.model_id]
            got = _lps(tc.forward(BATCH, "cross_entropy").result())
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
            step = tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
            assert step.metrics["optim/step"] == 2.0
    finally:
        assert [s.stop() for s in running] in ([], [[0, 0]])
