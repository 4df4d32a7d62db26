"""The compile stage (rljob.trainer.compilecheck): the trainer's programs compiled by libtpu's TPU compiler
for a TPU topology described without the hardware, on this CPU machine.

Each catalog family's model at small sizes (its own MaxText config with the recipe's keys, only the sizes
shrunk: rljob.recipes.miniature, head_dim 128 for the Splash kernel) on a v5p, a tpu7x and a 2-slice
topology, the kernels compiled as on the TPU (Splash attention: a Mosaic custom call in the compiled
program), and XLA's memory analysis checked against arithmetic; an oversized configuration is refused with
the field named and a smaller value; the Tinker service's programs (spec.service) likewise. A full-size
compile takes minutes: docs/drill.md has those figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from rljob.common import caches
from rljob.recipes import miniature
from rljob.recipes.plan import parse_manifest, resolve
from rljob.recipes.runconfig import RunConfig

TESTED_MODULES = ("rljob.trainer.compilecheck_service",)

pytestmark = pytest.mark.jax

GIB = 1 << 30


def run_config(recipe: str, fit_check: bool = True, **spec: Any) -> RunConfig:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "cc"},
        "spec": {"recipe": recipe, "storage": {"root": "gs://rljob-cc"}, **spec},
    }
    return resolve(parse_manifest(yaml.safe_dump(doc)), fit_check=fit_check)


def small_keys(rc: RunConfig, length: int = 1024, **extra: Any) -> dict[str, Any]:
    """The plan's MaxText keys with the model's sizes shrunk (its miniature's layers and experts), widths in
    whole TPU tiles (1024 wide, heads of 128: Splash's lane width, so the memory arithmetic is not lost in
    the padding of 64-wide tensors), rows of ``length`` tokens, Splash blocks of at most 512."""
    keys = dict(rc.trainer.maxtext)
    name = str(keys["model_name"])
    keys.update(miniature.miniature_overrides(name), head_dim=128, max_target_length=length)
    keys.update(base_emb_dim=1024, base_num_query_heads=8, base_num_kv_heads=4, vocab_size=2048)
    keys.update({k: 1024 for k in ("base_mlp_dim", "base_moe_mlp_dim") if k in keys})
    if "global_head_dim" in keys:
        keys["global_head_dim"] = 128
    # Qwen3.5: the sections sum to half of the rotary dims (0.25 x 128), as [11, 11, 10] of 0.25 x 256.
    if "mrope_section" in keys:
        keys["mrope_section"] = [6, 5, 5]
    for k in [k for k in keys if k.startswith("sa_block")]:
        keys[k] = min(int(keys[k]), 512)
    keys.pop("base_output_directory", None)
    keys.update(extra)
    return keys


def run_compilecheck(
    rc: RunConfig, keys: dict[str, Any], tmp_path: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    """``python -m rljob.trainer.compilecheck`` on ``rc`` (written to ``tmp_path``) with ``keys``, on CPU."""
    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json(by_alias=True))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rljob.trainer.compilecheck",
            "--config",
            str(cfg),
            "--keys",
            json.dumps(keys),
            *extra,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONSAFEPATH": "1", "JAX_PLATFORMS": "cpu"},
        timeout=900,
    )


# (recipe, trainer overrides): every catalog family, each on one topology kind, the three kinds covered. A
# compile is one to three minutes on a loaded 2-core machine: qwen3 (v5p) runs in every `make test`, the
# others (tpu7x, 2 slices, MoE, Gemma 4, gated delta nets) in the slow tier.
FAMILIES = [
    pytest.param("qwen3-8b-v5p", {"tpu": "v5p-8"}, id="qwen3-v5p-8"),
    pytest.param(
        "gpt-oss-20b-v5p",
        # The recipe's mesh and rows on a tpu7x-8: 4 rows that Splash attention splits over fsdp x expert,
        # each row over the context axis.
        {"tpu": "tpu7x-8", "mesh": {"fsdp": 2, "expert": 2, "context": 2}, "microBatchSize": 4},
        id="gpt-oss-tpu7x-8",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "gemma4-31b-v5p",
        {"tpu": "v5p-8", "slices": 2},
        id="gemma4-v5p-8x2",
        # 54 s: make test-long; make test keeps a 2-slice compile (qwen3-tpu7x-8x2)
        marks=[pytest.mark.slow, pytest.mark.long],
    ),
    pytest.param(
        "qwen3.5-397b-a17b-tpu7x",
        {"tpu": "tpu7x-8", "mesh": {"fsdp": 2, "expert": 2, "context": 2}, "microBatchSize": 8},
        id="qwen3.5-tpu7x-8",
        # 574 s alone on a 2-core machine, the longest test of make test: make test-long
        marks=[pytest.mark.slow, pytest.mark.long],
    ),
    pytest.param(
        "qwen3-8b-v5p", {"tpu": "tpu7x-8", "slices": 2}, id="qwen3-tpu7x-8x2", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("recipe", "trainer"), FAMILIES)
def test_each_family_compiles_for_the_tpu_and_its_arguments_are_the_sharded_state(
    recipe: str, trainer: dict[str, Any]
) -> None:
    import jax
    from rljob.trainer import compilecheck

    # The model's sizes are shrunk below (small_keys): the full-size model's HBM fit is not the question.
    rc = run_config(recipe, fit_check=False, trainer=trainer)
    report, refusals = compilecheck.compile_run(rc, small_keys(rc), only={"accumulate", "apply"})
    assert refusals == [] and report["fits"] is True
    devices = rc.trainer.devices  # every slice's
    assert report["devices"] == devices and report["slices"] == rc.trainer.slices
    chip = compilecheck.CHIPS[rc.trainer.tpu.type_name.split("-")[0]]
    for name in ("accumulate", "apply"):
        fig = report["programs"][name]
        assert fig["hbm_bytes_per_device"] == chip.device_hbm
        assert fig["flops"] > 0 and fig["bytes_accessed"] > 0 and fig["roofline_seconds"] > 0
        assert fig["peak_bytes_per_device"] >= fig["argument_bytes"] + fig["temp_bytes"]
    # The arithmetic: apply's arguments are the train state (LoRA, AdamW's two moments, the step counters)
    # and the accumulated gradients (the LoRA's shapes) with their metrics: 4 x the adapter per device, up to
    # the TPU's tiled layout, which pads a factor's rank (16 or 32 here) towards the 128-wide lane.
    policy, _ = _abstract_policy(rc, small_keys(rc))
    lora = compilecheck.shard_bytes(policy.lora0)
    apply_args = report["programs"]["apply"]["argument_bytes"]
    rank = rc.spec.lora.rank
    assert 4 * lora <= apply_args <= 4 * lora * 128 / rank, (apply_args, lora)
    # accumulate's: the base weights sharded over every device (each parameter's elements / devices, within
    # 25%: norms and biases are replicated, small dimensions padded to tiles), the adapter twice (parameters,
    # gradients, as padded: bounded by apply's), the batch.
    total = sum(
        int(x.size) * (8 if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) else int(x.dtype.itemsize))
        for x in jax.tree.leaves(policy.base)
    )
    cfg = report["shape"]
    batch = 6 * cfg["micro_batches"] * cfg["rows"] * cfg["budget"] * 4 // devices
    args = report["programs"]["accumulate"]["argument_bytes"]
    low, high = args - apply_args / 2 - batch, args - 2 * lora - batch
    # The weights are split over every device but the data axes' (a multi-slice job's slices are data
    # parallel over DCN, each slice holding a whole copy).
    shards = devices // (rc.trainer.ici.data * rc.trainer.dcn.data)
    assert total / shards * 0.75 <= high and low <= total / shards * 1.25, (low, high, total / shards)


def _abstract_policy(rc: RunConfig, keys: dict[str, Any]) -> tuple[Any, Any]:
    import dataclasses

    from rljob.trainer import compilecheck
    from rljob.trainer.main import model_setup
    from rljob.trainer.model import Policy

    spec, step, _ = model_setup(rc, "config", None)
    keys = {
        **keys,
        "compile_topology": rc.trainer.tpu.type_name,
        "compile_topology_num_slices": rc.trainer.slices,
    }
    spec = dataclasses.replace(spec, maxtext=keys, checkpoint=None)
    return Policy(spec, devices=compilecheck.topology_devices(rc)), step


def test_splash_attention_is_compiled_as_on_the_tpu() -> None:
    """attention: flash lowers to the Splash Pallas kernel (a Mosaic custom call), not a CPU fallback."""
    import dataclasses

    from rljob.trainer.train_step import Trainer

    rc = run_config("qwen3-8b-v5p")
    policy, step = _abstract_policy(rc, small_keys(rc))
    step = dataclasses.replace(step, budget=1024, pad_align=1024)
    from rljob.trainer import compilecheck

    prog = {p.name: p for p in compilecheck.programs(policy, Trainer(policy, step), step.pack_config())}
    p = prog["parity_logprobs"]
    text = p.fn.lower(*p.args).compile().as_text()
    assert "tpu_custom_call" in text
    assert "splash" in text.lower() or "flash" in text.lower()


def test_the_parity_program_reads_the_base_in_the_layouts_the_step_chose() -> None:
    """The trainer lays its base weights out as the step's program chose before the parity gate scores
    (Trainer.lay_out_base), so the compile stage compiles the gate's program for those layouts: that is the
    program the trainer looks up in JAX's cache, at step 0 or after a step. libtpu's compiler chooses other
    layouts than the default for some of the step's base weights: the parity program compiled for the
    default layouts (before this, the compile stage's) reads the base in other layouts."""
    import dataclasses

    import jax
    from rljob.trainer import compilecheck
    from rljob.trainer.train_step import Trainer

    rc = run_config("qwen3-8b-v5p")
    policy, step = _abstract_policy(rc, small_keys(rc))
    step = dataclasses.replace(step, budget=1024, pad_align=1024)
    progs = {p.name: p for p in compilecheck.programs(policy, Trainer(policy, step), step.pack_config())}
    chip = compilecheck.CHIPS[compilecheck.generation(rc)]
    layouts: dict[str, Any] = {}
    for name in ("accumulate", "parity_logprobs"):
        assert "error" not in compilecheck.compile_one(progs[name], chip, layouts)
    step_layouts = jax.tree.leaves(layouts["accumulate"])
    assert jax.tree.leaves(layouts["parity_logprobs"]) == step_layouts
    default: dict[str, Any] = {}  # the parity program alone: the base in its default layouts
    compilecheck.compile_one(progs["parity_logprobs"], chip, default)
    alone = jax.tree.leaves(default["parity_logprobs"])
    differ = [a for a, b in zip(alone, step_layouts, strict=True) if a != b]
    assert differ, "the step chose the default layouts: this test would not tell the two programs apart"


def test_roofline_is_the_slower_of_compute_and_memory() -> None:
    from rljob.trainer.compilecheck import CHIPS, roofline

    v5p = CHIPS["v5p"]
    assert roofline(459e12, 0, v5p) == (1.0, "compute")
    assert roofline(0, 2765e9, v5p) == (1.0, "memory")
    # tpu7x: each of a chip's two devices has half its FLOP/s and bandwidth.
    assert roofline(2307e12 / 2, 1.0, CHIPS["tpu7x"]) == (1.0, "compute")
    assert CHIPS["tpu7x"].device_hbm == 96 * GIB and v5p.device_hbm == 95 * GIB


@pytest.mark.parametrize(
    ("prefix", "limit_per_device"),
    [
        ("v5litepod", 16_909_336_064),  # measured on a v5e chip: memory_stats()["bytes_limit"]
        ("v6e", int(32 * GIB * 0.97)),  # not measured: 3% held back
        ("v5p", int(95 * GIB * 0.97)),
        ("tpu7x", int(192 * GIB * 0.97) // 2),  # per chip, over its two devices
    ],
)
def test_a_program_fits_in_what_the_allocator_offers_not_the_published_hbm(
    prefix: str, limit_per_device: int
) -> None:
    """The compile stage's fit is against what libtpu's allocator lets a process hold: a program whose peak
    lies between that and the published HBM would be accepted here and fail to allocate on the chip."""
    from types import SimpleNamespace

    from rljob.trainer import compilecheck

    chip = compilecheck.CHIPS[prefix]
    assert chip.device_limit == limit_per_device < chip.device_hbm

    def compiled(temp: int) -> Any:
        ma = SimpleNamespace(
            argument_size_in_bytes=0,
            output_size_in_bytes=0,
            alias_size_in_bytes=0,
            temp_size_in_bytes=temp,
            generated_code_size_in_bytes=0,
        )
        return SimpleNamespace(memory_analysis=lambda: ma, cost_analysis=lambda: {})

    p = compilecheck.Program("accumulate", None, (), 0, "spec.packing.tokenBudget")
    at = compilecheck.figures(p, compiled(chip.device_limit), chip)
    over = compilecheck.figures(p, compiled(chip.device_limit + 1), chip)
    below_published = compilecheck.figures(p, compiled(chip.device_hbm - 1), chip)
    assert at["fits"] is True and over["fits"] is False and below_published["fits"] is False
    assert over["hbm_limit_bytes_per_device"] == chip.device_limit
    assert over["hbm_bytes_per_device"] == chip.device_hbm


def test_an_oversized_configuration_is_refused_with_the_field_and_a_value_that_fits(tmp_path: Path) -> None:
    """A 12-layer model 32768 wide with 131072-wide MLPs (about 180 G parameters, 361 GB of bf16 weights) on
    a v5p-8: a quarter of its weights takes most of a device's 95 GiB, and the compiler runs out of HBM.
    Exit 2, the trainer's TPU named with a size that would hold them; the JSON still carries the figures.
    (An activation-bound refusal, rows of a few hundred thousand tokens, takes the compiler tens of minutes
    here: not in the test tier.)"""
    rc = run_config("qwen3-8b-v5p")
    keys = small_keys(
        rc,
        base_emb_dim=32768,
        base_mlp_dim=131072,
        base_num_query_heads=256,
        base_num_kv_heads=8,
        base_num_decoder_layers=12,
    )
    proc = run_compilecheck(rc, keys, tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("compile: ")]
    assert lines and "spec.trainer.tpu" in lines[0] and "x its 4 devices" in lines[0], proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])["compile"]
    assert report["fits"] is False and report["programs"]["accumulate"]["fits"] is False
    assert "Traceback" not in proc.stderr


# libtpu's refusals as its compiler words them: (message, what compile_one makes of it). Kernel-memory
# failures (SparseCore spmem, VMEM) are a configuration the user can change (fewer tokens per call), an HBM
# out-of-memory keeps its own path, anything else is our bug and raises.
SPARSECORE = (
    "INTERNAL: Failed to run MLO pass pipeline.sc_ragged_gather_reduce_v2.1:4923:1: error: "
    "'memref.alloca' op "
    "E3000: CompileTimeSparseCoreAllocationFailure: current allocation offset upper bound (2656255 words) "
    "exceeds the legitimate user allocatable offset upper bound (2097151 words) in memory space spmem when "
    "allocating 2621440 words\nSee https://openxla.org/xla/errors/error_3000 for more details."
)
HBM = (
    "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
    "Used 162.5G of 95.74G hbm."
)


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        (SPARSECORE, "kernel"),
        # the 397B recipe's accumulate on tpu7x-256, as libtpu 0.0.50.1 words it (a kernel's VMEM, not HBM)
        ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:", "kernel"),
        (HBM, "oom"),
        ("E2001: CompileTimeHbmOom: Ran out of memory in memory space hbm. Used 20G of 16G hbm.", "oom"),
        ("INTERNAL: Mosaic failed to compile TPU kernel: unsupported layout", "raise"),
    ],
)
def test_the_compilers_refusals_are_classified(message: str, kind: str) -> None:
    from rljob.trainer import compilecheck

    class Refusing:
        def lower(self, *args: Any) -> Any:
            raise RuntimeError(message)

    chip = compilecheck.CHIPS["tpu7x"]
    p = compilecheck.Program("parity_logprobs", Refusing(), (), 0, "spec.packing.tokenBudget")
    if kind == "raise":
        with pytest.raises(RuntimeError):
            compilecheck.compile_one(p, chip)
        return
    fig = compilecheck.compile_one(p, chip)
    assert fig["fits"] is False
    assert ("kernel_memory" in fig) == (kind == "kernel") and fig.get("oom", False) == (kind == "oom")
    if kind == "kernel":
        assert fig["kernel_memory"]["code"] in message and fig["kernel_memory"]["kind"] in message
        line = compilecheck.refusal(p.name, fig, p, run_config("qwen3.5-397b-a17b-tpu7x"), chip)
        head = "compile: parity_logprobs does not compile for a tpu7x-256: libtpu's CompileTime"
        assert line.startswith(head), line
        assert "spec.packing.tokenBudget (now " in line and "spec.trainer.microBatchSize (now 32)" in line


