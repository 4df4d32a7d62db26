"""The drill's local processes: the render's commands started as local processes, one per container of
every pod (each with exactly the environment its container gets, but for the addresses, the run config's
path, the storage and the CPU platform variables), stopped again (a multi-host sampler pod as a process
group), and the repo's GCS emulator the runs store to (local scaffolding: nothing of this runs in a pod)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.common.ports import free_port

from .cases import STORAGE, DrillFailed

# The head's timings in the rehearsal (rljob-sampler --ray-*): a lost worker fails the replica after this
# grace (30 s in a pod), the nodes counted every second.
SAMPLER_LOST_GRACE_S = 1.0


def python() -> str:
    return sys.executable


def base_env(devices: int) -> dict[str, str]:
    """The machine's environment for a local process: PATH, HOME and the venv, the CPU platform with
    ``devices`` host devices (a container's TPU devices), no repo root on sys.path. XLA:CPU compiles
    without LLVM's optimizations (``--xla_backend_optimization_level=0``): a drill's time is its
    compiles (a miniature's random initialization is one program of every parameter's threefry draws,
    over a minute at the default level with four processes compiling it at once on two cores, seconds
    at 0), and the miniature's programs run in milliseconds either way."""
    keep = {
        k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "VIRTUAL_ENV", "TMPDIR", "LANG", "TZ")
    }
    return {
        **keep,
        "PYTHONSAFEPATH": "1",
        "PYTHONUNBUFFERED": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0",
        "OMP_NUM_THREADS": "1",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }


