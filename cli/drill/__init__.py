"""``rljob drill``: a local CPU rehearsal of an RLJob before any TPU hour is spent.

For one manifest (``-f FILE``), one catalog recipe (``--recipe NAME [--profile P]``) or all of them
(``--all``: every recipe, profile and example):

1. Plan and render it exactly as ``rljob render`` does (exit 2 with every problem, field named).
2. Full-size topology, without the model: the environment of every container of every pod of every slice
   of the rendered JobSet (downward-API fields resolved as the JobSet and Job controllers set them,
   rljob.recipes.topology.container_envs) goes through the trainer's process-topology function: the JAX
   process ids must be 0..N-1 once each, one coordinator, N x each container's devices = the plan's
   devices = the product of the mesh; then MaxText builds the full-size mesh over that many host devices
   (``python -m rljob.trainer.meshcheck``).
3. A scaled run: the same manifest with the counts shrunk to fit a small machine (the generation, the
   containers per host, the number of slices and the mesh's axes kept; hosts per slice at most 2, each
   kept axis at most 2 but fsdp, one sampler replica of 1 host, or of 2 where the real one is multi-host;
   a few rollouts of the toy task; padPosition start or balanced keeps the token budget), rendered
   again, and the real ``rljob-trainer`` and ``rljob-sampler`` entrypoints (the render's commands) started
   as local processes, one per container of every pod of every slice, each with exactly the environment
   its container gets in that render, except the addresses (the coordinator and the samplers on
   127.0.0.1), the run config's path and storage (a local directory) and the CPU platform variables
   (``JAX_PLATFORMS=cpu``, one host device per TPU device of the container, gloo collectives). The model is
   the miniature of the recipe's model (``--model miniature``, rljob.trainer.tinypolicy.miniature_spec).
   It must take ``--steps`` GRPO steps (>= 2), export adapters v0..vK, the sampler must load vK, and the
   trainer's step-0 parity gate must pass. A multi-host sampler replica's pods run the replica's Ray
   bootstrap (rljob.sampler.ray_replica) as in a pod, the head serving the CPU backend from a stand-in for
   `vllm serve` once it saw every node; afterwards a killed worker pod must fail the replica with a
   counted restart (contract 3).

The last stdout line is JSON: ``{"drill": NAME, "ok": true, "processes": N, "steps": K,
"adapter_versions": [...], "parity_nats": X, "seconds": S, ...}``. Exit 0 only when all of it held; 2 on a
bad manifest; 1 otherwise, with the failing process's last lines on stderr.

What it cannot check: anything TPU-only (libtpu, ICI/DCN collectives, the TPU_* variables' effect, memory
fit, vLLM's TPU backend; the sampler here is the CPU backend) and the real model sizes (docs/drill.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rljob.common.ports import free_port

EXIT_OK, EXIT_FAIL, EXIT_BAD = 0, 1, 2
REPO = Path(__file__).resolve().parents[1]
STORAGE = "gs://rljob-drill"
SCALED_MESH_AXIS_MAX = 2  # each kept mesh axis but fsdp at most this in the scaled run
MAX_HOSTS = 2
# A multi-host sampler replica is rehearsed with this many hosts (Ray nodes) at most; a single-host one
# keeps its one.
MAX_SAMPLER_HOSTS = 2
# The head's timings in the rehearsal (rljob-sampler --ray-*): a lost worker fails the replica after this
# grace (30 s in a pod), the nodes counted every second.
SAMPLER_LOST_GRACE_S = 1.0


class DrillBadInput(Exception):
    def __init__(self, problems: list[str], report: dict[str, Any] | None = None) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
        self.report = report or {}


class DrillFailed(Exception):
    """Something of the rehearsal did not hold; the message says what (and the failing process's lines)."""


@dataclass
class Case:
    name: str
    doc: dict[str, Any]


@dataclass
class Outcome:
    name: str
    ok: bool
    report: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    bad_input: list[str] = field(default_factory=list)


# --- cases ---------------------------------------------------------------------------------------------


def recipe_doc(recipe: str, profile: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"recipe": recipe, "storage": {"root": STORAGE}}
    if profile:
        spec["trainer"] = {"profile": profile}
    return {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "drill"}, "spec": spec}


def all_cases() -> list[Case]:
    """Every catalog recipe, each of its profiles, and every example."""
    import yaml
    from rljob.recipes import recipe_catalog

    out = []
    for name in recipe_catalog.names():
        out.append(Case(name, recipe_doc(name)))
        for profile in recipe_catalog.load(name).profiles:
            out.append(Case(f"{name}/{profile}", recipe_doc(name, profile)))
    for path in sorted((REPO / "examples").glob("*.yaml")):
        out.append(Case(f"example/{path.stem}", yaml.safe_load(path.read_text(encoding="utf-8"))))
    return out


# --- plan, render, full-size topology ------------------------------------------------------------------