@pytest.mark.parametrize(
    ("mesh", "rows", "peak_gib", "want"),
    [
        # The Qwen3.5-397B recipe's earlier layout, as compiled: 113.5 GiB of 96, 3.6 GiB of it state.
        (
            {"fsdp": 32, "expert": 2, "context": 4},
            64,
            113.5,
            "fsdp 16 x context 8 (now fsdp 32 x context 4) "
            "with spec.trainer.microBatchSize 32: each row over 2 x the devices, 1/2 of the tokens a device",
        ),
        (
            {"fsdp": 32, "expert": 2, "context": 4},
            64,
            200.0,
            "fsdp 8 x context 16 (now fsdp 32 x context 4) "
            "with spec.trainer.microBatchSize 16: each row over 4 x the devices, 1/4 of the tokens a device",
        ),
        ({"fsdp": 128, "expert": 2, "context": 1}, 256, 113.5, None),  # no context axis: not offered
        ({"fsdp": 1, "expert": 2, "context": 128}, 2, 113.5, None),  # no fsdp left to move into context
    ],
)
def test_an_activation_bound_refusal_offers_a_wider_context_axis(
    mesh: dict[str, int], rows: int, peak_gib: float, want: str | None
) -> None:
    from rljob.trainer import compilecheck

    trainer = {"mesh": mesh, "microBatchSize": rows}
    rc = run_config("qwen3.5-397b-a17b-tpu7x", fit_check=False, trainer=trainer)
    cap = compilecheck.CHIPS["tpu7x"].device_hbm
    got = compilecheck._wider_context(rc, int(peak_gib * GIB), int(3.6 * GIB), cap)
    assert got == (f", or spec.trainer.mesh {want}" if want else "")


