"""``python -m rljob.trainer.compilecheck --config run.json``: the trainer's TPU programs, compiled by the
real TPU compiler (libtpu) for the run's slice, on a machine without a TPU.

The slice is described by ``jax.experimental.topologies.get_topology_desc`` (the run's TPU type as MaxText's
``accelerator_to_spec_map`` names it, every slice: a multi-slice run's devices carry their slice ids), the
policy is built abstractly over those devices (:class:`rljob.trainer.model.Policy` with ``devices``: the
full-size MaxText model with the run's MaxText keys and the qwix LoRA, every parameter a ShapeDtypeStruct
with its NamedSharding, no weights), and the trainer's own jitted functions are lowered and compiled for the
run's shapes, as MaxText's ``train_compile`` does for its train step:

- ``accumulate``: :attr:`rljob.trainer.train_step.Trainer.accumulate_program`, the micro-batches' forward and
  backward with the fused log-prob head (and the KL reference pass where ``spec.algorithm.klPenaltyCoef`` is
  on), the gradients summed, ``[micro_batches, rows, tokenBudget]`` packed rows;
- ``apply``: :attr:`~rljob.trainer.train_step.Trainer.apply`, the optimizer update of the LoRA parameters;
- ``parity_logprobs``: :meth:`rljob.trainer.model.Policy.scoring_program`, the step-0 parity gate's log-probs
  of ``[rows rounded up to what the batch axes divide, tokenBudget]`` (rljob.trainer.rollouts.parity_pack),
  the base weights in the layouts ``accumulate``'s compile chose (the trainer lays them out so before its
  gate scores: :meth:`~rljob.trainer.train_step.Trainer.lay_out_base`).

A run config with ``spec.service`` (the Tinker API service) runs no loop: its programs are the service
engine's instead, beside every training client's resident state (rljob.trainer.compilecheck_service).

Per program and device: XLA's memory analysis (argument, output, alias, temporary and generated-code bytes),
the bytes of the trainer's state that stay in HBM while the program runs without being its argument
(``resident_bytes``: the optimizer state during ``accumulate`` and ``parity_logprobs``, the base weights
during ``apply``), their sum as the peak against the device's HBM, and XLA's cost analysis (FLOPs, bytes
accessed) with a roofline time: max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth) per device
(:data:`CHIPS`, the generations' public specs). Nothing runs: Splash attention, megablox and every other
Pallas kernel are compiled as on the TPU (``JAX_PLATFORMS=cpu`` keeps JAX's own backend on the CPU; MaxText's
kernels lower for the compile target, not for the local backend).

Prints one JSON line: ``{"compile": {"topology": "v5p:2x2x1", "type": "v5p-8", "slices": 1, "devices": 4,
"programs": {NAME: {...}}, "fits": true, "seconds": S}}``. Exit 0 when every program compiled and fits; 2 when
a program does not fit the device's HBM (the compiler's out-of-memory, or the peak above the capacity), one
line per program on stderr naming the fields that drive its size and an estimate that fits; 1 on anything
else (our bug, with the traceback).

``--cache-dir DIR``: the compiled programs are also written to JAX's persistent compilation cache in
``DIR/jax-trainer`` and uploaded to the run's ``{storage}/cache/jax-trainer/``, the layout the trainer pods
restore before they compile (:func:`rljob.common.caches.jax_compilation_cache`, the same call the trainer
makes); ``--termination-log PATH``: the refusal lines are also written there (the operator's compile
preflight, docs/operator.md, reads them from the pod's termination message).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rljob.recipes import libtpu, tpu
from rljob.recipes.failure import EXIT_BAD_CONFIG, EXIT_OK
from rljob.recipes.generations import BY_ACCELERATOR, GENERATIONS, hbm_limit_bytes
from rljob.recipes.runconfig import RunConfig

__all__ = ["CHIPS", "Chip", "compile_run", "main", "resident_bytes", "roofline"]

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation's public figures per chip (``devices`` JAX devices each)."""

    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    devices: int
    source: str
    limit_bytes: int  # what one process may allocate (rljob.recipes.generations.hbm_limit_bytes)

    @property
    def device_hbm(self) -> int:
        """The published HBM per JAX device."""
        return self.hbm_bytes // self.devices

    @property
    def device_limit(self) -> int:
        """What a program may use per JAX device, the allocator's limit: a program fits where its peak is
        at most this."""
        return self.limit_bytes // self.devices

    def hbm_figures(self) -> dict[str, int]:
        """Both per-device figures as the compile stage reports them beside a program's peak."""
        return {"hbm_bytes_per_device": self.device_hbm, "hbm_limit_bytes_per_device": self.device_limit}


