"""One GRPO train step measured on a TPU chip: rljob's step against tunix's RL learner step, padded and
packed, on the same full-size model, rollouts, LoRA and dtype.

The arms are bench/train_step_vs_tunix.py's (the same code, there on a tiny model on the CPU), here on
MaxText's ``qwen3-0.6b`` (bf16, Splash attention, scanned layers, LoRA rank 8 on every projection) and a
GRPO batch of ``--rollouts`` rollouts in groups of 4 with RL's long-tailed lengths (prompts uniform in
256..1024, completions log-uniform in 256..19,456, divided by ``--scale``):

  rljob         rljob.trainer.train_step.Trainer: rows of ``budget`` tokens packed first-fit, one accumulate
                call per row, the fused log-prob head (no [B, T, V] logits), then one apply; Splash
                attention's keys as rljob's recipe for this model on a v5e sets them (RECIPE).
  tunix_padded  tunix 0.1.7's RL actor step (tunix.rl.trainer.Trainer with tunix.rl.algo_core.grpo_loss_fn,
                what its GRPO learner runs by default): every rollout padded to the longest prompt and the
                longest completion (each in Splash's 128-token blocks, the row in its 512-token query
                blocks, as a user of MaxText's flash attention must size them), one rollout per call
                (training_micro_batch_size 1: the only size at which its [B, T, V] float32 logits fit
                this chip at these lengths), gradients accumulated.
  tunix_packed  the same step on tunix's own packing (tunix.rl.utils.pack_sequences at the same budget).
MaxText's own RL trainer (maxtext.trainers.post_train.rl.train_rl) trains with the tunix step above: its
program is tunix_padded's (bench/train_step_compiled.py compiles it separately on the TPU compiler).

Each arm runs in a process of its own (the chip's peak-memory counter only grows within one), two warm-up
steps, then ``--repeats`` timed steps; per arm: the median step seconds, useful (non-pad) tokens/s, peak
HBM, MFU (MaxText's model FLOPs of the useful tokens over the chip's peak bf16 FLOP/s; the FLOPs per token
are in the output), the tokens the arm computed (pads included). The peak HBM is
rljob.trainer.chip_memory.step_peak: the bytes the process holds after the steps (``memory_stats()``) plus
the arm's largest program temporaries as the chip's compiler assigns them (``memory_analysis()``: one more
compile per arm; outputs are left out of every arm alike, since the analysed tunix step returns its state
undonated), since the allocator's own ``peak_bytes_in_use`` (also in the output, ``allocator_peak_bytes``)
does not count a running program's temporaries on a TPU (tests/tpu/test_memory_stats_chip.py); where that
peak is the larger it counts only if the arm's steps reached it, not the building of its model before the
warm-up steps (``setup_peak_bytes``, read then, in the output).
The last lines: each rljob arm over the best peer (tokens/s, against the fastest peer) and over the leanest
peer (peak HBM). ``--remat full,minimal`` runs rljob's arm once per MaxText ``remat_policy`` (the peers keep
MaxText's default, full, as their users run them); ``--rljob-keys KEY=VALUE[,...]`` (repeatable) adds an rljob
arm with those MaxText keys over the first ``--remat`` policy (Splash's ``sa_block_*`` sizes, say), to try a
change on the chip beside the arm without it. A failed arm prints its error line (``arm_failed``). Without a
TPU: one line, skipped. Run on a TPU machine
(hack/tpu/README.md):
``python bench/train_step_chip.py [--rollouts 16] [--scale 4] [--repeats 5] [--remat full,minimal]``
``--profile DIR`` traces one more step of each rljob arm (jax.profiler) and prints what the device spent it on
(``profile``: busy against wall seconds, seconds per program, the top op kinds by exclusive seconds, the
host's packing seconds), the trace left in DIR.
``--cpu-dry-run`` runs every arm here on the CPU at 2 layers with dot-product attention (Splash is TPU-only):
a check of the script, not a figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ARMS = ("rljob", "tunix_padded", "tunix_packed")
MODEL = "qwen3-0.6b"
# rljob's recipe for this model on a v5e: the rljob arm runs its Splash attention keys (the fused backward
# kernel and blocks of 1,024, chosen by this bench on the chip); the peers keep MaxText's defaults, as their
# users run them.
RECIPE = "qwen3-0.6b-v5e"


def recipe_splash() -> dict[str, Any]:
    """The recipe's Splash attention keys (``sa_*``), as its manifests pass them to MaxText."""
    from rljob.recipes import recipe_catalog

    trainer = recipe_catalog.load(RECIPE).spec.trainer
    return {k: v for k, v in ((trainer.maxtext or {}) if trainer else {}).items() if k.startswith("sa_")}