def test_no_context_offer_when_the_state_alone_fills_the_device() -> None:
    """Splitting rows spreads the activations, never the state: with the state at or over the HBM no k fits
    (and the search for one must end)."""
    from rljob.trainer import compilecheck

    trainer = {"mesh": {"fsdp": 32, "expert": 2, "context": 4}, "microBatchSize": 64}
    rc = run_config("qwen3.5-397b-a17b-tpu7x", fit_check=False, trainer=trainer)
    cap = compilecheck.CHIPS["tpu7x"].device_hbm
    for fixed in (cap, cap + GIB):
        assert compilecheck._wider_context(rc, 2 * cap, fixed, cap) == ""


def test_the_parity_gate_scores_the_train_steps_rows_not_the_whole_mesh() -> None:
    """The gate's rows are rounded up to what the rows' batch axes divide (fsdp x expert here, 4 of the
    mesh's 8 devices; context splits the tokens), so with 4 rows per micro-batch it compiles the train
    step's own [4, budget] shape: rounding up to the mesh's 8 devices doubled the tokens per call, which on
    the 397B recipe's tpu7x-256 mesh (256 rows instead of 64) ran libtpu out of SparseCore memory."""
    from rljob.trainer import compilecheck
    from rljob.trainer.rollouts import parity_pack
    from rljob.trainer.train_step import Trainer

    rc = run_config(
        "qwen3.5-397b-a17b-tpu7x",
        fit_check=False,
        trainer={"tpu": "tpu7x-8", "mesh": {"fsdp": 2, "expert": 2, "context": 2}, "microBatchSize": 4},
    )
    policy, step = _abstract_policy(rc, small_keys(rc))
    assert int(policy.mesh.size) == 8 and policy.row_multiple() == 4
    progs = {p.name: p for p in compilecheck.programs(policy, Trainer(policy, step), step.pack_config())}
    assert progs["parity_logprobs"].args[2].shape == (4, step.budget) and step.rows == 4
    assert parity_pack(step.pack_config(), 8).rows == 8  # the old rounding, which this test would catch


