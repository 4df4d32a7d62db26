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

This module is the command (``register``, ``cmd_drill``) and one drill's order of parts (``drill``); each
part is a module of its own, whose public names are re-exported here (tests/ and hack/ use
``rljob.cli.drill.NAME``):

- ``cases``: the cases (a manifest, a recipe and profile, ``--all``) and their resolved plans;
- ``topology``: part 2, the full-size process topology and MaxText's full-size mesh;
- ``scaled``: part 3, the scaled manifest and its run (steps, adapters, the parity gate);
- ``samplers``: the scaled run's sampler replicas (a multi-host replica's Ray nodes, a lost worker), and
  the samplers alone (``run_samplers``);
- ``service``: part 3 of a service-mode job (the Tinker API and a training client's operations);
- ``compile``: ``--compile``, instead of part 3: libtpu's compile of the trainer's programs;
- ``procs``: the local processes of a run (started with their containers' environments, stopped) and
  the GCS emulator they store to.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .cases import (
    EXIT_BAD,
    EXIT_FAIL,
    EXIT_OK,
    REPO,
    STORAGE,
    Case,
    DrillBadInput,
    DrillFailed,
    Outcome,
    all_cases,
    cases_from_args,
    jobset_of,
    recipe_doc,
    resolve_doc,
)
from .compile import compile_env, run_compile
from .procs import Proc, base_env, local_run_config, python, start_storage
from .samplers import run_samplers, sampler_replicas, worker_loss
from .scaled import run_scaled, sampler_layout, scaled_doc, scaled_mesh, scaled_sampler_hosts
from .service import rehearse_service, run_service
from .topology import fmt_mesh, full_mesh, full_topology, mesh_axes

__all__ = [
    "EXIT_BAD",
    "EXIT_FAIL",
    "EXIT_OK",
    "REPO",
    "STORAGE",
    "Case",
    "DrillBadInput",
    "DrillFailed",
    "Outcome",
    "Proc",
    "all_cases",
    "base_env",
    "cmd_drill",
    "compile_env",
    "drill",
    "full_mesh",
    "full_topology",
    "jobset_of",
    "local_run_config",
    "mesh_axes",
    "python",
    "recipe_doc",
    "register",
    "rehearse_service",
    "resolve_doc",
    "run_compile",
    "run_samplers",
    "run_scaled",
    "run_service",
    "sampler_layout",
    "sampler_replicas",
    "scaled_doc",
    "scaled_mesh",
    "scaled_sampler_hosts",
    "start_storage",
    "worker_loss",
]


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
        shown = fmt_mesh(mesh)
        if rc.trainer.slices > 1:
            dcn = {a: int(getattr(rc.trainer.dcn, a)) for a in mesh_axes(rc)}
            shown = f"{shown} per slice, {fmt_mesh(dcn)} across {rc.trainer.slices} slices"
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


def cmd_drill(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise DrillBadInput([f"--steps: at least 2, got {args.steps}"])
    cases = cases_from_args(args)
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