def emit(metric: str, value: object, **kw: object) -> None:
    print(json.dumps({"bench": "train_step_chip", "metric": metric, "value": value, **kw}), flush=True)


def _cpu_bench() -> Any:
    """bench/train_step_vs_tunix.py (bench/ is not a package): its arms, rollout lengths and rollouts."""
    spec = importlib.util.spec_from_file_location(
        "train_step_vs_tunix", Path(__file__).with_name("train_step_vs_tunix.py")
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def keys(budget: int, remat: str = "full", cpu_dry_run: bool = False) -> dict[str, Any]:
    if cpu_dry_run:
        return {
            **keys(budget, remat),
            "attention": "dot_product",
            "base_num_decoder_layers": 2,
            "override_model_config": True,
        }
    return {
        "model_name": MODEL,
        "run_name": "rljob",
        "base_output_directory": "",
        "attention": "flash",
        "dtype": "bfloat16",
        "weight_dtype": "bfloat16",
        "scan_layers": True,
        "max_target_length": budget,
        "per_device_batch_size": 1,
        "remat_policy": remat,
    }


def overrides(spec: str) -> dict[str, Any]:
    """``KEY=VALUE[,KEY=VALUE]`` as MaxText keys, each value read as YAML reads it (1024 an int)."""
    import yaml

    out: dict[str, Any] = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--rljob-keys: {item!r} is not KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value)
    return out


def failure_line(stderr: str) -> str:
    """What a failed arm's process died of: the last ``SomethingError: ...`` line of its stderr (JAX's
    traceback filtering notice comes after it), else its last line."""
    lines = stderr.strip().splitlines() or ["?"]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exit)\b", ln)]
    return (errors or lines)[-1][:300]


def run_arm(arm: str, a: argparse.Namespace) -> dict[str, Any]:
    """In this process: one arm's warm-up and timed steps on the chip."""
    import jax
    from rljob.recipes import generations
    from rljob.trainer import chip_memory, compilecheck
    from rljob.trainer.model import maxtext_config
    from rljob.trainer.packing import align_up

    cpu = _cpu_bench()
    lengths = cpu.rollout_lengths(a.rollouts, a.scale, a.seed)
    splash = recipe_splash()
    # One row length for every arm, in whole Splash blocks of the recipe's keys (MaxText's Splash refuses a
    # row its blocks do not split).
    unit = math.lcm(128, *(int(v) for k, v in splash.items() if k.startswith("sa_block")))
    budget = align_up(19_456 // a.scale + 1024 // a.scale, unit)
    # The peers keep MaxText's default rematerialisation (full), as their users run them; rljob's arm takes
    # --remat (what rljob's recipes would set for this model on this chip).
    k = keys(budget, a.remat if arm == "rljob" else "full", a.cpu_dry_run)
    if arm == "rljob":
        if not a.cpu_dry_run:
            k.update(splash)
        k.update(json.loads(a.keys_json))
    rollouts = cpu.make_rollouts(lengths, 151_936, a.group, a.seed)
    if arm == "rljob":
        built = cpu.rljob_arm(k, rollouts, budget)
    else:
        # Splash attention (TPU) takes rows in 128-token blocks: tunix's padded lengths and the sample call
        # qwix makes to create the LoRA factors are sized for it (bench/train_step_vs_tunix.py).
        built = cpu.tunix_arm(
            k,
            rollouts,
            budget,
            packed=arm == "tunix_packed",
            micro_batch=1,
            align=128,
            sample_tokens=512,
            row_align=512,
        )
    times = [built["step"]()[0] for _ in range(a.repeats)]
    profile = None
    if a.profile and arm == "rljob":
        out = Path(a.profile)
        with jax.profiler.trace(str(out)):
            wall = built["step"]()[0]
        profile = profile_summary(max(out.glob("**/*.xplane.pb"), key=lambda f: f.stat().st_mtime), wall)
        profile["pack_seconds"] = built["pack_seconds"]()
    useful = sum(p + c for p, c in lengths)
    cfg = maxtext_config(k)
    flops = compilecheck.model_flops(cfg, float(useful), backward=True)
    step = statistics.median(times)
    # This TPU's generation, by the kind JAX names its device (the generation table's device_kinds); a CPU
    # dry run takes v5e's figures.
    gen = generations.BY_DEVICE_KIND.get(jax.devices()[0].device_kind, generations.GENERATIONS["v5litepod"])
    chip = compilecheck.CHIPS[gen.prefix]
    mem = chip_memory.step_peak(
        jax.devices()[0], {"step": int(built["temp_bytes"])}, int(built.get("setup_peak_bytes", 0))
    )
    return {
        "arm": arm,
        "step_seconds": step,
        "all_seconds": times,
        "useful_tokens": useful,
        "computed_tokens": built.get("row_tokens"),
        "tokens_per_s": useful / step,
        "peak_hbm_bytes": mem["peak_bytes"],
        "held_bytes": mem["held_bytes"],
        "temp_bytes": int(built["temp_bytes"]),
        "allocator_peak_bytes": mem["allocator_peak_bytes"],
        "setup_peak_bytes": mem["setup_peak_bytes"],
        "memory_stats": mem["memory_stats"],
        "mfu": flops / step / chip.peak_bf16_flops,
        "model_flops_per_token": flops / useful,
        "budget": budget,
        "remat_policy": k["remat_policy"],
        "maxtext_overrides": {**splash, **json.loads(a.keys_json)} if arm == "rljob" else {},
        "device": jax.devices()[0].device_kind,
        **{k2: v for k2, v in built.items() if k2 in ("adapter", "example_shape", "calls", "rows")},
        **({"profile": profile} if profile else {}),
    }


def _union_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end) spans given in nanoseconds."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e9