def test_cache_dir_uploads_the_programs_where_the_trainer_restores_them(tmp_path: Path) -> None:
    """`--cache-dir`: the operator's compile preflight (docs/operator.md) leaves the compiled programs in the
    run's `{storage}/cache/jax-trainer/`, where the trainer pods restore JAX's compilation cache from
    (rljob.common.caches); a local directory stands in for the run's storage."""
    rc = run_config("qwen3-8b-v5p")
    store = tmp_path / "storage" / "cache"
    rc = rc.model_copy(update={"storage": rc.storage.model_copy(update={"cache": str(store)})})
    log = tmp_path / "termination-log"
    extra = ["--cache-dir", str(tmp_path / "local"), "--termination-log", str(log)]
    proc = run_compilecheck(rc, small_keys(rc), tmp_path, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["compile"]["fits"] is True
    assert not log.exists()  # nothing refused: the termination log is the pod's own
    local = sorted(p.name for p in (tmp_path / "local" / caches.JAX_TRAINER).iterdir() if p.is_file())
    uploaded = sorted(p.name for p in (store / caches.JAX_TRAINER).iterdir())
    # Every entry the compile wrote is in storage (the three programs at least), and the line says so.
    assert len(local) >= 3 and uploaded == local, (local, uploaded)
    # The last of them at exit (the sync also uploads every 120 s while a long compile runs).
    saved = f"new files saved to {store / caches.JAX_TRAINER}"
    assert any(x.startswith("cache jax-trainer: ") and x.endswith(saved) for x in proc.stderr.splitlines())
    # A trainer pod's restore gets them all (its local disk starts empty).
    got = caches.restore(caches.JAX_TRAINER, str(store / caches.JAX_TRAINER), tmp_path / "pod")
    assert (got.files, got.present) == (len(local), 0)


# A Pallas kernel whose blocks need 48 MiB of VMEM (two 12 MiB float32 blocks, each double-buffered): more
# than libtpu's default scoped VMEM on TPU7x (32 MiB), less than the 65472 KiB spec.trainer.libtpuFlags can
# allow. It compiles in a process whose libtpu started through the compile stage's own path
# (compilecheck.topology_devices of the run config) only where the run config carries the flag.
_VMEM_PROBE = """
import sys
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rljob.recipes.runconfig import RunConfig
from rljob.trainer.compilecheck import topology_devices

mesh = Mesh(topology_devices(RunConfig.load(sys.argv[1]))[:1], ("x",))
block = pl.BlockSpec((1536, 2048), lambda i: (i, 0))
def double(x):
    return pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,), in_specs=[block], out_specs=block,
    )(x)
x = jax.ShapeDtypeStruct((6144, 2048), jnp.float32, sharding=NamedSharding(mesh, P()))
try:
    jax.jit(double).lower(x).compile()
    print("compiled")
except Exception as e:
    print("refused: " + str(e).splitlines()[0])
"""


@pytest.mark.parametrize(
    ("with_flag", "verdict"), [(True, "compiled"), (False, "refused: RESOURCE_EXHAUSTED: E1001")]
)
def test_the_run_configs_libtpu_flags_reach_the_compiler(
    tmp_path: Path, with_flag: bool, verdict: str
) -> None:
    """spec.trainer.libtpuFlags is what the compile stage's libtpu runs with: the Qwen3.5-397B recipe's scoped
    VMEM flag (65472 KiB) lets a kernel that needs 48 MiB compile, and without it (the manifest removes the
    recipe's flag) libtpu refuses it as it refused the recipe's full-size train step (E1001
    CompileTimeScopedVmemOom). The parent's own LIBTPU_INIT_ARGS does not leak in: the run config's flags
    replace it."""
    trainer: dict[str, Any] = {
        "tpu": "tpu7x-8",
        "mesh": {"fsdp": 2, "expert": 2, "context": 2},
        "microBatchSize": 4,
    }
    if not with_flag:
        trainer["libtpuFlags"] = {"xla_tpu_scoped_vmem_limit_kib": None}
    rc = run_config("qwen3.5-397b-a17b-tpu7x", fit_check=False, trainer=trainer)
    assert ("xla_tpu_scoped_vmem_limit_kib" in rc.trainer.libtpu_flags) is with_flag
    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json(by_alias=True))
    env = {**os.environ, "PYTHONSAFEPATH": "1", "JAX_PLATFORMS": "cpu"}
    env["LIBTPU_INIT_ARGS"] = "" if with_flag else "--xla_tpu_scoped_vmem_limit_kib=65472"
    proc = subprocess.run(
        [sys.executable, "-c", _VMEM_PROBE, str(cfg)], capture_output=True, text=True, env=env, timeout=300
    )
    out = proc.stdout.strip().splitlines()
    assert out and out[-1].startswith(verdict), proc.stdout[-2000:] + proc.stderr[-3000:]