# Every generation's figures per chip, from its row of the generation table (rljob.recipes.generations, each
# figure cited there), keyed by the type-name prefix.
CHIPS: dict[str, Chip] = {
    g.prefix: Chip(
        g.hbm_gib_per_chip * GIB,
        g.peak_bf16_tflops * 1e12,
        g.hbm_gb_per_s * 1e9,
        g.devices_per_chip,
        g.spec_source,
        hbm_limit_bytes(g),
    )
    for g in GENERATIONS.values()
}


def generation(rc: RunConfig) -> str:
    """The trainer's generation, by its type-name prefix (the key of :data:`CHIPS`)."""
    return BY_ACCELERATOR[rc.trainer.tpu.accelerator].prefix


def set_libtpu_flags(rc: RunConfig) -> None:
    """This process's LIBTPU_INIT_ARGS: the trainer's libtpu flags (spec.trainer.libtpuFlags), as the trainer
    containers get them (rljob.recipes.render) and as JAX on their TPU machines completes them
    (:func:`rljob.recipes.libtpu.tpu_machine_args`), so that libtpu compiles here what it compiles there and
    JAX's persistent cache files the programs under the keys the trainer looks up. Read when libtpu starts
    (the first topology)."""
    os.environ[libtpu.ENV] = libtpu.tpu_machine_args(rc.trainer.libtpu_flags)


def libtpu_flag_refusals(config: str, rc: RunConfig) -> list[str]:
    """One line per flag of spec.trainer.libtpuFlags that this libtpu does not know. libtpu exits at start on
    an unknown flag (``Unknown command line flag``), so a child process describes the topology first."""
    if not rc.trainer.libtpu_flags:
        return []
    code = (
        "import sys; from rljob.recipes.runconfig import RunConfig; "
        "from rljob.trainer.compilecheck import topology_devices; "
        "topology_devices(RunConfig.load(sys.argv[1]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, config], capture_output=True, text=True, timeout=600, check=False
    )
    version = importlib.metadata.version("libtpu")
    return [
        f"{libtpu.FIELD}.{name}: libtpu {version} (the trainer image's) has no flag {name}"
        for name in libtpu.unknown_flags(proc.stderr)
    ]


def topology_devices(rc: RunConfig) -> list[Any]:
    """The compile-only devices of the run's trainer slices, as MaxText's train_compile describes them."""
    # No TPU is attached: libtpu only compiles here, so several compiles (test workers, other drills) may load
    # it at once (without this the second one fails on libtpu's /tmp/libtpu_lockfile), and it need not ask
    # the GCE metadata server for a TPU's identity.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    set_libtpu_flags(rc)
    from jax.experimental.topologies import get_topology_desc
    from maxtext.utils import accelerator_to_spec_map

    hw = accelerator_to_spec_map.get_system_characteristics(tpu.maxtext_type(rc.trainer.tpu))
    return list(
        get_topology_desc(
            platform=hw.platform,
            topology_name=hw.topology_name,
            chip_config_name=hw.chip_config_name,
            chips_per_host_bounds=hw.chips_per_host_bounds,
            num_slices=rc.trainer.slices,
            wrap=hw.wrap,
        ).devices
    )


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of ``tree`` (ShapeDtypeStructs or arrays with a sharding)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        if jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            itemsize = 8  # a threefry key's data: two uint32
        else:
            itemsize = np.dtype(leaf.dtype).itemsize
        total += int(np.prod(shape, dtype=np.int64)) * itemsize
    return total


def resident_bytes(state: Any) -> int:
    """Per-device bytes of a trainer state tree (the sum over its leaves' shards)."""
    return shard_bytes(state)


def roofline(flops: float, bytes_accessed: float, chip: Chip) -> tuple[float, str]:
    """(seconds, bound) of one device: max(FLOPs / its bf16 peak, bytes / its HBM bandwidth)."""
    compute = flops / (chip.peak_bf16_flops / chip.devices)
    memory = bytes_accessed / (chip.hbm_bytes_per_s / chip.devices)
    return max(compute, memory), "compute" if compute >= memory else "memory"


