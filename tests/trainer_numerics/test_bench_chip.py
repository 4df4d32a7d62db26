"""The parts of bench/train_step_chip.py that run without a TPU: its MaxText overrides for more rljob arms,
the line it reports for a failed arm, the CPU bench's arm lines, and tunix's padded rows sized for Splash's
query blocks (a v5e refused rows of 3,968 tokens: ``q_block_size=512 should divide q_seq_len=3968``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        ("sa_block_q=1024,sa_block_kv=1024", {"sa_block_q": 1024, "sa_block_kv": 1024}),
        ("remat_policy=minimal", {"remat_policy": "minimal"}),
        ("scan_layers=false, dropout_rate=0.0", {"scan_layers": False, "dropout_rate": 0.0}),
        ("", {}),
    ],
)
def test_rljob_keys_read_as_maxtext_values(spec: str, want: dict[str, object]) -> None:
    assert _load("train_step_chip").overrides(spec) == want


def test_the_rljob_arm_runs_the_recipes_splash_keys() -> None:
    """The rljob arm measures what rljob ships for this model on a v5e: the recipe's Splash keys (the
    fused backward kernel and blocks of 1,024 the chip chose), read from the recipe, not copied."""
    from rljob.recipes import recipe_catalog

    b = _load("train_step_chip")
    splash = b.recipe_splash()
    trainer = recipe_catalog.load(b.RECIPE).spec.trainer
    assert trainer is not None and trainer.maxtext is not None
    assert splash == {k: v for k, v in trainer.maxtext.items() if k.startswith("sa_")}
    assert splash["sa_use_fused_bwd_kernel"] is True
    assert {v for k, v in splash.items() if k.startswith("sa_block")} == {1024}


@pytest.mark.parametrize("spec", ["sa_block_q", "=3", "a=1,b"])
def test_a_key_without_a_value_is_refused(spec: str) -> None:
    with pytest.raises(SystemExit, match="not KEY=VALUE"):
        _load("train_step_chip").overrides(spec)


def test_a_failed_arm_is_reported_by_its_error_not_by_jaxs_notice() -> None:
    stderr = (
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "ValueError: q_block_size=512 should divide q_seq_len=3968.\n"
        "--------------------\n"
        "For simplicity, JAX has removed its internal frames from the traceback of the following exception. "
        "Set JAX_TRACEBACK_FILTERING=off to include these.\n"
    )
    b = _load("train_step_chip")
    assert b.failure_line(stderr) == "ValueError: q_block_size=512 should divide q_seq_len=3968."
    assert b.failure_line("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: 1G\n").startswith(
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED"
    )
    assert b.failure_line("killed\n") == "killed"
    assert b.failure_line("") == "?"


def test_an_arms_line_carries_its_figures_not_its_callables() -> None:
    """The CPU bench's output lines are JSON: an arm's callables (its step, the rljob arm's packing timer)
    stay out of them, every figure goes in (json.dumps refused the timer once: `make bench` failed)."""
    cpu = _load("train_step_vs_tunix")
    arm = {"step": lambda: (1.0, 0.0), "pack_seconds": lambda: 0.1, "seconds": 2.0, "temp_bytes": 5.0}
    arm |= {"rows": 4.0, "setup_peak_bytes": 0, "adapter": "x"}
    fields = cpu.arm_fields(arm)
    assert fields == {"rows": 4.0, "setup_peak_bytes": 0, "adapter": "x"}
    json.dumps(fields)


@pytest.mark.parametrize("scale", [4, 7, 16])
def test_tunix_padded_rows_fit_splash_blocks(scale: int) -> None:
    cpu = _load("train_step_vs_tunix")
    lengths = cpu.rollout_lengths(8, scale, 0)
    rollouts = cpu.make_rollouts(lengths, 1000, 4, 0)
    (example,) = cpu.tunix_examples(rollouts, False, 0, align=128, row_align=512)
    pl, cl = example.prompt_ids.shape[1], example.completion_ids.shape[1]
    assert pl % 128 == 0 and cl % 128 == 0 and (pl + cl) % 512 == 0
    # no more than one 512-token block over what the longest prompt and completion need
    need = -(-max(p for p, _ in lengths) // 128) * 128 + -(-max(c for _, c in lengths) // 128) * 128
    assert need <= pl + cl < need + 512
    assert int(np.asarray(example.completion_mask).sum()) == sum(c for _, c in lengths)


def test_the_profile_summary_reads_a_traced_step(tmp_path: Path) -> None:
    """The on-chip bench's --profile summary, on a CPU trace of a program of two matmuls run twice: the
    op kinds it ranks are the traced program's, each counted per run, the program's seconds are there,
    and a step that waited on the host is told apart from one that did not (busy fraction under 0.9)."""
    import time

    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
    a = jnp.ones((384, 384), jnp.float32)
    f(a).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        time.sleep(0.2)  # the host's share of a step: the device idles
        f(a).block_until_ready()
        wall = time.perf_counter() - t0
    xplane = next(tmp_path.glob("**/*.xplane.pb"))
    s = _load("train_step_chip").profile_summary(xplane, wall, top=50)
    assert s["top_ops"], s
    assert set(s["modules"]) == {"jit__lambda"}
    assert all(o["count"] % 2 == 0 for o in s["top_ops"]), s["top_ops"]  # each kind once a run, or more
    assert 0 < s["device_busy_seconds"] <= s["op_self_seconds"] + 1e-9
    assert s["device_busy_fraction"] < 0.9, s  # the 0.2 s sleep is not device time
    assert abs(sum(o["seconds"] for o in s["top_ops"]) - s["op_self_seconds"]) < 1e-5


def test_nested_ops_count_their_own_time_once() -> None:
    """A TPU's ``XLA Ops`` line nests a loop's body inside its ``while``: the loop's own time is its span
    less its body's, and every kind is named without the HLO text the TPU gives it."""
    b = _load("train_step_chip")
    events = [
        (0.0, 100.0, "%while.335 = (s32[]{:T(128)}, bf16[1024,28,8]) while(...)"),
        (10.0, 30.0, "%splash_mha_fwd_segmented_residuals.15 = (bf16[16,5120,128]) custom-call(...)"),
        (45.0, 20.0, "%fusion.1077 = f32[2048] fusion(...)"),
        (50.0, 5.0, "%copy.3 = f32[2048] copy(...)"),  # inside the fusion's span: nested twice
        (120.0, 10.0, "%fusion.12 = f32[8] fusion(...)"),
    ]
    got = {k: (round(v[0] * 1e9, 6), v[1]) for k, v in b._self_seconds(events).items()}
    assert got == {
        "while": (50.0, 1),
        "splash_mha_fwd_segmented_residuals": (30.0, 1),
        "fusion": (25.0, 2),
        "copy": (5.0, 1),
    }
    assert b.op_kind("ynn_fusion.5") == "ynn_fusion"
    assert b.op_kind("%dynamic-slice_bitcast_fusion.11.v_ref") == "dynamic-slice_bitcast_fusion.11.v_ref"


@pytest.mark.parametrize(
    ("spans", "want"),
    [([], 0.0), ([(0, 10)], 10e-9), ([(0, 10), (5, 20)], 20e-9), ([(10, 20), (0, 5), (12, 15)], 15e-9)],
)
def test_busy_time_is_the_union_of_overlapping_ops(spans: list[tuple[float, float]], want: float) -> None:
    assert abs(_load("train_step_chip")._union_seconds(spans) - want) < 1e-15


@pytest.mark.parametrize("arms", ["none", "rljob,tunix", "tunix_padded,RLJOB"])
def test_an_unknown_arm_is_refused_not_run_as_another(arms: str, capsys: pytest.CaptureFixture[str]) -> None:
    b = _load("train_step_chip")
    argv = sys.argv
    sys.argv = ["train_step_chip.py", f"--arms={arms}", "--cpu-dry-run"]
    try:
        with pytest.raises(SystemExit) as e:
            b.main()
    finally:
        sys.argv = argv
    assert e.value.code == 2
    assert "--arms: no arm" in capsys.readouterr().err
