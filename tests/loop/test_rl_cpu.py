"""The whole RL loop on CPU: trainer and sampler as separate processes over HTTP, storage on the GCS
emulator. It learns; a killed trainer resumes at the exact step; a killed sampler is waited for."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rljob.common.credentials import token_env
from rljob.common.ports import free_port
from rljob.local.localrun import local_run_config, sampler_command, trainer_command
from rljob.trainer.checkpoint import Checkpointer

pytestmark = [pytest.mark.jax, pytest.mark.slow]


def _lines(path: Path) -> list[dict[str, Any]]:
    """The step lines of a JSON-lines log (step = optimizer steps done)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rec = json.loads(line)
            if rec.get("event") == "step":
                out.append(rec)
    return out


def _tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _wait_for(
    pred: Any,
    timeout: float,
    what: str,
    procs: list[subprocess.Popen[bytes]],
    logs: list[Path] | None = None,
) -> None:
    """Wait for pred(); a process that exits meanwhile fails the test with the tail of its log."""
    deadline = time.monotonic() + timeout
    while not pred():
        for i, p in enumerate(procs):
            log = logs[i] if logs else None
            assert p.poll() is None, (
                f"{p.args!r} exited with {p.returncode} while waiting for {what}:\n{_tail(log)}"
            )
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_rl_cpu_learns(gcs_emulator: Any, tmp_path: Path) -> None:
    """`make rl-cpu` in short: from chance (1/32) to a 0.5 step mean within 80 steps (it gets there
    in about 25; the full run reaches >= 0.9)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljob.local.localrun",
            "--steps",
            "80",
            "--target",
            "0.5",
            "--stop-at-target",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    steps = [r for r in recs if r.get("event") == "step"]
    parity = next(r for r in recs if r.get("event") == "parity")
    assert parity["mean_abs_logprob_diff"] < 1e-4 and parity["adapter_version"] == 0
    assert steps[0]["step"] == 1 and steps[0]["reward_mean"] < 0.25
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    assert all(r["policy_lag"] in (0, 1) for r in steps)
    assert max(r["policy_lag"] for r in steps) == 1  # sampling overlapped training
    summary = recs[-1]
    assert summary["first_at_target"] is not None, steps[-5:]


def test_trainer_restart_resumes_and_sampler_kill_is_waited_for(gcs_emulator: Any, tmp_path: Path) -> None:
    bucket = gcs_emulator.new_bucket()
    port = free_port(span=2)
    rc = local_run_config(f"gs://{bucket}", port, tmp_path / "progress.json", {"steps": 14})
    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json())
    env = {**os.environ, "PYTHONSAFEPATH": "1", **token_env()}  # the run's token, as a pod's Secret gives it
    metrics = tmp_path / "metrics.jsonl"

    def sampler() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            sampler_command(cfg),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "sampler.log").open("ab"),
        )

    def trainer() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            trainer_command(cfg, metrics, "--eval-every", "0"),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "trainer.log").open("ab"),
        )

    logs = [tmp_path / "sampler.log", tmp_path / "trainer.log"]
    s, t = sampler(), trainer()
    try:
        _wait_for(lambda: len(_lines(metrics)) >= 4, 600, "4 steps", [s, t], logs)
        t.send_signal(signal.SIGKILL)
        t.wait()
        ckpt = Checkpointer(rc.storage.checkpoints)
        resume_at = ckpt.latest_step()
        ckpt.close()
        assert resume_at is not None and resume_at >= 4
        done_before = [r["step"] for r in _lines(metrics)]
        t = trainer()
        _wait_for(lambda: len(_lines(metrics)) > len(done_before), 600, "a step after restart", [s, t], logs)
        first_after = _lines(metrics)[len(done_before)]["step"]
        assert first_after == resume_at + 1, (done_before, first_after)
        progress = json.loads((tmp_path / "progress.json").read_text())
        assert progress["resumedFromStep"] == resume_at

        # Kill the sampler: the trainer waits, then continues once a new sampler is up.
        _wait_for(lambda: _lines(metrics)[-1]["step"] >= resume_at + 2, 600, "2 more steps", [s, t], logs)
        s.send_signal(signal.SIGKILL)
        s.wait()
        time.sleep(3)
        assert t.poll() is None, "the trainer must wait for the sampler, not fail"
        s = sampler()
        assert t.wait(timeout=900) == 0
        steps = [r["step"] for r in _lines(metrics)]
        assert steps[-1] == 14
        assert steps[len(done_before) :] == list(range(resume_at + 1, 15))
        assert "sampler unavailable" in (tmp_path / "trainer.log").read_text()
    finally:
        for p in (s, t):
            if p.poll() is None:
                p.kill()
                p.wait()