@dataclasses.dataclass
class Program:
    name: str
    fn: Any
    args: tuple[Any, ...]
    resident: int  # per-device bytes of the state that stays in HBM beside the program's arguments
    drivers: str  # the spec fields that drive the program's size (the refusal's line)
    model_flops: float = 0.0  # analytic FLOPs per device (0: XLA's count, the program has no loop)
    state_args: int | None = None  # the leading arguments that do not grow with the rows (None: all)
    base_arg: int | None = None  # the argument that is the base weights (their layouts the compiler's)
    # A program compiled before this one whose base layouts this one's base argument takes (compile_run).
    base_from: str | None = None


def model_flops(cfg: Any, tokens_per_device: float, *, backward: bool, reference: bool = False) -> float:
    """FLOPs per device of the model over ``tokens_per_device`` tokens, from MaxText's own count
    (``maxtext_utils.calculate_tflops_training_per_device``: weights' matmuls x 3 and attention x 3 for a
    full training step of ``per_device_batch_size x max_target_length`` tokens). The trainer's base weights
    are frozen: a LoRA step's backward computes the activations' gradients (x 1 more) but not the weights'
    (the LoRA factors' own are negligible); attention's backward is x 2 as counted. ``reference``: the KL
    penalty's extra forward pass. Rematerialised recomputation is not counted (model FLOPs, not hardware)."""
    from maxtext.utils import maxtext_utils

    _, weights, attention = maxtext_utils.calculate_tflops_training_per_device(cfg, log=False)
    tokens = float(cfg.per_device_batch_size) * float(cfg.max_target_length)
    fw, fa = weights / 3, attention / 3  # forward only
    flops = (2 * fw + 3 * fa) if backward else (fw + fa)
    if reference:
        flops += fw + fa
    return float(flops) * 1e12 * tokens_per_device / max(tokens, 1.0)


def programs(policy: Any, trainer: Any, pack: Any) -> list[Program]:
    """The trainer's TPU programs with abstract arguments of the run's shapes."""
    import jax
    import jax.numpy as jnp
    from rljob.trainer.placement import abstract
    from rljob.trainer.rollouts import parity_pack

    cfg = trainer.cfg
    # The base as shapes: a program's arguments must not keep the weights alive (the trainer lays them out
    # and releases the old copies: Trainer.lay_out_base).
    base = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),  # type: ignore[no-untyped-call]
        policy.base,
    )
    state = abstract(jax.eval_shape(trainer.init_state, policy.lora0), trainer.state_sharding)
    acc, lora, batch = trainer.step_arguments()  # as the trainer compiles it (Trainer.lay_out_base)
    gate = parity_pack(pack, policy.row_multiple())
    # The gate's rows as the trainer passes them, host arrays (rollouts.SamplerSource.parity_of) whose
    # sharding the compiler chooses: a declared sharding lowers another program (measured on a TPU v5e, the
    # chip's parity program missed the compile stage's cache on its HLO and its compile options).
    row = jax.ShapeDtypeStruct((gate.rows, gate.budget), jnp.int32)  # type: ignore[no-untyped-call]
    opt = resident_bytes(state.opt_state) + resident_bytes((state.step, state.skipped))
    step_fields = "spec.packing.tokenBudget, spec.trainer.microBatchSize"
    n = int(policy.mesh.size)
    per_mb = cfg.rows * cfg.budget / n
    return [
        Program(
            "accumulate",
            trainer.accumulate_program,
            (acc, lora, base, batch),
            opt,
            f"{step_fields}, spec.trainer.maxtext.remat_policy, spec.trainer.tpu",
            cfg.micro_batches * model_flops(policy.cfg, per_mb, backward=True, reference=trainer.with_ref),
            state_args=3,
            base_arg=2,
        ),
        Program("apply", trainer.apply, (state, acc), resident_bytes(base), "spec.trainer.tpu"),
        Program(
            "parity_logprobs",
            policy.scoring_program(),
            (base, state.lora, row, row, row),
            opt,
            f"{step_fields} (rows rounded up to a multiple of {policy.row_multiple()}), spec.trainer.tpu",
            model_flops(policy.cfg, gate.rows * gate.budget / n, backward=False),
            state_args=2,
            # The trainer lays its base out as accumulate's program chose before the gate scores
            # (Trainer.lay_out_base): the parity program reads the base in those layouts.
            base_arg=0,
            base_from="accumulate",
        ),
    ]


