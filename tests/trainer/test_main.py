"""``rljob-trainer`` exit codes (contract 3) and the process topology it reads from the JobSet env;
two real processes initialize jax.distributed on CPU through a localhost coordinator."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fixtures.trainer_run import local_run_config, write_run_config
from rljob.recipes.failure import EXIT_BAD_CONFIG
from rljob.trainer.main import BadConfig, distributed_env, main


def _cli(args: list[str], tmp: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rljob.trainer.main", *args],
        capture_output=True,
        text=True,
        cwd=tmp,
        env={**os.environ, "PYTHONSAFEPATH": "1", "JAX_PLATFORMS": "cpu", **(env or {})},
        timeout=300,
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--config: no such file"),
        ("{not json", "Invalid JSON"),
        ('{"kind": "RunConfig"}', "name: Field required"),
    ],
)
def test_bad_config_exits_2_with_one_line(
    content: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    assert main(["--config", str(path)]) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in err[0], err


def test_bad_field_in_a_real_config_names_it(tmp_path: Path) -> None:
    rc = local_run_config(str(tmp_path / "s"), tmp_path)
    data = json.loads(rc.model_dump_json(by_alias=True))
    data["spec"]["lora"]["rank"] = 0
    (tmp_path / "run.json").write_text(json.dumps(data))
    proc = _cli(["--config", str(tmp_path / "run.json")], tmp_path)
    assert proc.returncode == EXIT_BAD_CONFIG
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("rljob-trainer: spec.lora.rank:"), proc.stderr[-500:]
    assert "Traceback" not in proc.stderr


def test_usage_error_is_bad_config(tmp_path: Path) -> None:
    assert main(["--model", "huge"]) == EXIT_BAD_CONFIG


def test_zero_steps_is_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--steps overrides spec.algorithm.steps; 0 is refused (it is no fallback to the spec's steps)."""
    cfg = write_run_config(local_run_config(str(tmp_path / "s"), tmp_path), tmp_path)
    assert main(["--config", str(cfg), "--model", "tiny", "--steps", "0"]) == EXIT_BAD_CONFIG
    assert capsys.readouterr().err.strip() == "--steps: must be > 0, got 0"


def test_distributed_env_from_jobset(tmp_path: Path) -> None:
    rc = local_run_config(str(tmp_path / "s"), tmp_path)
    pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "1"}
    denv = distributed_env(rc, pod)
    assert (denv.in_cluster, denv.process_id, denv.num_processes) == (True, 1, rc.trainer.hosts)
    assert denv.coordinator == rc.endpoints.coordinator
    with pytest.raises(BadConfig, match="JOB_COMPLETION_INDEX"):
        distributed_env(rc, {**pod, "JOB_COMPLETION_INDEX": str(rc.trainer.hosts)})
    with pytest.raises(BadConfig, match="JOB_COMPLETION_INDEX"):
        distributed_env(rc, {**pod, "JOB_COMPLETION_INDEX": "x"})
    local = distributed_env(rc, {})
    assert (local.in_cluster, local.num_processes, local.process_id) == (False, 1, 0)


@pytest.mark.jax
def test_two_processes_initialize_jax_distributed(tmp_path: Path) -> None:
    rc = local_run_config(str(tmp_path / "s"), tmp_path)
    cfg = write_run_config(rc, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "rljob.trainer.main", "--config", str(cfg), "--distributed-check"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={
                **os.environ,
                "PYTHONSAFEPATH": "1",
                "JAX_PLATFORMS": "cpu",
                "RLJOB_NUM_PROCESSES": "2",
                "RLJOB_PROCESS_ID": str(i),
                "RLJOB_COORDINATOR": f"127.0.0.1:{port}",
            },
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-1500:]
    got = sorted((json.loads(o.strip().splitlines()[-1]) for o, _ in outs), key=lambda d: d["process_index"])
    assert [g["process_index"] for g in got] == [0, 1]
    assert all(g["process_count"] == 2 and g["devices"] == 2 * g["local_devices"] for g in got)


def test_default_rollouts_run_the_sampler_loop(tmp_path: Path) -> None:
    """The pods' command (no --rollouts) is the RL loop against RunConfig.endpoints.samplers: with no
    sampler listening it builds the model, publishes adapter v0 and waits for the sampler (not exit)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    rc = local_run_config(str(tmp_path / "s"), tmp_path)
    rc = rc.model_copy(
        update={"endpoints": rc.endpoints.model_copy(update={"samplers": [f"http://127.0.0.1:{port}"]})}
    )
    cfg = write_run_config(rc, tmp_path)
    log = tmp_path / "trainer.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rljob.trainer.main",
                "--config",
                str(cfg),
                "--model",
                "tiny",
                "--steps",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=tmp_path,
            env={**os.environ, "PYTHONSAFEPATH": "1", "JAX_PLATFORMS": "cpu"},
        )
        try:
            deadline = time.monotonic() + 240
            while "sampler unavailable" not in log.read_text() and proc.poll() is None:
                assert time.monotonic() < deadline, log.read_text()[-1500:]
                time.sleep(0.5)
            assert proc.poll() is None, log.read_text()[-1500:]
        finally:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "sampler unavailable (adapter >= v0)" in text and "Traceback" not in text, text[-1500:]
    assert (tmp_path / "s" / rc.namespace / rc.name / "adapters" / "LATEST").read_text() == "0"


def _golden_trainer_containers() -> list[tuple[str, Any, list[dict[str, str]]]]:
    """(golden, run config, the environment of every trainer container of every pod of every slice)."""
    import yaml
    from rljob.recipes import naming, topology
    from rljob.recipes.runconfig import RunConfig

    out = []
    for path in sorted((Path(__file__).parents[1] / "recipes" / "golden").glob("*.yaml")):
        docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "run.json" in d.get("data", {})]
        (js,) = [d for d in docs if d["kind"] == "JobSet"]
        rc = RunConfig.model_validate_json(cm["data"]["run.json"])
        envs = [c.env for c in topology.container_envs(js) if c.role == naming.TRAINER]
        out.append((path.stem, rc, envs))
    return out


@pytest.mark.parametrize("case", _golden_trainer_containers(), ids=lambda c: c[0])
def test_every_golden_trainer_container_gets_its_own_process_id(case: tuple[str, Any, Any]) -> None:
    """The trainer's process topology, fed each rendered container's environment as the kubelet starts
    it: ids 0..N-1 once each (N = slices x hosts x containers per host), one coordinator. Before the
    topology read the container index, both containers of a tpu7x pod got the same id."""
    _, rc, envs = case
    n = rc.trainer.slices * rc.trainer.tpu.hosts * rc.trainer.tpu.containers_per_host
    denvs = [distributed_env(rc, {**env, "KUBERNETES_SERVICE_HOST": "10.0.0.1"}) for env in envs]
    assert sorted(d.process_id for d in denvs) == list(range(n))
    assert {d.num_processes for d in denvs} == {n}
    assert {d.coordinator for d in denvs} == {rc.endpoints.coordinator}
