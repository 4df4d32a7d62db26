"""`rljob doctor` as a command, without a cluster: exit codes, bad input, what a manifest needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from rljob.cli.doctor.needs import needs_from_manifest

REPO = Path(__file__).resolve().parents[2]
RLJOB = Path(sys.executable).parent / "rljob"


def rljob(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(RLJOB), *args], capture_output=True, text=True, input=stdin, cwd=REPO, timeout=120
    )


@pytest.mark.parametrize(
    ("example", "trainer", "sampler"),
    [
        ("qwen3-8b-v5p.yaml", ("tpu-v5p-slice", "2x2x1", 1, 1), ("tpu-v5p-slice", "2x2x1", 1, 1)),
        ("qwen3.5-397b-tpu7x-256chips.yaml", ("tpu7x", "4x8x8", 64, 1), ("tpu7x", "2x2x2", 2, 16)),
    ],
)
def test_needs_come_from_the_resolved_plan(
    example: str, trainer: tuple[str, str, int, int], sampler: tuple[str, str, int, int]
) -> None:
    """The recipe supplies what the manifest leaves out: doctor sees the shapes `rljob plan` shows."""
    needs = needs_from_manifest(REPO / "examples" / example)
    t = needs.roles[0]
    assert (t.role, t.tpu.accelerator, t.tpu.topology, t.tpu.hosts, t.slices) == ("trainer", *trainer)
    s = needs.roles[1]
    assert (s.role, s.tpu.accelerator, s.tpu.topology, s.tpu.hosts, s.slices) == ("sampler", *sampler)


def test_bad_manifest_exits_2_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text = (
        (REPO / "examples" / "qwen3-8b-v5p.yaml")
        .read_text()
        .replace("tpu: v5p-8\n    maxtext", "tpu: v5p-7\n    maxtext")
    )
    assert "v5p-7" in text
    bad.write_text(text)
    proc = rljob("doctor", "--for", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.startswith("spec.trainer.tpu:"), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "stderr"),
    [
        (["doctor", "--for", "/nonexistent.yaml"], "/nonexistent.yaml"),
        (["doctor", "--output", "xml"], "invalid choice"),
    ],
)
def test_bad_input_exits_2(args: list[str], stderr: str) -> None:
    proc = rljob(*args)
    assert proc.returncode == 2 and stderr in proc.stderr and "Traceback" not in proc.stderr


def test_unreachable_cluster_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    proc = rljob("doctor", "--kubeconfig", str(kubeconfig), "-o", "json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["exitCode"] == 1
    [finding] = report["findings"]
    assert finding["check"] == "cluster" and finding["status"] == "problem"
    assert "127.0.0.1:1" in finding["message"]


def test_missing_kubeconfig_is_reported(tmp_path: Path) -> None:
    proc = rljob("doctor", "--kubeconfig", str(tmp_path / "none"))
    assert proc.returncode == 1
    assert "no usable kubeconfig" in proc.stdout and "Traceback" not in proc.stderr