def test_a_flag_libtpu_does_not_know_is_refused_naming_its_key(tmp_path: Path) -> None:
    """libtpu exits at start on an unknown flag; the compile stage finds it first and names the key (exit 2,
    the termination log for the preflight), instead of dying with libtpu's message (exit 1)."""
    rc = run_config(
        "qwen3-8b-v5p",
        trainer={"libtpuFlags": {"xla_tpu_no_such_flag": 1, "xla_tpu_scoped_vmem_limit_kib": 65472}},
    )
    log = tmp_path / "termination-log"
    proc = run_compilecheck(rc, small_keys(rc), tmp_path, "--termination-log", str(log))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = "spec.trainer.libtpuFlags.xla_tpu_no_such_flag: libtpu 0.0.50.1 (the trainer image's) has no flag"
    assert log.read_text().splitlines() == [line + " xla_tpu_no_such_flag"]
    assert line in proc.stderr and "Traceback" not in proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])["compile"]
    assert report["fits"] is False and "programs" not in report


# --- service mode (rljob.trainer.compilecheck_service): the Tinker service's programs (Engine's) at small
# sizes on a v5p-8, their arguments and resident state against the adapter's arithmetic x the model count,
# and a model count that does not fit refused with spec.service.maxTrainingClients and the largest that does.