def resolve_doc(doc: dict[str, Any], *, fit_check: bool = True) -> Any:
    """The run config of a manifest; ``fit_check`` False for the drill's scaled manifests (the model's name
    on a shrunken slice, run as a miniature: the HBM fit check is the full-size plan's)."""
    import yaml
    from rljob.recipes.plan import PlanError, parse_manifest, resolve

    try:
        return resolve(parse_manifest(yaml.safe_dump(doc, sort_keys=False)), fit_check=fit_check)
    except PlanError as e:
        raise DrillBadInput(e.problems) from None


def jobset_of(rc: Any) -> dict[str, Any]:
    from rljob.recipes import render

    return render.jobset(rc)


def full_topology(rc: Any) -> dict[str, Any]:
    """The full-size layout's process ids, count and devices, from every rendered container's env."""
    from rljob.recipes import naming, topology

    js = jobset_of(rc)
    envs = [c for c in topology.container_envs(js) if c.role == naming.TRAINER]
    tops = [topology.process_topology(c.env) for c in envs]
    n = rc.trainer.slices * rc.trainer.tpu.hosts * rc.trainer.tpu.containers_per_host
    ids = Counter(t.process_id for t in tops)
    problems = [f"process id {i} held by {k} containers" for i, k in ids.items() if k > 1]
    problems += (
        [f"process ids {sorted(set(range(n)) - set(ids))[:5]} unheld"] if set(ids) != set(range(n)) else []
    )
    problems += (
        [f"{sum(t.is_coordinator for t in tops)} coordinators"]
        if sum(t.is_coordinator for t in tops) != 1
        else []
    )
    local = rc.trainer.tpu.chips_per_container * rc.trainer.tpu.devices_per_chip
    if n * local != rc.trainer.devices:
        problems.append(f"{n} processes x {local} devices != the plan's {rc.trainer.devices} devices")
    mesh = rc.trainer.ici.product() * rc.trainer.dcn.product()
    if mesh != rc.trainer.devices:
        problems.append(f"the mesh has {mesh} devices, the plan {rc.trainer.devices}")
    if problems:
        raise DrillFailed("full-size topology: " + "; ".join(problems))
    return {"processes": n, "local_devices": local, "devices": rc.trainer.devices}


def _mesh_axes(rc: Any) -> dict[str, int]:
    from rljob.recipes.runconfig import MESH_AXES

    return {a: int(getattr(rc.trainer.ici, a)) * int(getattr(rc.trainer.dcn, a)) for a in MESH_AXES}


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


def full_mesh(rc: Any, workdir: Path, timeout: float) -> dict[str, int]:
    """MaxText's mesh of the full-size run over rc.trainer.devices host devices (no model)."""
    cfg = workdir / "full-run.json"
    cfg.write_text(rc.model_dump_json(by_alias=True), encoding="utf-8")
    # Host devices carry no slice ids: a multi-slice mesh is built per slice (the dcn axes' product was
    # checked against the slice count by full_topology).
    per_slice = rc.trainer.slices > 1
    proc = subprocess.run(
        [
            python(),
            "-m",
            "rljob.trainer.meshcheck",
            "--config",
            str(cfg),
            *(["--per-slice"] if per_slice else []),
        ],
        env=base_env(rc.trainer.tpu.devices if per_slice else rc.trainer.devices),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=workdir,
    )
    if proc.returncode != 0:
        raise DrillFailed("full-size mesh (python -m rljob.trainer.meshcheck):\n" + _tail(proc.stderr))
    got: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])["mesh"]
    want = {a: int(getattr(rc.trainer.ici, a)) for a in _mesh_axes(rc)} if per_slice else _mesh_axes(rc)
    wrong = {a: (got.get(a, 1), n) for a, n in want.items() if got.get(a, 1) != n}
    if wrong:
        raise DrillFailed(f"full-size mesh: MaxText built {got}, the plan says {want}")
    return got


# --- compile stage -------------------------------------------------------------------------------------


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
    if rc.spec.service is not None:
        return {"skipped": "spec.service: the Tinker service's programs are not compiled by this stage"}
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
        raise DrillFailed("compile stage (python -m rljob.trainer.compilecheck):\n" + _tail(proc.stderr))
    return report


# --- scaling -------------------------------------------------------------------------------------------


def _small_tpu(rc: Any, hosts: int) -> str:
    gen = rc.trainer.tpu.type_name.split("-")[0]
    chips = 4 * hosts
    return f"{gen}-{2 * chips}"


def scaled_mesh(full: dict[str, int], devices: int) -> dict[str, int]:
    """The full mesh's axes kept (every axis > 1 stays > 1 where the devices allow), each at most
    SCALED_MESH_AXIS_MAX but fsdp, which takes the rest."""
    mesh = {a: 1 for a in full}
    left = devices
    for axis in ("expert", "context", "tensor", "data"):
        if full.get(axis, 1) > 1 and left % 2 == 0 and left > 1:
            mesh[axis] = min(SCALED_MESH_AXIS_MAX, full[axis])
            left //= mesh[axis]
    mesh["fsdp"] = left
    return mesh


