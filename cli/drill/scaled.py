"""Part 3 of a drill, the scaled run: the manifest with its counts shrunk to fit a small machine (the
generation, the containers per host, the number of slices and the mesh's axes kept; hosts per slice at
most 2, each kept axis at most 2 but fsdp, one sampler replica of 1 host, or of 2 where the real one is
multi-host; a few rollouts of the toy task; padPosition start or balanced keeps the token budget),
rendered again, and its processes started (procs) with the miniature of the recipe's model. It must take
``--steps`` GRPO steps, export adapters v0..vK, the sampler must load vK and the trainer's step-0 parity
gate must pass; a multi-host sampler replica's lost worker must then fail the replica with a counted
restart (samplers)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rljob.common.ports import free_port
from rljob.recipes import tpu

from .cases import STORAGE, DrillFailed, jobset_of
from .procs import Proc, launch, local_run_config, objects, start_storage, stop
from .samplers import sampler_replicas, worker_loss
from .topology import fmt_mesh, mesh_axes

SCALED_MESH_AXIS_MAX = 2  # each kept mesh axis but fsdp at most this in the scaled run
MAX_HOSTS = 2
# A multi-host sampler replica is rehearsed with this many hosts (Ray nodes) at most; a single-host one
# keeps its one.
MAX_SAMPLER_HOSTS = 2


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


def sampler_layout(model: str | None, devices: int, version: str) -> tuple[int, int]:
    """(tensorParallel, expertParallel) of a sampler replica of ``devices`` devices that the plan accepts:
    the layout it prefers among those vLLM's TPU backend runs (rljob.recipes.sampler_layout), else all
    tensor parallel (the plan then says why)."""
    from rljob.recipes import sampler_layout as rules

    f = rules.facts(model, version)
    ok = rules.layouts(f, str(model), devices) if f is not None else []
    return ok[0] if ok else (devices, 1)


def scaled_sampler_hosts(rc: Any) -> int:
    """Hosts of the scaled run's sampler replica: 1 for a single-host replica, else the full-size
    replica's hosts, at most MAX_SAMPLER_HOSTS where the generation has such a slice (rljob.recipes.tpu.
    scaled_slice)."""
    return tpu.scaled_slice(rc.sampler.tpu, MAX_SAMPLER_HOSTS).hosts


def _hosts(n: int) -> str:
    return f"{n} host" + ("s" if n != 1 else "")


def scaled_doc(doc: dict[str, Any], rc: Any, steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest with its counts shrunk (see the module docstring) and what was scaled."""
    import copy

    small = tpu.scaled_slice(rc.trainer.tpu, MAX_HOSTS)
    hosts, containers = small.hosts, small.containers_per_host
    slices = min(2, rc.trainer.slices)
    devices_per_slice = small.devices
    full = mesh_axes(rc)
    mesh = scaled_mesh({a: getattr(rc.trainer.ici, a) for a in full}, devices_per_slice)
    small_sampler = tpu.scaled_slice(rc.sampler.tpu, MAX_SAMPLER_HOSTS)
    sampler_hosts = small_sampler.hosts
    out = copy.deepcopy(doc)
    spec = out.setdefault("spec", {})
    trainer = spec.setdefault("trainer", {})
    trainer.update(tpu=small.type_name, slices=slices, containersPerHost=containers, mesh=dict(mesh))
    sampler = spec.setdefault("sampler", {})
    # The replica's devices, laid out as the plan requires (the CPU sampler ignores the layout).
    tp, ep = sampler_layout(
        rc.spec.model.maxtext_model, small_sampler.devices, rc.spec.trainer.maxtext_version
    )
    sampler.update(
        tpu=small_sampler.type_name, replicas=1, maxModelLen=128, tensorParallel=tp, expertParallel=ep
    )
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
        "trainer": f"{rc.trainer.tpu.type_name} x {rc.trainer.slices} -> {small.type_name} x {slices} "
        f"({hosts} hosts x {containers} containers per slice)",
        "mesh": f"{fmt_mesh(full)} -> {fmt_mesh(mesh)}",
        "sampler": f"{rc.sampler.tpu.type_name} x {rc.sampler.replicas} ({_hosts(rc.sampler.tpu.hosts)} per "
        f"replica) -> {small_sampler.type_name} x 1 ({_hosts(sampler_hosts)}"
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
        procs, trainers, samplers = launch(
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
        stop(procs)
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
    for name in objects(env, adapters):
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