def service_config(clients: int = 4) -> RunConfig:
    rc = run_config(
        "qwen3-8b-v5p",
        fit_check=False,
        trainer={"tpu": "v5p-8"},
        service={"api": "tinker", "maxTrainingClients": min(clients, 8), "apiKeySecret": "keys"},
    )
    if clients <= 8:
        return rc
    # More clients than the samplers' adapters: the plan would refuse it (spec.sampler.maxLoras); the
    # compile stage only reads the count.
    svc = rc.spec.service
    assert svc is not None
    spec = rc.spec.model_copy(update={"service": svc.model_copy(update={"max_training_clients": clients})})
    return rc.model_copy(update={"spec": spec})


def compiled(rc: RunConfig, only: set[str]) -> tuple[dict[str, Any], list[str]]:
    from rljob.trainer import compilecheck

    return compilecheck.compile_run(rc, small_keys(rc), only=only)


def test_the_service_programs_compile_beside_every_models_state() -> None:
    """forward (the prompt-logprob program too) and optim_step compile; the state is the arithmetic of the
    adapter's shards: per model its adapter, two moments and gradient buffer in the adapter's dtype (kept
    bfloat16 by the Adam step: a float32 one would change MaxText's layer-scan carry) and a float32 mask."""
    from rljob.trainer.compilecheck_service import ServiceState

    rc = service_config(4)
    report, refusals = compiled(rc, {"forward.cross_entropy", "optim_step"})
    assert refusals == [] and report["fits"] is True
    svc = report["service"]
    adapter = svc["adapter_bytes_per_device"]
    # bfloat16 steady state: the float32 mask is twice the adapter.
    assert svc["model_bytes_per_device"] == 4 * adapter + 2 * adapter + 4
    assert svc["max_training_clients"] == 4 and svc["prompt_logprob_cache_adapters"] == 4
    progs = report["programs"]
    opt, fwd = progs["optim_step"], progs["forward.cross_entropy"]
    # optim_step's arguments are one model (adapter, moments, gradients, mask, count) and the Adam settings,
    # up to the TPU's tiled layout; the adapter and moments are donated (aliased to the outputs).
    assert svc["model_bytes_per_device"] <= opt["argument_bytes"] <= svc["model_bytes_per_device"] + 4096
    assert opt["alias_bytes"] >= 3 * adapter
    # Resident: every other model's state, the cached prompt-logprob adapters, the base and its zero adapter.
    total = svc["state_bytes_per_device"]
    assert opt["resident_bytes"] == total - svc["model_bytes_per_device"]
    base = total - adapter - 4 * svc["model_bytes_per_device"] - 4 * adapter  # zero adapter: the same size
    assert fwd["resident_bytes"] == total - base - adapter
    assert fwd["argument_bytes"] >= base + adapter
    for fig in (opt, fwd):
        parts = ("argument_bytes", "output_bytes", "temp_bytes", "code_bytes", "resident_bytes")
        assert fig["peak_bytes_per_device"] == sum(fig[k] for k in parts) - fig["alias_bytes"]
    state = ServiceState(4, base, adapter, adapter, 2 * adapter, 4, 4)
    assert state.total == total and state.at(16).total == total + 12 * state.model + 12 * adapter