# jax's shard_map: "... maps array axis 0 (of size 4) to mesh axes ('fsdp', 'expert') (of total size 8), but 8
# does not evenly divide 4"
_INDIVISIBLE = re.compile(
    r"array axis (\d+) \(of size \d+\) to mesh axes .*?\(of total size (\d+)\), "
    r"but \d+ does not evenly divide (\d+)"
)
_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Rr]an out of memory|exceeds? .*(HBM|hbm)")
# libtpu's other compile-time resource failures (https://openxla.org/xla/errors/error_3000 and its
# neighbours): a kernel's on-chip memory (SparseCore spmem, VMEM) does not hold the tiles this shape needs,
# e.g. "E3000: CompileTimeSparseCoreAllocationFailure: ... exceeds the legitimate user allocatable offset
# upper bound (2097151 words) in memory space spmem when allocating 2621440 words". Fewer tokens per call
# is what the user can change.
_KERNEL_MEMORY = re.compile(r"(E\d{4}): (CompileTime\w*(?:Allocation|Oom|Memory)\w*):? ?([^\n]*)")
_USED = re.compile(r"[Uu]sed ([0-9.]+)([KMGT])? of ([0-9.]+)([KMGT])? hbm")


def _bytes(num: str, unit: str | None) -> int:
    return int(float(num) * {None: 1, "": 1, "K": 1 << 10, "M": 1 << 20, "G": GIB, "T": 1 << 40}[unit])


def compile_program(p: Program, layouts: dict[str, Any] | None = None) -> Any:
    """``p`` lowered and compiled for its arguments' devices (jax's ``Compiled``; the compiler's errors
    raised). ``layouts``: the base weights' formats (sharding and memory layout) each program compiled so far
    chose, by name: ``p``'s base argument takes ``p.base_from``'s, and ``p``'s own are added."""
    args = p.args
    if layouts is not None and p.base_arg is not None and p.base_from in layouts:
        from rljob.trainer.placement import abstract

        i = p.base_arg
        args = (*args[:i], abstract(args[i], layouts[p.base_from]), *args[i + 1 :])
    compiled = p.fn.lower(*args).compile()
    if layouts is not None and p.base_arg is not None:
        layouts[p.name] = compiled.input_formats[0][p.base_arg]
    return compiled


def compile_one(p: Program, chip: Chip, layouts: dict[str, Any] | None = None) -> dict[str, Any]:
    """One program lowered and compiled for the topology (:func:`compile_program`): its figures
    (:func:`figures`), or ``error`` (and ``oom``) where the compiler refuses it."""
    t0 = time.monotonic()
    try:
        compiled = compile_program(p, layouts)
    except Exception as e:
        msg = str(e)
        split = _INDIVISIBLE.search(msg)
        if split:  # a kernel's shard_map (Splash attention) cannot split the rows over its mesh axes
            return {
                "fits": False,
                "indivisible": {"array_axis": int(split[1]), "devices": int(split[2]), "size": int(split[3])},
                "error": msg.strip().splitlines()[0][:400],
                **chip.hbm_figures(),
                "compile_seconds": round(time.monotonic() - t0, 1),
            }
        kernel = _KERNEL_MEMORY.search(msg)
        if kernel and "Hbm" not in kernel[2]:  # e.g. "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom"
            return {
                "fits": False,
                "kernel_memory": {"code": kernel[1], "kind": kernel[2]},
                "error": f"{kernel[1]}: {kernel[2]}: {kernel[3].strip()}"[:400],
                **chip.hbm_figures(),
                "compile_seconds": round(time.monotonic() - t0, 1),
            }
        if not _OOM.search(msg):
            raise
        out: dict[str, Any] = {"fits": False, "oom": True, "error": msg.strip().splitlines()[0][:400]}
        used = _USED.search(msg)
        if used:
            out["peak_bytes_per_device"] = _bytes(used[1], used[2]) + p.resident
        out.update(chip.hbm_figures())
        out["compile_seconds"] = round(time.monotonic() - t0, 1)
        return out
    return figures(p, compiled, chip, time.monotonic() - t0)


