"""The compile stage (``rljob drill --compile``, instead of the scaled run): the trainer's TPU programs
compiled at full size for the run's topology by libtpu's compiler on this CPU machine
(``python -m rljob.trainer.compilecheck``): each program's HBM per device and cost, a program that does
not fit a DrillBadInput naming the fields to change (docs/drill.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from .cases import EXIT_BAD, DrillBadInput, DrillFailed
from .procs import base_env, last_lines, python


def compile_env() -> dict[str, str]:
    """The compile stage's environment: JAX on the CPU (libtpu only describes the topology and compiles),
    none of the scaled run's XLA flags (they would reach the TPU compiler too)."""
    env = base_env(1)
    env.pop("XLA_FLAGS", None)
    return env


def run_compile(rc: Any, workdir: Path, timeout: float) -> dict[str, Any]:
    """The trainer's TPU programs compiled at full size for the run's topology (every slice) by libtpu's
    compiler (``python -m rljob.trainer.compilecheck``): their memory and cost per device. A program that
    does not fit raises DrillBadInput (the fields to change, a value that fits), with the figures."""
    cfg = workdir / "full-run.json"
    cfg.write_text(rc.model_dump_json(by_alias=True), encoding="utf-8")
    try:
        proc = subprocess.run(
            [python(), "-m", "rljob.trainer.compilecheck", "--config", str(cfg)],
            env=compile_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=workdir,
        )
    except subprocess.TimeoutExpired:
        raise DrillFailed(f"compile stage: not done in {timeout:.0f} s (--compile-timeout)") from None
    (workdir / "compile.log").write_text(proc.stderr, encoding="utf-8")
    last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    report: dict[str, Any] = json.loads(last[0])["compile"] if last and last[0].startswith("{") else {}
    if proc.returncode == EXIT_BAD and report:
        lines = [x for x in proc.stderr.splitlines() if x.startswith(("compile: ", "spec."))]
        raise DrillBadInput(lines or ["compile: a program does not fit"], {"compile": report})
    if proc.returncode != 0 or not report:
        raise DrillFailed("compile stage (python -m rljob.trainer.compilecheck):\n" + last_lines(proc.stderr))
    return report
