"""Multi-host training, as on a multi-host TPU slice, with two processes on CPU (jax.distributed through a
localhost coordinator, gloo collectives): only process 0 obtains a step's rollouts and every process
trains on process 0's (share_from_first), and two processes of `rljob-trainer` compute what one process
computes, step by step."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fixtures.trainer_run import local_run_config, write_run_config

pytestmark = [pytest.mark.jax, pytest.mark.slow]

SHARE = """
import hashlib, sys
from rljob.trainer.main import DistributedEnv, initialize_distributed
from rljob.trainer.runtime import share_from_first
pid, port = int(sys.argv[1]), sys.argv[2]
initialize_distributed(DistributedEnv(f"127.0.0.1:{port}", 2, pid, False))
blob = b"rollouts of step 7 from process 0;" * 5000 if pid == 0 else None
print(hashlib.sha256(share_from_first(blob)).hexdigest(), flush=True)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONSAFEPATH": "1", "JAX_PLATFORMS": "cpu", **extra}


def _both(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    return [o for o, _ in outs]


def test_every_process_gets_process_zeros_rollouts() -> None:
    port = str(_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SHARE, str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for i in range(2)
    ]
    want = hashlib.sha256(b"rollouts of step 7 from process 0;" * 5000).hexdigest()
    assert [o.strip().splitlines()[-1] for o in _both(procs, 240)] == [want, want]


def _steps(log: Path) -> list[dict[str, Any]]:
    recs = [json.loads(x) for x in log.read_text().splitlines()]
    return [r for r in recs if r.get("event") == "step"]


def test_two_processes_train_like_one(tmp_path: Path) -> None:
    """The same synthetic run (tiny model, 2 steps) as 2 processes x 1 CPU device (fsdp over the two
    processes) and as 1 process: same loss and gradient norm at every step, to float32 rounding."""
    args = ["-m", "rljob.trainer.main", "--model", "tiny", "--rollouts", "synthetic", "--steps", "2"]
    one = tmp_path / "one"
    one.mkdir()
    cfg1 = write_run_config(local_run_config(str(one / "store"), one), one)
    subprocess.run(
        [sys.executable, *args, "--config", str(cfg1), "--log-jsonl", str(one / "log.jsonl")],
        env=_env(),
        check=True,
        capture_output=True,
        timeout=600,
    )
    two = tmp_path / "two"
    two.mkdir()
    cfg2 = write_run_config(local_run_config(str(two / "store"), two), two)
    port = str(_port())
    procs = [
        subprocess.Popen(
            [sys.executable, *args, "--config", str(cfg2), "--log-jsonl", str(two / f"log{i}.jsonl")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(RLJOB_NUM_PROCESSES="2", RLJOB_PROCESS_ID=str(i), RLJOB_COORDINATOR=f"127.0.0.1:{port}"),
        )
        for i in range(2)
    ]
    _both(procs, 600)
    start = json.loads((two / "log0.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["processes"] == 2
    single, multi = _steps(one / "log.jsonl"), _steps(two / "log0.jsonl")
    assert [r["step"] for r in multi] == [r["step"] for r in single] == [1, 2]
    for a, b in zip(multi, single, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["rollouts"] == b["rollouts"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert [r["loss"] for r in _steps(two / "log1.jsonl")] == [r["loss"] for r in multi]  # one SPMD program
