"""A multi-host sampler replica's bootstrap (rljob.sampler.ray_replica), for real on CPU: the Ray head and
worker run as local processes with the environment the render gives the replica's pods; a stand-in for
`vllm serve` on the head checks that it sees (and can run work on) every node; a killed worker fails the
replica with a counted restart (contract 3)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import manifest, objects
from rljob.recipes import naming
from rljob.recipes.runconfig import RAY_HEAD_ENV, RAY_PORT, RAY_PORT_ENV, SAMPLER_HOSTS_ENV
from rljob.sampler import ray_replica

# Ray nodes sharing one machine: no dashboard, one CPU each, agent ports picked by Ray.
WORKER_ARGS = ["--num-cpus=1", "--disable-usage-stats", "--dashboard-agent-listen-port=0"]
HEAD_ARGS = ["--include-dashboard=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sampler_env(doc: dict[str, Any], job_index: int, pod_index: int) -> dict[str, str]:
    """The env of a sampler pod as Kubernetes would give it: fieldRefs filled, $(VAR) expanded."""
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
    single = _sampler_env(manifest({}, name="rj"), 0, 0)
    assert SAMPLER_HOSTS_ENV not in single and ray_replica.layout_from_env(single) is None


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


def _pod(env: dict[str, str], serve: list[str], log: Path, head: bool) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "rljob.sampler.ray_replica", "bootstrap"]
    argv += [f"--ray-arg={a}" for a in WORKER_ARGS] + [f"--head-ray-arg={a}" for a in HEAD_ARGS]
    if head:
        argv += ["--poll-s=0.5", "--lost-grace-s=0.5", "--join-timeout-s=240", "--", *serve]
    out = log.open("wb")
    # Its own process group: the test ends the pod's Ray processes with it (and only those).
    return subprocess.Popen(
        argv, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def _end(p: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        return


@pytest.mark.slow
def test_bootstrap_on_cpu_one_server_sees_every_worker_and_a_lost_worker_fails_the_replica(
    tmp_path: Path,
) -> None:
    doc = manifest({"sampler": {"tpu": "v5p-16"}}, name="rj")
    ray_port, serve_port = _free_port(), _free_port()
    pods = []
    for pod in (0, 1):
        env = _sampler_env(doc, 0, pod)
        assert env[RAY_HEAD_ENV].endswith(naming.subdomain("rj"))
        # Local stand-ins for the headless service's DNS name and the pod's own port space.
        env |= {RAY_HEAD_ENV: "127.0.0.1", RAY_PORT_ENV: str(ray_port)}
        pods.append(env)
    serve = [sys.executable, "-m", "rljob.sampler.ray_replica", "standin-serve", "--expect", "2"]
    serve += ["--port", str(serve_port), "--prefix", "rj"]
    head = _pod(pods[0], serve, tmp_path / "head.log", head=True)
    worker = _pod(pods[1], [], tmp_path / "worker.log", head=False)
    try:
        deadline = time.monotonic() + 240
        healthy = False
        while time.monotonic() < deadline and head.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{serve_port}/health", timeout=2):
                    healthy = True
                    break
            except OSError:
                time.sleep(1.0)
        log = (tmp_path / "head.log").read_text(errors="replace")
        assert healthy, log[-3000:]
        assert "standin-serve: sees 2 Ray nodes, a task ran on each" in log
        assert "ray: 2/2 nodes after" in log  # the server started only once the worker had joined

        _end(worker, signal.SIGKILL)  # the worker's host is gone
        assert head.wait(timeout=240) == ray_replica.EXIT_REPLICA_LOST
        log = (tmp_path / "head.log").read_text(errors="replace")
        assert "a worker of this replica is gone" in log or "a Ray node left" in log, log[-3000:]
    finally:
        for p in (head, worker):
            _end(p)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                _end(p, signal.SIGKILL)
