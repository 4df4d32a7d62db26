"""A multi-host sampler replica's bootstrap (rljob.sampler.ray_replica), for real on CPU: the Ray head and
worker run as local processes with the environment the render gives the replica's pods; a stand-in for
`vllm serve` on the head checks that it sees (and can run work on) every node; a killed worker fails the
replica with a counted restart (contract 3)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import manifest, objects, resolve
from rljob.common.credentials import new_token
from rljob.common.ports import free_port
from rljob.recipes import naming
from rljob.recipes.runconfig import (
    RAY_AUTH_MODE_ENV,
    RAY_AUTH_TOKEN_ENV,
    RAY_HEAD_ENV,
    RAY_PORT,
    RUN_TOKEN_ENV,
    SAMPLER_HOSTS_ENV,
)
from rljob.sampler import main as sampler_main
from rljob.sampler import ray_replica

TOKEN = new_token()  # what the run's credentials Secret holds


def _sampler_env(doc: dict[str, Any], job_index: int, pod_index: int) -> dict[str, str]:
    """The env of a sampler pod as Kubernetes would give it: fieldRefs filled, $(VAR) expanded, the run's
    credentials Secret's token."""
    (js,) = [o for o in objects(doc) if o["kind"] == "JobSet"]
    (rj,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == naming.SAMPLER]
    (container,) = rj["template"]["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            v = e["value"]
            for k, known in env.items():
                v = v.replace(f"$({k})", known)
            env[e["name"]] = v
        elif "secretKeyRef" in e["valueFrom"]:
            assert e["valueFrom"]["secretKeyRef"]["name"] == naming.credentials_secret("rj"), e
            env[e["name"]] = TOKEN
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = (
                str(pod_index)
                if "completion-index" in path
                else str(job_index)
                if "job-index" in path
                else "x"
            )
    return env


def test_the_render_gives_every_pod_of_a_multi_host_replica_its_part() -> None:
    doc = manifest({"sampler": {"tpu": "v5p-16", "replicas": 2}}, name="rj")
    for job in (0, 1):
        envs = [_sampler_env(doc, job, pod) for pod in (0, 1)]
        for pod, env in enumerate(envs):
            layout = ray_replica.layout_from_env(env)
            assert layout is not None and layout.is_head == (pod == 0)
            assert (layout.hosts, layout.port) == (2, RAY_PORT)
            assert layout.head == f"{naming.hostname('rj', naming.SAMPLER, job, 0)}.{naming.subdomain('rj')}"
        # Ray's token authentication on every node of the replica's Ray cluster, with the run's token
        assert all(e[RAY_AUTH_MODE_ENV] == "token" and e[RAY_AUTH_TOKEN_ENV] == TOKEN for e in envs)
    single = _sampler_env(manifest({}, name="rj"), 0, 0)
    assert SAMPLER_HOSTS_ENV not in single and ray_replica.layout_from_env(single) is None
    assert RAY_AUTH_MODE_ENV not in single and single[RUN_TOKEN_ENV] == TOKEN


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({SAMPLER_HOSTS_ENV: "2", "POD_INDEX": "0"}, RAY_HEAD_ENV),
        ({SAMPLER_HOSTS_ENV: "2", "POD_INDEX": "2", RAY_HEAD_ENV: "h"}, "POD_INDEX: 2 is not within 0..1"),
        ({SAMPLER_HOSTS_ENV: "two", RAY_HEAD_ENV: "h"}, SAMPLER_HOSTS_ENV),
    ],
)
def test_a_broken_environment_is_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(ray_replica.BootstrapError, match=message):
        ray_replica.layout_from_env(env)


def test_the_cpu_backend_refuses_a_broken_replica_environment_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """rljob-sampler --backend cpu in a pod of a multi-host replica (rljob drill) reads the same variables
    as on TPU: one that is missing is bad configuration (exit 2, contract 3), named, before any Ray node."""
    cfg = tmp_path / "run.json"
    cfg.write_text(
        resolve(manifest({"sampler": {"tpu": "v5p-16"}}, name="rj")).model_dump_json(by_alias=True)
    )
    monkeypatch.setenv(RUN_TOKEN_ENV, TOKEN)
    monkeypatch.setenv(SAMPLER_HOSTS_ENV, "2")
    monkeypatch.setenv("POD_INDEX", "1")
    monkeypatch.delenv(RAY_HEAD_ENV, raising=False)
    started: list[tuple[Any, list[str]]] = []

    def bootstrap(env: Any, serve: list[str], **_: object) -> int:
        started.append((dict(env), serve))
        return 0

    monkeypatch.setattr(ray_replica, "bootstrap", bootstrap)
    assert sampler_main.main(["--config", str(cfg), "--backend", "cpu"]) == 2
    assert capsys.readouterr().err.startswith(f"{RAY_HEAD_ENV}: the head's address is not set")
    assert started == []
    monkeypatch.setenv(RAY_HEAD_ENV, "127.0.0.1")  # a worker pod: its Ray node, through the bootstrap
    assert sampler_main.main(["--config", str(cfg), "--backend", "cpu", "--model", "tiny"]) == 0
    ((env, serve),) = started
    assert env[SAMPLER_HOSTS_ENV] == "2" and env["POD_INDEX"] == "1"
    assert serve[serve.index("--") + 1 :] == ["--config", str(cfg), "--backend", "cpu", "--model", "tiny"]
    assert serve[serve.index("--expect") + 1] == "2" and "--cpu-sampler" in serve


@pytest.mark.slow
def test_bootstrap_on_cpu_one_server_sees_every_worker_and_a_lost_worker_fails_the_replica(
    tmp_path: Path,
) -> None:
    doc = manifest({"sampler": {"tpu": "v5p-16"}}, name="rj")
    envs: list[Mapping[str, str]] = [_sampler_env(doc, 0, pod) for pod in (0, 1)]
    assert all(e[RAY_HEAD_ENV].endswith(naming.subdomain("rj")) for e in envs)
    ray_port = free_port()
    replica = ray_replica.start_local_replica(
        envs,
        serve_port=free_port(),
        ray_port=ray_port,
        log_dir=tmp_path,
        head_args=["--poll-s=0.5", "--lost-grace-s=0.5", "--join-timeout-s=240"],
    )
    try:
        healthy = replica.wait_healthy(240)
        log = replica.logs[0].read_text(errors="replace")
        assert healthy, log[-3000:]
        assert "standin-serve: sees 2 Ray nodes, a task ran on each" in log
        assert "ray: 2/2 nodes after" in log  # the server started only once the worker had joined
        # Ray's token authentication: a client without the run's token is refused, one with it served.
        status = [*ray_replica._ray_cli(), "status", f"--address=127.0.0.1:{ray_port}"]
        bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        refused = subprocess.run(status, env=bare, capture_output=True, text=True, timeout=120)
        assert "InvalidAuthToken" in refused.stdout + refused.stderr, refused.stderr[-2000:]
        token = {RAY_AUTH_MODE_ENV: "token", RAY_AUTH_TOKEN_ENV: TOKEN}
        served = subprocess.run(status, env={**bare, **token}, capture_output=True, text=True, timeout=120)
        assert served.returncode == 0 and "InvalidAuthToken" not in served.stderr, served.stderr[-2000:]

        replica.kill(1)  # the worker's host is gone
        assert replica.pods[0].wait(timeout=240) == ray_replica.EXIT_REPLICA_LOST
        log = replica.logs[0].read_text(errors="replace")
        assert "a worker of this replica is gone" in log or "a Ray node left" in log, log[-3000:]
    finally:
        replica.stop()
