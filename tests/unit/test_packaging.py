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


def test_every_package_folder_is_listed() -> None:
    """A non-editable install (the images' `uv pip install .`) ships only the packages pyproject.toml lists:
    every folder with an __init__.py under a mapped folder must be one of them."""
    import tomllib

    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in setup["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([name, *rel.parts]))
    assert sorted(found - set(setup["packages"])) == []
    assert sorted(set(setup["packages"]) - found) == []
