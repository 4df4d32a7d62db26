"""The package layout: rljob.<folder> mapping, and the stdlib `operator` is never shadowed."""

import importlib
import operator
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("folder", ["cli", "recipes", "operator", "trainer", "sampler", "common", "local"])
def test_folder_is_importable_as_rljob_subpackage(folder: str) -> None:
    mod = importlib.import_module(f"rljob.{folder}")
    assert mod.__file__ is not None
    assert Path(mod.__file__).resolve() == REPO / folder / "__init__.py"


def test_stdlib_operator_not_shadowed() -> None:
    assert Path(operator.__file__).name == "operator.py"
    assert operator.or_(1, 2) == 3


def test_cli_runs_from_repo_root() -> None:
    """`.venv/bin/rljob` from the repo root must not pick up ./operator as the stdlib module."""
    exe = Path(sys.executable).parent / "rljob"
    proc = subprocess.run([str(exe), "--help"], cwd=REPO, capture_output=True, text=True)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.startswith("usage: rljob")
