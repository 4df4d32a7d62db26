"""A pod without Google credentials: each entrypoint says so in one line naming spec.storage.root and
exits 1 (a counted restart: a pod's metadata server can answer late), never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from rljob.common.credentials import token_env
from rljob.local.localrun import local_run_config
from rljob.recipes.failure import NO_CREDENTIALS

pytestmark = [pytest.mark.jax]


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "rljob.trainer.main"],
        ["-m", "rljob.sampler.main", "--backend", "cpu", "--host", "127.0.0.1", "--no-watch"],
    ],
    ids=["trainer", "sampler"],
)
def test_missing_credentials_is_one_line(argv: list[str], tmp_path: Path) -> None:
    rc = local_run_config("gs://rljob-no-such-bucket", 1, tmp_path / "progress.json", {"steps": 1})
    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json())
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONSAFEPATH": "1", "NO_GCE_CHECK": "True"}
    env.update(token_env())  # the run's token, which the sampler requires
    proc = subprocess.run(
        [sys.executable, *argv, "--config", str(cfg)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(NO_CREDENTIALS)