def op_kind(name: str) -> str:
    """An HLO op's kind from its event name (a TPU names the event by the op's whole text,
    ``%fusion.1077 = (f32[2048]...) fusion(...)``; the CPU by ``ynn_fusion.5``): the name without its
    ``%`` and numeric suffix, e.g. ``fusion``, ``splash_mha_dq_segmented_no_residuals``."""
    head = name.split(" = ", 1)[0].lstrip("%").strip()
    return re.sub(r"(\.\d+)+$", "", head)


def _self_seconds(events: list[tuple[float, float, str]]) -> dict[str, list[float]]:
    """Exclusive seconds and count per op kind: an op's time less the ops nested in it (a TPU's ``XLA Ops``
    line nests a loop's body ops inside the ``while`` op)."""
    out: dict[str, list[float]] = {}
    stack: list[list[Any]] = []  # [end, kind, self ns]
    done: list[list[Any]] = []
    for start, dur, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            done.append(stack.pop())
        if stack:
            stack[-1][2] -= dur
        stack.append([start + dur, op_kind(name), dur])
    for _, kind, ns in done + stack:
        acc = out.setdefault(kind, [0.0, 0])
        acc[0] += max(ns, 0.0) / 1e9
        acc[1] += 1
    return out


def profile_summary(xplane: Path, wall_seconds: float, top: int = 15) -> dict[str, Any]:
    """What one traced step spent its device time on, read from the trace's XSpace with JAX's own reader
    (``jax.profiler.ProfileData``): the device's busy seconds against the step's wall seconds (the rest is
    the device waiting on the host: packing, transfers, dispatch), seconds per program, and the ``top`` op
    kinds by exclusive seconds (Splash's kernels, XLA's fusions, copies, ...). A TPU's ops are its device
    plane's ``XLA Ops`` line; the CPU's are the host's events with an ``hlo_op`` stat."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    events: list[tuple[float, float, str]] = []
    modules: dict[str, float] = {}
    device = [p for p in data.planes if p.name.startswith("/device:TPU")]
    for plane in device or [p for p in data.planes if p.name.startswith("/host:CPU")]:
        for line in plane.lines:
            if device and line.name == "XLA Modules":
                for ev in line.events:
                    name = re.sub(r"\(\d+\)$", "", ev.name)  # jit__accumulate(9859146214410202699)
                    modules[name] = modules.get(name, 0.0) + ev.duration_ns / 1e9
                continue
            if device and line.name != "XLA Ops":
                continue
            for ev in line.events:
                if not device:
                    stats = dict(ev.stats)
                    if "hlo_op" not in stats:
                        continue
                    module = str(stats.get("hlo_module", ""))
                    modules[module] = modules.get(module, 0.0) + ev.duration_ns / 1e9
                events.append((ev.start_ns, ev.duration_ns, ev.name))
    busy = _union_seconds([(s, s + d) for s, d, _ in events])
    kinds = _self_seconds(events)
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "wall_seconds": wall_seconds,
        "device_busy_seconds": busy,
        "device_busy_fraction": busy / wall_seconds if wall_seconds else 0.0,
        "op_self_seconds": sum(v[0] for v in kinds.values()),
        "modules": {k: round(v, 6) for k, v in sorted(modules.items(), key=lambda kv: -kv[1])[:top]},
        "top_ops": [
            {"op": kind, "seconds": round(sec, 6), "count": int(n), "share": sec / busy if busy else 0.0}
            for kind, (sec, n) in ranked
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}; empty: none")
    ap.add_argument(
        "--remat", default="full", help="rljob arm's MaxText remat_policy; a comma list runs one arm each"
    )
    ap.add_argument(
        "--rljob-keys",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="one more rljob arm with these MaxText keys (e.g. sa_block_q=1024,sa_block_kv=1024); repeatable",
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        help="rljob arms: one more step under jax.profiler.trace into DIR/<arm>, summarized (profile lines)",
    )
    ap.add_argument("--arm-timeout", type=int, default=900, help="seconds for one arm's process")
    ap.add_argument("--cpu-dry-run", action="store_true", help="2 layers, dot-product attention, on the CPU")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # one arm, in this process (the parent runs each so)
    ap.add_argument("--keys-json", default="{}", help=argparse.SUPPRESS)  # that arm's MaxText overrides
    a = ap.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    unknown = sorted(set(arms + ([a.arm] if a.arm else [])) - set(ARMS))
    if unknown:  # an unknown name once ran as tunix_padded
        ap.error(f"--arms: no arm {', '.join(unknown)} (the arms: {', '.join(ARMS)}; --arms= for none)")
    if a.arm:
        print("ARM " + json.dumps(run_arm(a.arm, a)), flush=True)
        return 0
    env = dict(os.environ)
    probe = "import jax; print(any(d.platform == 'tpu' for d in jax.devices()))"
    has_tpu = a.cpu_dry_run or (
        "tpu" in env.get("JAX_PLATFORMS", "tpu")
        and subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=False, timeout=300
        )
        .stdout.strip()
        .endswith("True")
    )
    if a.cpu_dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    if not has_tpu:
        emit("skipped", "no TPU on this machine (a TPU machine: hack/tpu/README.md)")
        return 0
    ctx = {
        "model": MODEL,
        "rollouts": a.rollouts,
        "scale": a.scale,
        "repeats": a.repeats,
        "cpu_dry_run": a.cpu_dry_run,
    }
    results: dict[str, dict[str, Any]] = {}
    policies = a.remat.split(",")
    runs: list[tuple[str, str, dict[str, Any]]] = [
        (arm, remat, {}) for arm in arms for remat in (policies if arm == "rljob" else ["full"])
    ]
    runs += [("rljob", policies[0], overrides(spec)) for spec in a.rljob_keys]
    for arm, remat, extra in runs:
        name = arm if arm != "rljob" or ("," not in a.remat and not a.rljob_keys) else f"rljob[{remat}]"
        if extra:
            name = f"rljob[{remat},{','.join(f'{k}={v}' for k, v in extra.items())}]"
        cmd = [
            sys.executable,
            __file__,
            "--arm",
            arm,
            f"--remat={remat}",
            f"--keys-json={json.dumps(extra)}",
        ] + [f"--{n}={getattr(a, n)}" for n in ("rollouts", "group", "scale", "repeats", "seed")]
        if a.profile and arm == "rljob":
            cmd.append(f"--profile={Path(a.profile) / re.sub(r'[^A-Za-z0-9_.=-]+', '_', name)}")
        if a.cpu_dry_run:
            cmd.append("--cpu-dry-run")
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=env, check=False, timeout=a.arm_timeout
            )
        except subprocess.TimeoutExpired:
            emit("arm_failed", f"no result within {a.arm_timeout} s", arm=name, **ctx)
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ARM ")]
        if proc.returncode != 0 or not lines:
            tail = failure_line(proc.stderr)
            emit("arm_failed", tail, arm=name, **ctx)
            continue
        r = json.loads(lines[-1][4:])
        r["arm"] = name
        results[name] = r
        if "profile" in r:
            emit("profile", r.pop("profile"), arm=name, **ctx)
        for metric in ("step_seconds", "tokens_per_s", "peak_hbm_bytes", "mfu"):
            emit(
                metric,
                r[metric],
                **ctx,
                **{
                    k: v
                    for k, v in r.items()
                    if k not in ("step_seconds", "tokens_per_s", "peak_hbm_bytes", "mfu")
                },
            )
    peers = {k: v for k, v in results.items() if not k.startswith("rljob")}
    if not peers:
        return 0
    fastest = max(peers.values(), key=lambda r: r["tokens_per_s"])
    leanest = min(peers.values(), key=lambda r: r["peak_hbm_bytes"])
    for name, mine in results.items():
        if not name.startswith("rljob"):
            continue
        emit(
            "rljob_over_best_peer_tokens_ratio",
            mine["tokens_per_s"] / fastest["tokens_per_s"],
            arm=name,
            remat_policy=mine["remat_policy"],
            peer=fastest["arm"],
            **ctx,
        )
        emit(
            "rljob_over_best_peer_peak_hbm_ratio",
            mine["peak_hbm_bytes"] / max(leanest["peak_hbm_bytes"], 1),
            arm=name,
            remat_policy=mine["remat_policy"],
            peer=leanest["arm"],
            **ctx,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
