"""Part 2 of a drill, the full-size topology, without the model: the environment of every trainer
container of every pod of every slice of the rendered JobSet goes through the trainer's process-topology
function (the JAX process ids 0..N-1 once each, one coordinator, N x each container's devices = the
plan's devices = the product of the mesh); then MaxText builds the full-size mesh over that many host
devices (``python -m rljob.trainer.meshcheck``) and its axes must be the plan's."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

from .cases import DrillFailed, jobset_of
from .procs import base_env, last_lines, python


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


def mesh_axes(rc: Any) -> dict[str, int]:
    from rljob.recipes.runconfig import MESH_AXES

    return {a: int(getattr(rc.trainer.ici, a)) * int(getattr(rc.trainer.dcn, a)) for a in MESH_AXES}


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
        raise DrillFailed("full-size mesh (python -m rljob.trainer.meshcheck):\n" + last_lines(proc.stderr))
    got: dict[str, int] = json.loads(proc.stdout.strip().splitlines()[-1])["mesh"]
    want = {a: int(getattr(rc.trainer.ici, a)) for a in mesh_axes(rc)} if per_slice else mesh_axes(rc)
    wrong = {a: (got.get(a, 1), n) for a, n in want.items() if got.get(a, 1) != n}
    if wrong:
        raise DrillFailed(f"full-size mesh: MaxText built {got}, the plan says {want}")
    return got


def fmt_mesh(mesh: dict[str, int]) -> str:
    return " x ".join(f"{a} {n}" for a, n in mesh.items() if n > 1) or "1"