def last_lines(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


@dataclass
class Proc:
    label: str
    popen: subprocess.Popen[bytes]
    log: Path
    job: int = 0  # the Job index (a sampler's replica) and the pod index within it
    pod: int = 0
    group: bool = False  # a pod of a multi-host sampler replica: its own process group, as a pod's processes

    def tail(self, lines: int = 25) -> str:
        try:
            return last_lines(self.log.read_text(encoding="utf-8", errors="replace"), lines)
        except OSError:
            return ""


def local_run_config(
    rc: Any, workdir: Path, sampler_ports: list[int], coord_port: int, api_port: int | None = None
) -> Any:
    """The scaled run config with local addresses (storage stays gs://, on the emulator), a progress
    file and, for a service-mode job, the API on ``api_port``."""
    update: dict[str, Any] = {}
    if api_port is not None and rc.spec.service is not None:
        update["spec"] = rc.spec.model_copy(
            update={"service": rc.spec.service.model_copy(update={"port": api_port})}
        )
    return rc.model_copy(
        update={
            **update,
            "endpoints": rc.endpoints.model_copy(
                update={
                    "samplers": [f"http://127.0.0.1:{p}" for p in sampler_ports],
                    "coordinator": f"127.0.0.1:{coord_port}",
                }
            ),
            "progress": rc.progress.model_copy(
                update={"config_map": None, "file": str(workdir / "progress.json")}
            ),
        }
    )


def start_storage(workdir: Path) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """The repo's GCS emulator (``python -m rljob.local.gcs_emulator``) with the drill's bucket: the
    process and the variables that point GCS clients at it, with a new run token (what the run's
    credentials Secret gives its pods: rljob.common.credentials)."""
    from rljob.common.credentials import token_env

    proc = subprocess.Popen(
        [python(), "-m", "rljob.local.gcs_emulator", "--workdir", str(workdir), "--bucket", STORAGE[5:]],
        env=base_env(1),
        stdout=subprocess.PIPE,
        stderr=(workdir / "gcs-emulator.log").open("wb"),
        text=True,
        cwd=workdir,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise DrillFailed(f"the GCS emulator did not start; see {workdir / 'gcs-emulator.log'}")
    env: dict[str, str] = json.loads(line)["env"]
    return proc, {**env, **token_env()}


def objects(env: dict[str, str], prefix: str) -> list[str]:
    """Object names under gs://bucket/prefix on the emulator (the JSON API's objects.list)."""
    from urllib.parse import quote

    from rljob.common.http import shared

    bucket, _, path = prefix[5:].partition("/")
    url = f"{env['STORAGE_EMULATOR_HOST']}/storage/v1/b/{bucket}/o?prefix={quote(path.rstrip('/') + '/')}"
    return [str(item["name"]) for item in shared().get_json(url, timeout=10).get("items", [])]


def _bin(command: list[str]) -> list[str]:
    """The render's command, its console script from this interpreter's environment."""
    script = Path(python()).parent / command[0]
    return [str(script) if script.exists() else command[0], *command[1:]]


def launch(
    rc: Any,
    js: dict[str, Any],
    cfg: Path,
    workdir: Path,
    coord_port: int,
    storage_env: dict[str, str],
    trainer_args: list[str],
    model: str,
    roles: tuple[str, ...] | None = None,
) -> tuple[list[Proc], list[Proc], list[Proc]]:
    """The render's commands, one local process per container of every pod of every slice (of ``roles``),
    each with the environment its container gets (the config path, the coordinator and a multi-host sampler
    replica's Ray head local; the run token of ``storage_env`` wherever the container takes the run's
    credentials Secret): (all, trainers, samplers)."""
    from rljob.recipes import naming, topology
    from rljob.recipes.runconfig import (
        CONFIG_ENV,
        CONFIG_PATH,
        RAY_HEAD_ENV,
        RAY_PORT_ENV,
        RUN_TOKEN_ENV,
        SAMPLER_HOSTS_ENV,
    )

    commands = {
        rj["name"]: rj["template"]["spec"]["template"]["spec"]["containers"]
        for rj in js["spec"]["replicatedJobs"]
    }
    procs: list[Proc] = []
    trainers: list[Proc] = []
    samplers: list[Proc] = []
    overrides = {CONFIG_ENV: str(cfg), topology.COORDINATOR_ENV: f"127.0.0.1:{coord_port}"}
    ray_ports: dict[int, int] = {}
    try:
        for c in topology.container_envs(js):
            if roles is not None and c.role not in roles:
                continue
            pod_env: dict[str, str] = {}
            group = False
            spec_c = commands[c.role][c.container_index]
            secret_env = {
                item["name"]: storage_env[RUN_TOKEN_ENV]
                for item in spec_c.get("env", [])
                if ((item.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
                == naming.credentials_secret(rc.name)
            }
            command = [str(cfg) if a == CONFIG_PATH else a for a in _bin(spec_c["command"])]
            label = f"{c.role}-{c.job_index}-{c.pod_index}/{c.container}"
            if c.role == naming.TRAINER:
                devices = rc.trainer.tpu.chips_per_container * rc.trainer.tpu.devices_per_chip
                command += [
                    a.replace("{log}", str(workdir / f"{label.replace('/', '.')}.jsonl"))
                    for a in trainer_args
                ]
            else:
                devices = 1
                command += ["--backend", "cpu", "--host", "127.0.0.1", "--model", model]
                command += ["--adapter-dir", str(workdir / f"adapters-{c.job_index}-{c.pod_index}")]
                if int(c.env.get(SAMPLER_HOSTS_ENV) or "1") > 1:
                    # A pod of a multi-host replica: rljob-sampler runs the replica's Ray bootstrap (the head
                    # in pod 0, a worker in the others), each replica's Ray head on its own local port.
                    group = True
                    port = ray_ports.setdefault(c.job_index, free_port())
                    pod_env = {RAY_HEAD_ENV: "127.0.0.1", RAY_PORT_ENV: str(port)}
                    command += [f"--ray-lost-grace-s={SAMPLER_LOST_GRACE_S:g}", "--ray-poll-s=1"]
            env = {**base_env(devices), **storage_env, **c.env, **secret_env, **overrides, **pod_env}
            out = workdir / f"{label.replace('/', '.')}.log"
            p = Proc(
                label,
                subprocess.Popen(
                    command,
                    env=env,
                    stdout=out.open("wb"),
                    stderr=subprocess.STDOUT,
                    cwd=workdir,
                    start_new_session=group,
                ),
                out,
                c.job_index,
                c.pod_index,
                group,
            )
            procs.append(p)
            (trainers if c.role == naming.TRAINER else samplers).append(p)
    except BaseException:
        stop(procs)
        raise
    return procs, trainers, samplers


def signal_pod(p: Proc, sig: int) -> None:
    """``sig`` to the process, or to every process of its group (a sampler pod's, its Ray node's among
    them)."""
    try:
        if p.group:
            os.killpg(p.popen.pid, sig)
        elif p.popen.poll() is None:
            p.popen.send_signal(sig)
    except ProcessLookupError:
        pass


def stop(procs: list[Proc]) -> None:
    for p in procs:
        signal_pod(p, signal.SIGTERM)
    for p in procs:
        try:
            p.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            signal_pod(p, signal.SIGKILL)
            p.popen.wait(timeout=20)
    for p in procs:  # what is left of a pod's group (a Ray process that outlived its parent)
        if p.group:
            signal_pod(p, signal.SIGKILL)
