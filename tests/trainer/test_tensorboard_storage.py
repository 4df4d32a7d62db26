"""The trainer's step metrics land as TensorBoard event files under the run's storage
(StoragePaths.tensorboard, under storage.root), where `rljob status` reads them: they outlive the pod."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.trainer_run import local_run_config, write_run_config
from rljob.cli import metrics

pytestmark = [pytest.mark.jax, pytest.mark.slow]  # ~100 s on 2 busy cores

SYNTHETIC = ("--rollouts", "synthetic", "--steps", "2")
TAGS = ("reward_mean", "loss", "kl", "tokens_per_s", "padding_fraction", "update_skipped", "skipped_total")


def test_synthetic_run_writes_events_under_storage(tmp_path: Path) -> None:
    rc = local_run_config(str(tmp_path / "s"), tmp_path)
    # The KL term is computed (and logged) only with a penalty.
    algorithm = rc.spec.algorithm.model_copy(update={"kl_penalty_coef": 0.05})
    rc = rc.model_copy(update={"spec": rc.spec.model_copy(update={"algorithm": algorithm})})
    cfg = write_run_config(rc, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "rljob.trainer.main", "--config", str(cfg), "--model", "tiny", *SYNTHETIC],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONSAFEPATH": "1", "JAX_PLATFORMS": "cpu"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert rc.storage.tensorboard == f"{tmp_path}/s/team/tiny/tensorboard"
    files = metrics.read_event_files(rc.storage.tensorboard)
    assert files, list((tmp_path / "s").rglob("*"))
    got = metrics.scalars(files)
    for tag in TAGS:
        assert sorted(got.get(f"train/{tag}", {})) == [1, 2], (tag, sorted(got))
    assert 0.0 <= got["train/padding_fraction"][1] < 1.0
    assert got["train/tokens_per_s"][1] > 0
    assert got["train/update_skipped"] == {1: 0.0, 2: 0.0}