@pytest.mark.slow
def test_forward_backward_compiles_for_every_loss_the_service_accepts() -> None:
    from rljob.trainer.tinker.engine import LOSS_FNS

    rc = service_config(2)
    names = {f"forward_backward.{k}" for k in LOSS_FNS}
    report, refusals = compiled(rc, names)
    assert refusals == [] and set(report["programs"]) == names
    svc = report["service"]
    for name in names:
        fig = report["programs"][name]
        # The gradient buffer is donated and returned: aliased.
        assert fig["alias_bytes"] >= svc["adapter_bytes_per_device"]
        assert fig["flops"] > 0 and fig["roofline_seconds"] > 0


def test_a_model_count_that_does_not_fit_is_refused_with_the_largest_that_does() -> None:
    """Thousands of training clients' state (each a few MiB per device here) overflow a v5p device's 95
    GiB beside optim_step: refused naming spec.service.maxTrainingClients with the largest count whose
    state fits, which the arithmetic confirms (one more does not)."""
    rc = service_config(40000)
    report, refusals = compiled(rc, {"optim_step"})
    assert report["fits"] is False and len(refusals) == 1, refusals
    line = refusals[0]
    assert line.startswith("spec.service.maxTrainingClients: 40000 training clients'"), line
    fit = int(line.split("at most ")[1].split()[0])
    fig, svc = report["programs"]["optim_step"], report["service"]
    # The program's own bytes: temporaries, code, its arguments (this model's state counted twice).
    own = fig["peak_bytes_per_device"] - svc["state_bytes_per_device"]
    per = svc["model_bytes_per_device"] + svc["adapter_bytes_per_device"]
    cap = fig["hbm_limit_bytes_per_device"]  # what the allocator offers, not the published 95 GiB
    at = svc["state_bytes_per_device"] - (40000 - fit) * per
    assert 1000 < fit < 40000 and own + at <= cap < own + at + per, (fit, own, at)


