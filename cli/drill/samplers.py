"""The sampler replicas of a scaled run: what came up (replicas, hosts; a multi-host replica's Ray nodes
as its head's stand-in for `vllm serve` saw them before serving), a multi-host replica's lost worker pod
(the head must exit with a counted restart, contract 3), and the samplers alone (run_samplers: each
replica healthy and serving a request, no trainer)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from rljob.common.ports import free_port

from .cases import DrillFailed, jobset_of
from .procs import Proc, launch, local_run_config, signal_pod, start_storage, stop

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
    signal_pod(worker, signal.SIGKILL)
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
        procs, _, samplers = launch(
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
        stop(procs)
        gcs.terminate()
        gcs.wait(timeout=20)
    return out