def sampler_layout(model: str | None, devices: int) -> tuple[int, int]:
    """(tensorParallel, expertParallel) of a sampler replica of ``devices`` devices that the plan accepts:
    the layout it prefers among those vLLM's TPU backend runs (rljob.recipes.sampler_layout), else all
    tensor parallel (the plan then says why)."""
    from rljob.recipes import sampler_layout as rules

    f = rules.facts(model)
    ok = rules.layouts(f, str(model), devices) if f is not None else []
    return ok[0] if ok else (devices, 1)


def scaled_sampler_hosts(rc: Any) -> int:
    """Hosts of the scaled run's sampler replica: 1 for a single-host replica, else the full-size
    replica's hosts, at most MAX_SAMPLER_HOSTS (and so at least 2)."""
    hosts = int(rc.sampler.tpu.hosts)
    return 1 if hosts <= 1 else min(MAX_SAMPLER_HOSTS, hosts)


def _small_tpu_of(type_name: str, hosts: int) -> str:
    """The slice of the generation of ``type_name`` with ``hosts`` 4-chip hosts (xpk names count 2
    TensorCores a chip)."""
    return f"{type_name.split('-')[0]}-{2 * 4 * hosts}"


def _hosts(n: int) -> str:
    return f"{n} host" + ("s" if n != 1 else "")


