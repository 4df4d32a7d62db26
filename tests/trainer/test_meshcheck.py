"""`python -m rljob.trainer.meshcheck`: MaxText's own mesh of a run over host devices standing in for its TPU
devices (what `rljob drill` checks the full-size layout with), and its refusal, exit 2 with the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.recipes import manifest, resolve
from rljob.cli.drill.procs import base_env
from rljob.recipes.failure import EXIT_BAD_CONFIG
from rljob.recipes.runconfig import RunConfig
from rljob.trainer import meshcheck

pytestmark = pytest.mark.jax


def _run(rc: RunConfig, devices: int, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json(by_alias=True), encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-m", meshcheck.__name__, "--config", str(cfg), *args],
        env=base_env(devices),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )


def test_the_mesh_of_a_v5p_8_trainer_is_4_on_fsdp(tmp_path: Path) -> None:
    rc = resolve(manifest({}))
    proc = _run(rc, rc.trainer.devices, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["devices"] == rc.trainer.devices == 4
    assert {k: v for k, v in got["mesh"].items() if v != 1} == {"fsdp": 4}


def test_a_mesh_maxtext_refuses_exits_2_naming_the_field(tmp_path: Path) -> None:
    rc = resolve(manifest({}))
    proc = _run(rc, 3, tmp_path)  # 3 devices cannot hold the plan's fsdp of 4
    assert proc.returncode == EXIT_BAD_CONFIG, (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines()[-1].startswith("spec.trainer.mesh: MaxText refuses the mesh: ")