def figures(p: Program, compiled: Any, chip: Chip, compile_seconds: float = 0.0) -> dict[str, Any]:
    """What the compile stage reads off ``p`` compiled (``compiled``: jax's ``Compiled``, by
    :func:`compile_program` or by whatever compiled the same program): the peak HBM per device (arguments,
    outputs not aliased, temporaries, code, plus the state resident beside it), whether it fits ``chip``,
    the compiler's byte counts, the FLOPs and the roofline (``compile_seconds`` is reported as given)."""
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost or {}
    mem = {
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "temp_bytes": int(ma.temp_size_in_bytes),
        "code_bytes": int(ma.generated_code_size_in_bytes),
        "resident_bytes": p.resident,
    }
    peak = (
        mem["argument_bytes"]
        + mem["output_bytes"]
        - mem["alias_bytes"]
        + mem["temp_bytes"]
        + mem["code_bytes"]
        + p.resident
    )
    xla_flops = float(cost.get("flops", 0.0))
    accessed = float(cost.get("bytes accessed", 0.0))
    # XLA's cost analysis counts a loop's body once (the micro-batch scan, MaxText's layer scan): where the
    # program loops, its FLOPs are the model's analytic count and its bytes a lower bound.
    flops = p.model_flops or xla_flops
    seconds, bound = roofline(flops, accessed, chip)
    return {
        "peak_bytes_per_device": peak,
        **chip.hbm_figures(),
        "fits": peak <= chip.device_limit,
        **mem,
        "flops": flops,
        "bytes_accessed": accessed,
        "xla_flops": xla_flops,
        "roofline_seconds": seconds,
        "bound": bound,
        "compile_seconds": round(compile_seconds, 1),
    }