@pytest.mark.parametrize(
    ("peak_gib", "models", "want"),
    [
        (120, 8, "spec.service.maxTrainingClients: 8 training clients'"),  # the models' state: fewer fit
        (90, 8, None),  # fits: no refusal is asked for, but the line is still well formed (the loop's)
        (92, 8, None),  # 0.15 GiB under v5p's usable 92.15 GiB: still 8 (the count's intercept is exact)
        (200, 2, "compile: optim_step needs 200.0 GiB"),  # not even one model fits: a larger slice
    ],
)
def test_the_refusal_names_the_model_count_only_where_fewer_models_fit(
    peak_gib: int, models: int, want: str | None
) -> None:
    from rljob.trainer import compilecheck
    from rljob.trainer.compilecheck_service import ServiceState, largest_count, service_refusal

    rc = service_config(models)
    chip = compilecheck.CHIPS["v5p"]
    # Models of 10 GiB each beside a 20 GiB base.
    state = ServiceState(models, 20 * GIB, 0, 2 * GIB, 2 * GIB, 0, max(2, models))
    peak = peak_gib * GIB
    p = compilecheck.Program("optim_step", None, (), state.total - state.model, "spec.trainer.tpu")
    line = service_refusal("optim_step", {"fits": False, "peak_bytes_per_device": peak}, p, rc, chip, state)
    fit = largest_count(state, peak, chip.device_limit)
    if want is None:
        assert fit >= models
        return
    assert line.startswith(want), line
    if models == 8:
        # 10 GiB per model + 2 GiB per cached adapter: each model less frees 12 GiB.
        assert fit == 8 - -(-(peak - chip.device_limit) // (12 * GIB)) and f"at most {fit} fit" in line
    else:
        assert fit == 0 and "spec.trainer.tpu" in line