def scaled_doc(doc: dict[str, Any], rc: Any, steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest with its counts shrunk (see the module docstring) and what was scaled."""
    import copy

    hosts = min(MAX_HOSTS, rc.trainer.tpu.hosts)
    containers = rc.trainer.tpu.containers_per_host
    slices = min(2, rc.trainer.slices)
    tpu = _small_tpu(rc, hosts)
    devices_per_slice = 4 * hosts * rc.trainer.tpu.devices_per_chip
    full = _mesh_axes(rc)
    mesh = scaled_mesh({a: getattr(rc.trainer.ici, a) for a in full}, devices_per_slice)
    sampler_hosts = scaled_sampler_hosts(rc)
    sampler_tpu = _small_tpu_of(rc.sampler.tpu.type_name, sampler_hosts)
    out = copy.deepcopy(doc)
    spec = out.setdefault("spec", {})
    trainer = spec.setdefault("trainer", {})
    trainer.update(tpu=tpu, slices=slices, containersPerHost=containers, mesh=dict(mesh))
    sampler = spec.setdefault("sampler", {})
    # The replica's devices, laid out as the plan requires (the CPU sampler ignores the layout).
    tp, ep = sampler_layout(rc.spec.model.maxtext_model, 4 * sampler_hosts * rc.sampler.tpu.devices_per_chip)
    sampler.update(tpu=sampler_tpu, replicas=1, maxModelLen=128, tensorParallel=tp, expertParallel=ep)
    sampler.pop("dataParallel", None)
    spec["storage"] = {**spec.get("storage", {}), "root": STORAGE}
    spec["dataset"] = {"task": "successor"}
    alg = spec.setdefault("algorithm", {})
    alg.update(steps=steps, groupSize=4, groupsPerBatch=2, maxTokens=1, maxPromptTokens=8)
    pack = rc.spec.packing
    if pack.pad_position != "end":
        # The shorter sequences would shrink a derived token budget below padAlign (and, balanced, below
        # the Splash blocks): the full run's budget is kept, as the rows the packer lays out are its.
        spec["packing"] = {**(spec.get("packing") or {}), "tokenBudget": pack.token_budget}
    for k in ("queueName", "priorityClassName"):
        spec.pop(k, None)
    # The miniature starts from random weights: a real checkpoint neither fits it nor is reachable here.
    had_checkpoint = bool((spec.get("model") or {}).pop("checkpoint", None)) or bool(rc.spec.model.checkpoint)
    scaled: dict[str, Any] = {
        "trainer": f"{rc.trainer.tpu.type_name} x {rc.trainer.slices} -> {tpu} x {slices} "
        f"({hosts} hosts x {containers} containers per slice)",
        "mesh": f"{_fmt(full)} -> {_fmt(mesh)}",
        "sampler": f"{rc.sampler.tpu.type_name} x {rc.sampler.replicas} ({_hosts(rc.sampler.tpu.hosts)} per "
        f"replica) -> {sampler_tpu} x 1 ({_hosts(sampler_hosts)}"
        + (": a Ray head and its workers)" if sampler_hosts > 1 else ")"),
        "rollouts": "2 groups x 4 of the toy successor task, 1 token each",
        **(
            {"packing": f"token budget {pack.token_budget} kept (padPosition {pack.pad_position})"}
            if pack.pad_position != "end"
            else {}
        ),
        "base_weights": "random (the miniature)" + (", not spec.model.checkpoint" if had_checkpoint else ""),
    }
    from rljob.recipes import miniature

    model = str(rc.trainer.maxtext.get("model_name", ""))
    if model in miniature.MODELS:
        scaled["miniature"] = miniature.describe(model)
    else:
        scaled["miniature"] = f"{model or 'the model'}: not in the catalog; the tiny qwen3 model"
    if miniature.moe_expert_parallelism(mesh, rc.trainer.maxtext.get("custom_mesh_and_rule")) > 1:
        scaled["moe"] = (
            "dense expert dispatch (sparse_matmul, megablox off: XLA:CPU has no ragged-all-to-all)"
        )
    return out, scaled


def _fmt(mesh: dict[str, int]) -> str:
    return " x ".join(f"{a} {n}" for a, n in mesh.items() if n > 1) or "1"


# --- the scaled run ------------------------------------------------------------------------------------


def _tail(text: str, lines: int = 25) -> str:
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
            return _tail(self.log.read_text(encoding="utf-8", errors="replace"), lines)
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
    """The repo's GCS emulator (``python -m rljob.trainer.gcs_emulator``) with the drill's bucket: the
    process and the variables that point GCS clients at it, with a new run token (what the run's
    credentials Secret gives its pods: rljob.common.credentials)."""
    from rljob.common.credentials import token_env

    proc = subprocess.Popen(
        [python(), "-m", "rljob.trainer.gcs_emulator", "--workdir", str(workdir), "--bucket", STORAGE[5:]],
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


def _objects(env: dict[str, str], prefix: str) -> list[str]:
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


def _launch(
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
        _stop(procs)
        raise
    return procs, trainers, samplers


def _signal(p: Proc, sig: int) -> None:
    """``sig`` to the process, or to every process of its group (a sampler pod's, its Ray node's among
    them)."""
    try:
        if p.group:
            os.killpg(p.popen.pid, sig)
        elif p.popen.poll() is None:
            p.popen.send_signal(sig)
    except ProcessLookupError:
        pass


def _stop(procs: list[Proc]) -> None:
    for p in procs:
        _signal(p, signal.SIGTERM)
    for p in procs:
        try:
            p.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            _signal(p, signal.SIGKILL)
            p.popen.wait(timeout=20)
    for p in procs:  # what is left of a pod's group (a Ray process that outlived its parent)
        if p.group:
            _signal(p, signal.SIGKILL)


# --- the sampler replicas ------------------------------------------------------------------------------

STANDIN_SEES = re.compile(r"standin-serve: sees (\d+) Ray nodes, a task ran on each \((\S+) CPUs\)")


def sampler_replicas(rc: Any, samplers: list[Proc]) -> dict[str, Any]:
    """What the run brought up of the sampler: replicas and hosts (pods) and, for a multi-host replica,
    the Ray nodes and CPUs its head's stand-in for `vllm serve` saw before it served (its log), which must
    be the replica's hosts."""
    replicas = sorted({p.job for p in samplers})
    out: dict[str, Any] = {
        "replicas": len(replicas),
        "hosts": len(samplers),
        "hosts_per_replica": int(rc.sampler.tpu.hosts),
    }
    seen = []
    for j in replicas:
        pods = [p for p in samplers if p.job == j]
        if len(pods) < 2:
            continue
        head = min(pods, key=lambda p: p.pod)
        m = STANDIN_SEES.search(head.log.read_text(encoding="utf-8", errors="replace"))
        if m is None or int(m.group(1)) != len(pods):
            raise DrillFailed(
                f"sampler replica {j}: its head did not report {len(pods)} Ray nodes before serving:\n"
                + head.tail()
            )
        seen.append({"replica": j, "ray_nodes": int(m.group(1)), "cpus": float(m.group(2))})
    if seen:
        out["ray"] = seen
    return out


def worker_loss(samplers: list[Proc], timeout: float) -> dict[str, Any] | None:
    """A multi-host replica's lost host: the last worker pod of replica 0 killed (SIGKILL to its process
    group: the pod's processes, its Ray node's among them); the replica's head must then exit on its own
    with a counted restart (contract 3: non-zero, not 2) within ``timeout``. None for a single-host
    replica."""
    from rljob.recipes.failure import EXIT_BAD_CONFIG

    pods = sorted((p for p in samplers if p.job == 0), key=lambda p: p.pod)
    if len(pods) < 2:
        return None
    head, worker = pods[0], pods[-1]
    if head.popen.poll() is not None:
        raise DrillFailed(
            f"{head.label} exited {head.popen.returncode} before a worker was lost:\n{head.tail()}"
        )
    t0 = time.monotonic()
    _signal(worker, signal.SIGKILL)
    try:
        code = head.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DrillFailed(
            f"{worker.label} killed: its replica's head {head.label} still runs after {timeout:.0f} s:\n"
            + head.tail()
        ) from None
    if code <= 0 or code == EXIT_BAD_CONFIG:
        raise DrillFailed(
            f"{worker.label} killed: {head.label} exited {code}, not a counted restart (contract 3: "
            f"non-zero, not {EXIT_BAD_CONFIG}):\n{head.tail()}"
        )
    return {"killed": worker.label, "head_exit": code, "seconds": round(time.monotonic() - t0, 1)}


def _completion(port: int, token: str) -> list[int]:
    """One sampling request to the replica on ``port`` (the base model, a token-id prompt, the run's
    ``token``): its tokens."""
    from rljob.common.credentials import bearer
    from rljob.common.http import shared

    body = {"prompt": [1, 2, 3], "n": 2, "max_tokens": 2, "temperature": 1.0, "return_token_ids": True}
    url = f"http://127.0.0.1:{port}/v1/completions"
    choices = shared().post_json(url, body, headers=bearer(token), timeout=60)["choices"]
    return [len(c["token_ids"]) for c in choices]


def run_samplers(rc: Any, workdir: Path, timeout: float, model: str = "tiny") -> dict[str, Any]:
    """The scaled run's sampler replicas alone, no trainer: the render's sampler commands started as in
    run_scaled, each replica healthy on its port (a multi-host one once its head saw every node), one
    sampling request served by each; then a multi-host replica's worker killed (worker_loss)."""
    from rljob.common.http import NO_RETRY, HttpError, shared
    from rljob.recipes import naming
    from rljob.recipes.runconfig import RUN_TOKEN_ENV

    js = jobset_of(rc)
    ports = [free_port(span=2) for _ in range(rc.sampler.replicas)]
    local = local_run_config(rc, workdir, ports, free_port())
    cfg = workdir / "run.json"
    cfg.write_text(local.model_dump_json(by_alias=True), encoding="utf-8")
    gcs, storage_env = start_storage(workdir)
    t0 = time.monotonic()
    procs: list[Proc] = []
    try:
        procs, _, samplers = _launch(
            rc, js, cfg, workdir, free_port(), storage_env, [], model, roles=(naming.SAMPLER,)
        )
        tokens = []
        for port in ports:
            while True:
                for p in samplers:
                    if p.popen.poll() is not None:
                        raise DrillFailed(f"{p.label} exited {p.popen.returncode}:\n{p.tail()}")
                if time.monotonic() - t0 > timeout:
                    raise DrillFailed(f"the sampler on port {port} not healthy in {timeout:.0f} s")
                try:
                    shared().get(f"http://127.0.0.1:{port}/health", timeout=2, retry=NO_RETRY)
                    break
                except HttpError:
                    time.sleep(0.5)
            tokens.append(_completion(port, storage_env[RUN_TOKEN_ENV]))
        out = {**sampler_replicas(rc, samplers), "completion_tokens": tokens}
        out["healthy_seconds"] = round(time.monotonic() - t0, 1)
        out["worker_loss"] = worker_loss(samplers, timeout=max(30.0, timeout - (time.monotonic() - t0)))
    finally:
        _stop(procs)
        gcs.terminate()
        gcs.wait(timeout=20)
    return out


def rehearse_service(base: str, key: str, rc: Any, timeout: float) -> dict[str, Any]:
    """A training client's device operations through the API at ``base`` (with the run's key), as the SDK
    sends them: create_model (a new adapter and its automatic checkpoint), optim_step (the Adam program and
    a checkpoint), save_state (orbax) and save_weights_for_sampler (the adapter gathered whole for the PEFT
    export). On a trainer of several processes each is run by every process (rljob.trainer.tinker.
    collective). Returns what each answered; DrillFailed on a failed one."""
    from rljob.common.http import NO_RETRY, shared
    from tinker import types

    http, headers = shared(), {"X-API-Key": key}

    def post(route: str, body: Any) -> Any:
        return http.post_json(
            f"{base}/{route}", body.model_dump(mode="json"), headers=headers, timeout=60, retry=NO_RETRY
        )

    def result(route: str, body: Any) -> Any:
        rid = post(route, body)["request_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = post("retrieve_future", types.FutureRetrieveRequest(request_id=rid))
            if out.get("type") != "try_again":
                if "error" in out:
                    raise DrillFailed(f"the API's {route} failed: {out['error']}")
                return out
        raise DrillFailed(f"the API's {route} did not finish in {timeout:.0f} s")

    t0 = time.monotonic()
    sid = post("create_session", types.CreateSessionRequest(tags=[], user_metadata={}, sdk_version="drill"))
    lora = types.LoraConfig(rank=int(rc.spec.lora.rank), seed=0)
    created = result(
        "create_model",
        types.CreateModelRequest(
            session_id=sid["session_id"], model_seq_id=0, base_model=rc.spec.model.name, lora_config=lora
        ),
    )
    mid = created["model_id"]
    step = result(
        "optim_step",
        types.OptimStepRequest(model_id=mid, seq_id=1, optim_params=types.AdamParams(learning_rate=1e-3)),
    )
    state = result("save_weights", types.SaveWeightsRequest(model_id=mid, seq_id=2, path="drill"))
    sampler = result(
        "save_weights_for_sampler", types.SaveWeightsForSamplerRequest(model_id=mid, seq_id=3, path="drill")
    )
    return {
        "model_id": mid,
        "optim_step": step["metrics"],
        "save_state": state["path"],
        "sampler_weights": sampler["path"],
        "seconds": round(time.monotonic() - t0, 1),
    }


def run_service(rc: Any, workdir: Path, timeout: float) -> dict[str, Any]:
    """A service-mode job's scaled run: its processes started as for the RL loop (the CPU model: the
    service builds the tiny one), until the Tinker API answers ``healthz`` and
    ``get_server_capabilities`` on the trainer's port, then a training client's device operations through
    the API (rehearse_service: on a multi-host trainer every process runs them); then stopped."""
    from rljob.common.http import NO_RETRY, HttpError, HttpStatusError, shared
    from rljob.recipes.runconfig import API_KEYS_ENV

    js = jobset_of(rc)
    sampler_ports = [free_port(span=2) for _ in range(rc.sampler.replicas)]
    coord_port, api_port = free_port(), free_port()
    local = local_run_config(rc, workdir, sampler_ports, coord_port, api_port)
    cfg = workdir / "run.json"
    cfg.write_text(local.model_dump_json(by_alias=True), encoding="utf-8")
    gcs, storage_env = start_storage(workdir)
    # The key spec.service.apiKeySecret's Secret gives the trainer in a cluster (the service refuses to
    # start without one); the drill's requests send none, so the API answers 401.
    key = f"tml-drill-{secrets.token_hex(16)}"
    storage_env = {**storage_env, API_KEYS_ENV: key}
    t0 = time.monotonic()
    procs: list[Proc] = []
    try:
        procs, trainers, _ = _launch(
            rc, js, cfg, workdir, coord_port, storage_env, ["--model", "tiny"], "tiny"
        )
        base = f"http://127.0.0.1:{api_port}/api/v1"
        caps: Any = None
        while caps is None:
            for p in procs:
                if p.popen.poll() is not None:
                    raise DrillFailed(f"{p.label} exited {p.popen.returncode}:\n{p.tail()}")
            if time.monotonic() - t0 > timeout:
                raise DrillFailed(
                    f"the API did not answer in {timeout:.0f} s; {trainers[0].label}:\n{trainers[0].tail()}"
                )
            try:
                shared().get(f"{base}/healthz", timeout=5, retry=NO_RETRY)
                caps = shared().get_json(f"{base}/get_server_capabilities", timeout=5, retry=NO_RETRY)
            except HttpStatusError as e:
                if e.status != 401:  # 401: the API answers and wants a key (spec.service.apiKeySecret)
                    raise DrillFailed(f"the API answered {e.status}: {e.body[:300]!r}") from None
                caps = {"X-API-Key": "required (spec.service.apiKeySecret)"}
            except HttpError:
                time.sleep(0.5)
        left = max(30.0, timeout - (time.monotonic() - t0))
        rehearsal = rehearse_service(base, key, rc, left)
        for p in trainers:  # every process of the trainer is still running the service
            if p.popen.poll() is not None:
                raise DrillFailed(f"{p.label} exited {p.popen.returncode}:\n{p.tail()}")
    finally:
        _stop(procs)
        gcs.terminate()
        gcs.wait(timeout=20)
    return {
        "processes": len(procs),
        "trainer_processes": len(trainers),
        "steps": 0,
        "service": {"api": rc.spec.service.api, "capabilities": caps, "rehearsal": rehearsal},
        "run_seconds": round(time.monotonic() - t0, 1),
    }


def run_scaled(rc: Any, workdir: Path, steps: int, timeout: float) -> dict[str, Any]:
    from rljob.recipes.runconfig import RUN_TOKEN_ENV

    js = jobset_of(rc)
    sampler_ports = [free_port(span=2) for _ in range(rc.sampler.replicas)]
    coord_port = free_port()
    local = local_run_config(rc, workdir, sampler_ports, coord_port)
    cfg = workdir / "run.json"
    cfg.write_text(local.model_dump_json(by_alias=True), encoding="utf-8")
    gcs, storage_env = start_storage(workdir)
    t0 = time.monotonic()
    procs: list[Proc] = []
    trainer_args = [
        "--model",
        "miniature",
        "--steps",
        str(steps),
        "--eval-every",
        "0",
        "--log-jsonl",
        "{log}",
    ]
    try:
        procs, trainers, samplers = _launch(
            rc, js, cfg, workdir, coord_port, storage_env, trainer_args, "miniature"
        )
        deadline = t0 + timeout
        crashed: dict[str, float] = {}
        while any(p.popen.poll() is None for p in trainers):
            for p in procs:
                code = p.popen.poll()
                if code not in (None, 0) or (p in samplers and code is not None):
                    raise DrillFailed(f"{p.label} exited {code}:\n{p.tail()}")
                # A process whose Python died can hang in jax.distributed's shutdown, waiting for peers
                # that wait for it: fail on its traceback once it has had a while to exit.
                dead = code is None and p in trainers and "Traceback (most recent call last)" in p.tail(200)
                if dead and time.monotonic() - crashed.setdefault(p.label, time.monotonic()) > 30:
                    raise DrillFailed(f"{p.label} failed (its traceback, process still running):\n{p.tail()}")
            if time.monotonic() > deadline:
                raise DrillFailed(
                    f"timed out after {timeout:.0f} s; {trainers[0].label}:\n{trainers[0].tail()}"
                )
            time.sleep(0.5)
        for p in trainers:
            if p.popen.returncode != 0:
                raise DrillFailed(f"{p.label} exited {p.popen.returncode}:\n{p.tail()}")
        versions = _adapter_versions(storage_env, local.storage.adapters)
        if not versions:
            raise DrillFailed(f"the trainer exported no adapter; {trainers[0].label}:\n{trainers[0].tail()}")
        loaded = _wait_sampler_version(
            sampler_ports,
            max(versions, default=-1),
            min(60.0, max(5.0, deadline - time.monotonic())),
            storage_env[RUN_TOKEN_ENV],
        )
        for p in samplers:
            if p.popen.poll() is not None:
                raise DrillFailed(f"{p.label} exited {p.popen.returncode}:\n{p.tail()}")
        sampler = sampler_replicas(rc, samplers)
        loss = worker_loss(samplers, timeout=max(60.0, deadline - time.monotonic()))
        if loss is not None:
            sampler["worker_loss"] = loss
    finally:
        _stop(procs)
        gcs.terminate()
        gcs.wait(timeout=20)
    records = (
        [
            json.loads(x)
            for x in (workdir / "trainer-0-0.trainer.jsonl").read_text().splitlines()
            if x.startswith("{")
        ]
        if (workdir / "trainer-0-0.trainer.jsonl").exists()
        else _first_log(workdir)
    )
    steps_done = [r for r in records if r.get("event") == "step"]
    parity = [r for r in records if r.get("event") == "parity"]
    if len(steps_done) < steps:
        raise DrillFailed(f"the trainer logged {len(steps_done)} steps, not {steps}:\n{trainers[0].tail()}")
    if not parity:
        raise DrillFailed("the trainer logged no step-0 parity gate")
    if versions != list(range(steps + 1)):
        raise DrillFailed(f"adapter versions {versions}, expected v0..v{steps}")
    return {
        "processes": len(procs),
        "trainer_processes": len(trainers),
        "sampler_processes": len(samplers),
        "sampler": sampler,
        "steps": len(steps_done),
        "adapter_versions": versions,
        "sampler_loaded": loaded,
        "parity_nats": float(parity[0]["mean_abs_logprob_diff"]),
        "run_seconds": round(time.monotonic() - t0, 1),
    }


def _first_log(workdir: Path) -> list[dict[str, Any]]:
    logs = sorted(workdir.glob("trainer-0-0.*.jsonl"))
    if not logs:
        return []
    return [json.loads(x) for x in logs[0].read_text().splitlines() if x.startswith("{")]


def _adapter_versions(env: dict[str, str], adapters: str) -> list[int]:
    """The complete adapter versions v{N}/ (adapter_config.json written) under ``adapters``."""
    out = set()
    for name in _objects(env, adapters):
        parts = name.rsplit("/", 2)
        if len(parts) == 3 and parts[2] == "adapter_config.json" and parts[1][1:].isdigit():
            out.add(int(parts[1][1:]))
    return sorted(out)


def _wait_sampler_version(ports: list[int], version: int, timeout: float, token: str) -> list[Any]:
    """Each sampler's served adapter version once it is ``version`` (its status endpoint, port + 1, asked
    with the run's ``token``)."""
    from rljob.common.credentials import bearer
    from rljob.common.http import NO_RETRY, HttpError, shared
    from rljob.recipes.runconfig import ADAPTER_AGENT_PORT_OFFSET

    deadline = time.monotonic() + timeout
    last: list[Any] = []
    while time.monotonic() < deadline:
        last = []
        for port in ports:
            try:
                url = f"http://127.0.0.1:{port + ADAPTER_AGENT_PORT_OFFSET}/rljob/v1/adapter"
                last.append(shared().get_json(url, headers=bearer(token), timeout=2, retry=NO_RETRY))
            except (HttpError, ValueError):
                last.append(None)
        if all(isinstance(s, dict) and s.get("version") == version for s in last):
            return [s.get("version") for s in last]
        time.sleep(0.5)
    raise DrillFailed(f"the sampler(s) did not load adapter v{version}: status {last}")


# --- one drill -----------------------------------------------------------------------------------------


def drill(
    case: Case,
    steps: int,
    workdir: Path,
    timeout: float,
    run: bool = True,
    compile_timeout: float | None = None,
) -> Outcome:
    """The drill of one case; ``compile_timeout``: run the compile stage (and no scaled run)."""
    t0 = time.monotonic()
    try:
        rc = resolve_doc(case.doc)
        jobset_of(rc)
        full = full_topology(rc)
        mesh = full_mesh(rc, workdir, timeout=300)
        shown = _fmt(mesh)
        if rc.trainer.slices > 1:
            dcn = {a: int(getattr(rc.trainer.dcn, a)) for a in _mesh_axes(rc)}
            shown = f"{shown} per slice, {_fmt(dcn)} across {rc.trainer.slices} slices"
        report: dict[str, Any] = {"full": {**full, "mesh": shown}}
        if compile_timeout is not None:
            report["compile"] = run_compile(rc, workdir, compile_timeout)
        elif run:
            small_doc, scaled = scaled_doc(case.doc, rc, steps)
            try:
                small = resolve_doc(small_doc, fit_check=False)
            except DrillBadInput as e:  # the drill's own scaling, not the user's manifest
                raise DrillFailed("the scaled manifest does not resolve: " + "; ".join(e.problems)) from None
            full_topology(small)
            report["scaled"] = scaled
            if small.spec.service is not None:
                report.update(run_service(small, workdir, timeout))
            else:
                report.update(run_scaled(small, workdir, steps, timeout))
    except DrillBadInput as e:
        return Outcome(case.name, False, bad_input=e.problems, report=e.report)
    except DrillFailed as e:
        return Outcome(case.name, False, error=str(e), report={"seconds": round(time.monotonic() - t0, 1)})
    report["seconds"] = round(time.monotonic() - t0, 1)
    return Outcome(case.name, True, report=report)


def _cases(args: argparse.Namespace) -> list[Case]:
    import yaml

    if args.all:
        return all_cases()
    if args.recipe:
        from rljob.recipes import recipe_catalog

        if args.recipe not in recipe_catalog.names():
            raise DrillBadInput(
                [f"--recipe: unknown recipe {args.recipe!r}; known: {', '.join(recipe_catalog.names())}"]
            )
        if args.profile and args.profile not in recipe_catalog.load(args.recipe).profiles:
            raise DrillBadInput([f"--profile: {args.recipe} has no profile {args.profile!r}"])
        name = args.recipe + (f"/{args.profile}" if args.profile else "")
        return [Case(name, recipe_doc(args.recipe, args.profile))]
    try:
        text = Path(args.file).read_text(encoding="utf-8") if args.file != "-" else sys.stdin.read()
    except OSError as e:
        raise DrillBadInput([f"{args.file}: {e.strerror or e}"]) from None
    from rljob.recipes.plan import PlanError, parse_manifest

    try:
        parse_manifest(text)  # every problem of the manifest, field named, before any process starts
    except PlanError as e:
        raise DrillBadInput(e.problems) from None
    return [Case(Path(args.file).stem, yaml.safe_load(text))]


def cmd_drill(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise DrillBadInput([f"--steps: at least 2, got {args.steps}"])
    cases = _cases(args)
    outcomes = []
    for case in cases:
        workdir = Path(tempfile.mkdtemp(prefix="rljob-drill-"))
        out = drill(
            case,
            args.steps,
            workdir,
            args.timeout,
            run=not args.topology_only,
            compile_timeout=args.compile_timeout if args.compile else None,
        )
        outcomes.append(out)
        line: dict[str, Any] = {"drill": case.name, "ok": out.ok, **out.report}
        if out.bad_input:
            line["problems"] = out.bad_input
        if out.error:
            line["error"] = out.error.splitlines()[0]
            print(f"rljob drill {case.name}: {out.error}", file=sys.stderr)
        for p in out.bad_input:
            print(p, file=sys.stderr)
        if len(cases) > 1:
            print(json.dumps(line), flush=True)
        if out.ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not out.ok:
            print(f"rljob drill {case.name}: logs in {workdir}", file=sys.stderr)
    if len(cases) == 1:
        out = outcomes[0]
        summary = {"drill": out.name, "ok": out.ok, **_summary(out.report)}
        if out.bad_input:
            summary["problems"] = out.bad_input
    else:
        summary = {
            "drill": "all",
            "ok": all(o.ok for o in outcomes),
            "drills": len(outcomes),
            "failed": [o.name for o in outcomes if not o.ok],
        }
    print(json.dumps(summary), flush=True)
    if any(o.bad_input for o in outcomes) and len(outcomes) == 1:
        return EXIT_BAD
    return EXIT_OK if all(o.ok for o in outcomes) else EXIT_FAIL


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    keys = ("processes", "steps", "adapter_versions", "parity_nats", "seconds")
    head = {k: report[k] for k in keys if k in report}
    return {**head, **{k: v for k, v in report.items() if k not in keys}}


def register(sub: Any) -> None:
    text = "rehearse an RLJob on this machine: its topology at full size, then a scaled run of its processes"
    p = sub.add_parser("drill", help=text, description=text)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-f", "--file", help="RLJob manifest (YAML), or - for stdin")
    src.add_argument("--recipe", help="a catalog recipe")
    src.add_argument("--all", action="store_true", help="every catalog recipe, profile and example")
    p.add_argument("--profile", help="with --recipe: one of its profiles")
    p.add_argument("--steps", type=int, default=2, help="GRPO steps of the scaled run (>= 2)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds for the scaled run")
    p.add_argument("--topology-only", action="store_true", help="only the full-size topology and mesh checks")
    p.add_argument("--keep", action="store_true", help="keep the work directory of a drill that passed")
    p.add_argument(
        "--compile",
        action="store_true",
        help="instead of the scaled run: compile the trainer's programs at full size for its TPU topology "
        "with libtpu's compiler (minutes of CPU), their HBM per device and cost (docs/drill.md)",
    )
    p.add_argument("--compile-timeout", type=float, default=3600.0, help="seconds for the compile stage")
    p.set_defaults(fn=cmd_drill)
