"""The drill's compile stage (rljob.cli.drill.compile): its environment, and what it makes of the compile
check's exit status and report (the compile check itself: tests/trainer/test_compilecheck.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rljob.cli.drill import compile as compile_stage
from rljob.cli.drill.cases import EXIT_BAD, DrillBadInput, DrillFailed
from rljob.cli.drill.procs import base_env

REPORT = {"train_step": {"hbm_bytes": 1}}


def test_compile_env_is_the_cpu_platform_without_xla_flags() -> None:
    env = compile_stage.compile_env()
    assert "XLA_FLAGS" not in env
    assert env == {k: v for k, v in base_env(1).items() if k != "XLA_FLAGS"}


class _Rc:
    def model_dump_json(self, by_alias: bool) -> str:
        return '{"run": 1}'


def _run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rc: int, stdout: str, stderr: str) -> Any:
    seen: dict[str, Any] = {}

    def fake(cmd: list[str], **kw: Any) -> Any:
        seen.update(cmd=cmd, **kw)
        return SimpleNamespace(returncode=rc, stdout=stdout, stderr=stderr)

    monkeypatch.setattr(subprocess, "run", fake)
    try:
        return compile_stage.run_compile(_Rc(), tmp_path, 5.0)
    finally:
        assert seen["cmd"][1:] == [
            "-m",
            "rljob.trainer.compilecheck",
            "--config",
            str(tmp_path / "full-run.json"),
        ]
        assert (tmp_path / "full-run.json").read_text() == '{"run": 1}'
        assert (tmp_path / "compile.log").read_text() == stderr


def test_a_report_is_returned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = "log\n" + json.dumps({"compile": REPORT})
    assert _run(monkeypatch, tmp_path, 0, out, "") == REPORT


def test_a_program_that_does_not_fit_is_bad_input_with_its_lines(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    err = "noise\ncompile: train_step needs 99 GiB\nspec.trainer.mesh: use fsdp 8\n"
    with pytest.raises(DrillBadInput) as e:
        _run(monkeypatch, tmp_path, EXIT_BAD, json.dumps({"compile": REPORT}), err)
    assert e.value.problems == ["compile: train_step needs 99 GiB", "spec.trainer.mesh: use fsdp 8"]
    assert e.value.report == {"compile": REPORT}


@pytest.mark.parametrize(
    ("rc", "stdout"), [(1, json.dumps({"compile": REPORT})), (0, ""), (0, "not json"), (EXIT_BAD, "")]
)
def test_anything_else_fails_the_stage(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rc: int, stdout: str
) -> None:
    with pytest.raises(DrillFailed, match=r"compile stage \(python -m rljob\.trainer\.compilecheck\)"):
        _run(monkeypatch, tmp_path, rc, stdout, "boom")