def _largest(value: int, peak: int, fixed: int, capacity: int, multiple: int) -> int:
    """``value`` scaled so the part of ``peak`` that grows with it fits ``capacity`` (linear estimate),
    rounded down to ``multiple``; 0 when even the fixed part does not fit."""
    room, grows = capacity - fixed, peak - fixed
    if room <= 0 or grows <= 0:
        return 0
    return max(0, int(value * room / grows) // multiple * multiple)


def refusal(name: str, fig: dict[str, Any], p: Program, rc: RunConfig, chip: Chip) -> str:
    """One line: the program, its peak against the HBM, the fields and an estimate that fits."""
    cap = chip.device_limit
    split = fig.get("indivisible")
    if split:
        n, rows = split["devices"], split["size"]
        return (
            f"spec.trainer.microBatchSize: {name}'s packed rows ({rows}) do not divide over the {n} devices "
            "MaxText's attention kernel splits them over (the batch axes of spec.trainer.mesh); use a "
            f"multiple of {n}, e.g. {-(-rows // n) * n}"
        )
    kernel = fig.get("kernel_memory")
    if kernel:
        budget, rows = rc.spec.packing.token_budget, rc.trainer.micro_batch_size
        return (
            f"compile: {name} does not compile for a {rc.trainer.tpu.type_name}: libtpu's {kernel['kind']} "
            f"({kernel['code']}: a kernel's on-chip memory, not HBM, is short for this many tokens per call; "
            f"{p.drivers}); lower spec.packing.tokenBudget (now {budget}) or spec.trainer.microBatchSize "
            f"(now {rows}), e.g. half, and rljob drill --compile again"
        )
    peak = fig.get("peak_bytes_per_device")
    head = f"compile: {name} needs {peak / GIB:.1f} GiB per device" if peak else f"compile: {name} ran out"
    head += (
        f" of a {rc.trainer.tpu.type_name} device's {cap / GIB:.1f} GiB usable HBM"
        f" (of {chip.device_hbm / GIB:.0f} GiB; {p.drivers})"
    )
    # What does not grow with the rows: the weights, the adapter and its optimizer state (every argument but
    # the packed rows, and the resident state), by arithmetic over their shards.
    state = p.args[: p.state_args] if p.state_args is not None else p.args
    fixed = shard_bytes(state) + p.resident
    devices = rc.trainer.devices  # every slice's
    # Weights and state that take most of the HBM leave too little for any rows (a layer's gathered weights,
    # the activations): a larger slice, sized so that they take about half of it.
    if fixed >= 0.8 * cap or p.state_args is None:
        more = max(2, math.ceil(fixed / (0.5 * cap)))
        return (
            head + f"; the weights, adapter and optimizer state alone are {fixed / GIB:.1f} GiB per device: "
            f"spec.trainer.tpu (or spec.trainer.slices) with about {more} x its {devices} devices"
        )
    budget = rc.spec.packing.token_budget
    align = max(int(rc.spec.packing.segment_align), 1)
    if peak and fixed:
        fit = _largest(budget, int(peak), int(fixed), cap, align)
        rows = _largest(rc.trainer.micro_batch_size, int(peak), int(fixed), cap, 1)
        wider = _wider_context(rc, int(peak), int(fixed), cap)
        return (
            head + f"; about spec.packing.tokenBudget {fit} (now {budget}) or spec.trainer.microBatchSize "
            f"{rows} (now {rc.trainer.micro_batch_size}) would fit{wider} (linear estimate from the "
            "temporaries; rljob drill --compile again to confirm)"
        )
    return head + f"; lower spec.packing.tokenBudget (now {budget}) or give the trainer a larger slice"


def _wider_context(rc: RunConfig, peak: int, fixed: int, cap: int) -> str:
    """Where the mesh already splits rows over a context axis: the same devices with each row split over k
    times as many (fsdp / k, context x k, microBatchSize / k), so each device holds 1/k of the tokens and
    about 1/k of the temporaries (the activations grow with the tokens a device holds; the weights, spread
    over the same devices, do not change). A packing of one rollout a row has no smaller token budget or
    row count to offer, this it has. The smallest power of two that fits, or nothing."""
    ici, rows = rc.trainer.ici, rc.trainer.micro_batch_size
    if ici.context <= 1 or peak <= fixed or fixed >= cap:
        return ""
    k = 2
    while fixed + (peak - fixed) / k > cap:
        k *= 2
    if ici.fsdp % k or rows % k:
        return ""
    return (
        f", or spec.trainer.mesh fsdp {ici.fsdp // k} x context {ici.context * k} (now fsdp {ici.fsdp} x "
        f"context {ici.context}) with spec.trainer.microBatchSize {rows // k}: each row over {k} x the "
        f"devices, 1/{k} of the tokens a device"
    )


def compile_run(
    rc: RunConfig,
    keys: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    only: set[str] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """(report, refusals) of the run's trainer programs compiled for its TPU topology. ``keys``: MaxText
    keys instead of the run config's (tests: a small model with the run's other settings; the packed rows
    are then ``max_target_length`` long); ``only``: these programs (tests)."""
    import jax

    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")  # type: ignore[no-untyped-call]
    from rljob.trainer.main import model_setup
    from rljob.trainer.model import Policy
    from rljob.trainer.train_step import Trainer

    t0 = time.monotonic()
    spec, step_cfg, _ = model_setup(rc, "config", None)
    mt = dict(keys if keys is not None else spec.maxtext)
    # MaxText derives the slice count and device count from the compile target (pyconfig: compile_topology).
    mt.update(
        compile_topology=tpu.maxtext_type(rc.trainer.tpu), compile_topology_num_slices=rc.trainer.slices
    )
    spec = dataclasses.replace(spec, maxtext=mt, checkpoint=None)
    devices = topology_devices(rc)
    chip = CHIPS[generation(rc)]
    policy = Policy(spec, devices=devices)
    if keys is not None:
        budget = int(mt.get("max_target_length", step_cfg.budget))
        step_cfg = dataclasses.replace(step_cfg, budget=budget, pad_align=min(step_cfg.pad_align, budget))
    service = rc.spec.service
    if service is not None:  # the Tinker service's programs (rljob.trainer.compilecheck_service)
        from rljob.trainer import compilecheck_service as svc
        from rljob.trainer.tinker.engine import Engine

        engine = Engine(policy, step_cfg, max_models=service.max_training_clients)
        state = svc.service_state(engine, service.max_training_clients)
        progs = svc.service_programs(engine, state)
    else:
        progs = programs(policy, Trainer(policy, step_cfg), step_cfg.pack_config())
    report: dict[str, Any] = {
        "model": str(mt.get("model_name", "")),
        "topology": f"{generation(rc)}:{rc.trainer.tpu.topology}",
        "type": rc.trainer.tpu.type_name,
        "slices": rc.trainer.slices,
        "devices": len(devices),
        "mesh": {str(k): int(v) for k, v in policy.mesh.shape.items() if int(v) > 1},
        "shape": {"micro_batches": step_cfg.micro_batches, "rows": step_cfg.rows, "budget": step_cfg.budget},
        "chip": {**chip.hbm_figures(), "source": chip.source},
        "programs": {},
    }
    if service is not None:
        report["service"] = state.report()
    refusals: list[str] = []
    layouts: dict[str, Any] = {}  # the base weights' layouts each program chose (Program.base_from)
    for p in progs:
        if only is not None and p.name not in only:
            continue
        if log:
            log(f"compiling {p.name} for {report['topology']} x {rc.trainer.slices}")
        fig = compile_one(p, chip, layouts)
        report["programs"][p.name] = fig
        if not fig["fits"]:
            refusals.append(
                svc.service_refusal(p.name, fig, p, rc, chip, state)
                if service is not None
                else refusal(p.name, fig, p, rc, chip)
            )
    report["fits"] = not refusals
    report["seconds"] = round(time.monotonic() - t0, 1)
    figs = report["programs"]
    if "accumulate" in figs and "roofline_seconds" in figs["accumulate"]:
        # Per micro-batch of the accumulate call, and the best utilisation of the chips the step can reach.
        acc = figs["accumulate"]
        report["roofline_seconds_per_micro_batch"] = acc["roofline_seconds"] / step_cfg.micro_batches
        report["max_flops_utilisation"] = (
            acc["flops"] / (acc["roofline_seconds"] * chip.peak_bf16_flops / chip.devices)
            if acc["roofline_seconds"] > 0
            else 0.0
        )
    return report, refusals


def compilation_cache(rc: RunConfig, cache_dir: str) -> Any:
    """Point this process's JAX at the trainer's persistent compilation cache under ``cache_dir`` (restored
    from ``{storage}/cache/jax-trainer/`` first): the rljob.common.caches.CacheSync to close after the
    compile, which uploads the entries the compile wrote."""
    import jax
    from rljob.common import caches

    return caches.jax_compilation_cache(
        caches.JAX_TRAINER, rc.storage.cache, Path(cache_dir), jax.config.update, rc.trainer.maxtext
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rljob.trainer.compilecheck", description=__doc__.splitlines()[0]
    )
    p.add_argument("--config", required=True)
    p.add_argument("--keys", help="JSON of MaxText keys to use instead of the run config's (tests)")
    p.add_argument("--cache-dir", help="write JAX's compilation cache here and upload it to {storage}/cache/")
    p.add_argument("--termination-log", help="also write the refusal lines to this file")
    args = p.parse_args(argv)
    rc = RunConfig.load(args.config)
    from rljob.trainer.main import settle_xla_flags

    # Before anything compiles, as the trainer does: XLA's compile options and JAX's cache keys then match
    # the trainer's (rljob.recipes.libtpu.settled_xla_flags).
    settle_xla_flags(rc.trainer.maxtext)
    flags = libtpu_flag_refusals(args.config, rc)
    if flags:
        return _refused(flags, {"fits": False, "libtpu_flags": rc.trainer.libtpu_flags}, args.termination_log)
    keys = json.loads(args.keys) if args.keys else None
    sync = compilation_cache(rc, args.cache_dir) if args.cache_dir else None
    try:
        report, refusals = compile_run(rc, keys, log=lambda m: print(m, file=sys.stderr, flush=True))
    finally:
        if sync is not None:
            print(f"cache jax-trainer: {sync.close()} new files saved to {sync.uri}", file=sys.stderr)
    if refusals:
        return _refused(refusals, report, args.termination_log)
    print(json.dumps({"compile": report}), flush=True)
    return EXIT_OK


def _refused(lines: list[str], report: dict[str, Any], termination_log: str | None) -> int:
    """A configuration that does not compile: its lines on stderr (and the termination log), the report."""
    for line in lines:
        print(line, file=sys.stderr)
    if termination_log:
        Path(termination_log).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(json.dumps({"compile": report}), flush=True)
    return EXIT_BAD_CONFIG


if __name__ == "__main__":
    sys.exit(main())
