"""The benches `make bench` runs still run: each quick one, with small arguments, exits 0 and prints JSON
lines of the bench's form (``bench``, ``metric``, ``value``, then context). Figures are not judged here
(bench/ is where performance lives); a bench broken by a change elsewhere is (two were: an arm's timer
passed to json.dumps, a worker's submit called without its key). The long ones (the compiled TPU programs,
the tunix arms, the operator at scale, the cluster's start) run only in `make bench` (the training-step
benches' pure parts have tests in tests/trainer_numerics)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

QUICK = [
    ("adapter_swap", ["--versions", "2"]),
    ("logprob_head_memory", []),
    ("packing_padding", []),
    ("pad_first_tiles", []),
    ("render_latency", ["--runs", "2"]),
    ("sampler_fanout", ["--replicas", "2", "--prompts", "8", "--repeats", "1"]),
    ("tinker_overhead", ["--datums", "8", "--repeats", "1"]),
    ("tinker_sessions", ["--total", "200", "--batch", "100"]),
    ("train_step_chip", []),  # without a TPU: one line saying it skipped
    ("webhook_worst_case", []),
]


def bench_lines(stdout: str) -> list[dict[str, object]]:
    """The JSON lines of a bench's output (other lines are its libraries' logging)."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "args"), QUICK, ids=[n for n, _ in QUICK])
def test_a_quick_bench_runs(name: str, args: list[str]) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONSAFEPATH": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = bench_lines(done.stdout)
    assert lines, done.stdout[-2000:]
    for line in lines:
        assert {"bench", "metric", "value"} <= line.keys(), line


def test_every_bench_is_run_here_or_named_long() -> None:
    """A new bench is added to QUICK or to LONG, so `make bench` never carries one nobody runs."""
    long = {"cluster_up", "operator_scale", "train_step_compiled", "train_step_vs_tunix"}
    assert {p.stem for p in BENCH.glob("*.py")} == {n for n, _ in QUICK} | long
