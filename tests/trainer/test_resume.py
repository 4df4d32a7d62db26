"""``rljob-trainer`` killed with SIGKILL at random steps and restarted computes exactly what an
uninterrupted run computes (orbax checkpoints and the rollout cache on the GCS emulator)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.gcs import GcsEmulator
from fixtures.trainer_run import local_run_config, write_run_config

pytestmark = [pytest.mark.jax, pytest.mark.slow]

STEPS = 4


def _trainer(config: Path, tmp: Path, name: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONSAFEPATH": "1",
        "JAX_COMPILATION_CACHE_DIR": str(tmp.parent / "jax-cache"),
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rljob.trainer.main",
            "--config",
            str(config),
            "--rollouts",
            "synthetic",
            "--model",
            "tiny",
            "--steps",
            str(STEPS),
        ],
        stdout=subprocess.PIPE,
        stderr=(tmp / f"{name}.log").open("w"),
        text=True,
        cwd=tmp,
        env=env,
    )


def _final_lora(root: str, tmp: Path) -> dict[str, np.ndarray]:
    from rljob.trainer.export import latest_version, read_adapter

    adapters = f"{root}/team/tiny/adapters"
    assert latest_version(adapters) == STEPS
    tensors, config = read_adapter(adapters, STEPS)
    assert config["peft_type"] == "LORA"
    return tensors


def test_killed_and_resumed_equals_uninterrupted(gcs_emulator: GcsEmulator, tmp_path: Path) -> None:
    roots = {
        name: f"gs://{gcs_emulator.new_bucket(f'resume-{name}')}/runs" for name in ("straight", "killed")
    }
    # The uninterrupted run and the first attempt of the killed run go side by side.
    cfg = {}
    for n, root in roots.items():
        (tmp_path / n).mkdir()
        cfg[n] = write_run_config(local_run_config(root, tmp_path / n), tmp_path / n)
    straight = _trainer(cfg["straight"], tmp_path / "straight", "straight")
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    kills = sorted(int(k) for k in rng.choice(np.arange(1, STEPS), size=2, replace=False))
    events: list[dict[str, Any]] = []
    attempt = 0
    for kill_at in [*kills, None]:
        proc = _trainer(cfg["killed"], tmp_path / "killed", f"killed-{attempt}")
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            ev = json.loads(line)
            events.append(ev)
            if kill_at is not None and ev.get("event") == "step" and ev["step"] == kill_at:
                proc.send_signal(signal.SIGKILL)
                break
        rc = proc.wait()
        assert rc == (-signal.SIGKILL if kill_at is not None else 0), (
            tmp_path / "killed" / f"killed-{attempt}.log"
        ).read_text()[-2000:]
        attempt += 1
    assert straight.wait() == 0, (tmp_path / "straight" / "straight.log").read_text()[-2000:]
    resumes = [e["step"] for e in events if e.get("event") == "resume"]
    assert resumes == kills, events
    # Every step ran at least once; a step re-run after a kill used the cached rollouts or re-made
    # identical ones (a pure function of seed and step).
    assert sorted({e["step"] for e in events if e.get("event") == "step"}) == list(range(1, STEPS + 1))
    a, b = _final_lora(roots["straight"], tmp_path), _final_lora(roots["killed"], tmp_path)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6, err_msg=k)
    progress = json.loads((tmp_path / "killed" / "progress.json").read_text())
    assert progress["step"] == STEPS and progress["resumedFromStep"] == kills[-1]
    assert progress["lastCheckpointStep"] == STEPS and progress["adapterVersion"] == STEPS
