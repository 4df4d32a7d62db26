"""The drill's local processes (rljob.cli.drill.procs): the environment each starts with and the log tail a
failure shows. The processes themselves run in tests/cli/test_drill.py's drills."""

from __future__ import annotations

import pytest
from rljob.cli.drill import procs


def test_base_env_is_the_cpu_platform_with_the_container_s_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/bin")
    monkeypatch.setenv("HOME", "/home/u")
    monkeypatch.setenv("PYTHONPATH", "/repo")  # never passed on: no repo root on sys.path
    monkeypatch.setenv("RLJOB_RUN_TOKEN", "x")  # nor anything else of this process's environment
    env = procs.base_env(4)
    assert env["PATH"] == "/bin" and env["HOME"] == "/home/u"
    assert "PYTHONPATH" not in env and "RLJOB_RUN_TOKEN" not in env
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["PYTHONSAFEPATH"] == "1"
    flags = env["XLA_FLAGS"].split()
    assert "--xla_force_host_platform_device_count=4" in flags
    assert "--xla_backend_optimization_level=0" in flags
    assert env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize(
    ("text", "lines", "want"),
    [("a\nb\nc\n", 2, "b\nc"), ("a\nb\n\n\n", 5, "a\nb"), ("", 3, ""), ("one", 1, "one")],
)
def test_last_lines(text: str, lines: int, want: str) -> None:
    assert procs.last_lines(text, lines) == want
