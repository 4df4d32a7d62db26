"""The chip tier's run config (examples/qwen3-0.6b-v5e-1.yaml: Qwen3-0.6B on one v5e chip) trained on the
chip as the trainer pod trains it, beside what the compile stage predicted for it on a CPU machine.

``hack/tpu/precompile.py`` runs first, on the CPU machine: it resolves the example, points its cache storage
at ``.tpu-cache/store`` and runs the compile preflight's own command there (``python -m
rljob.trainer.compilecheck --cache-dir``), which writes the trainer's programs to JAX's persistent cache under
``{storage}/cache/jax-trainer/`` and its report (peak HBM per program, roofline) to
``.tpu-cache/compile.json``.
This test then does what ``rljob-trainer`` does (rljob.trainer.loop): restores that cache
(rljob.common.caches.jax_compilation_cache), builds the policy and the step from the run config
(``model_setup``), and steps. It asserts:
- zero-compile start: the step's programs (accumulate, apply, the parity gate's scoring) are persistent-cache
  hits, none compiled on the chip (the cache's lookups are read from JAX's own log lines), and what the chip
  compiles besides them (initialisers, RNG, layout copies: the glue) takes seconds in all (JAX's backend
  compile events). The first v5e run (2026-12-06) missed all three (compile options, and the parity
  program's HLO: docs/drill.md, "Starting without compiling"); since the fixes, a v5e run (2026-12-07) hit
  them;
- the compile stage's predicted peak HBM is within PREDICTION_BAND of the chip's peak
  (rljob.trainer.chip_memory.step_peak: the bytes held, measured, plus the largest program's scratch as the
  chip's compiler assigned it; the allocator's own peak leaves temporaries out), the compile stage's
  temporaries are the chip compiler's, and its roofline is compared with the measured step time (a figure,
  not a bound).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.chip_models import CACHE_LOOKUP, PREDICTION_BAND, lengths_for, program_name, rollouts
from fixtures.jax_compiles import BACKEND_COMPILE

CACHE = Path(".tpu-cache")
STEPS = 5
# The step's programs, as JAX names them: what the preflight compiles and the trainer must load, not compile.
STEP_PROGRAMS = {"jit__accumulate", "jit__apply", "jit_parity_logprobs"}
# What the chip may still compile at start: the glue around the step (RNG, LoRA's factor draws, layout
# copies, dtype casts), each a program of one or a few ops. Their backend seconds, summed, stay under this:
# seconds, where one of the step's programs takes a compile of the whole model. Measured on a v5e
# (2026-12-07): 7.3 s, 4.6 s of it LoRA's draws (rljob.trainer.lora: one small program per factor shape).
GLUE_SECONDS = 12.0
# The test's random base weights (no checkpoint on a machine without network): MaxText's whole random
# initialization in one program, which a trainer pod restoring a checkpoint does not run (build_model keeps
# only the RNG state of it). Recorded, not counted as glue.
RANDOM_INIT = "jit_init"


_PART = re.compile(r"get_cache_key hash of serialized (.+): ([0-9a-f]+)")


class _Lookups(logging.Handler):
    """The persistent cache's lookups, and the hash of each part of each program's key (jax/_src/cache_key.py
    logs them at DEBUG before the lookup), to compare with the compile stage's (hack/tpu/precompile.py keeps
    its log)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str]] = []
        self.parts: dict[str, dict[str, str]] = {}
        self._pending: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        p = _PART.search(msg)
        if p:
            self._pending[p[1]] = p[2][:16]
            return
        m = CACHE_LOOKUP.search(msg)
        if m:
            self.seen.append(("hit", m[3]) if m[3] else (m[1].lower(), m[2]))
            self.parts.setdefault(m[3] or m[2], dict(self._pending))
            self._pending = {}


@pytest.fixture(scope="module")
def trained(chip: Any, record: Any) -> dict[str, Any]:
    """The example trained on the chip from the preflight's cache, once for the module's tests."""
    if not (CACHE / "run.json").exists():
        pytest.skip("no .tpu-cache/run.json: run hack/tpu/precompile.py on a CPU machine first")
    import jax
    from rljob.common import caches
    from rljob.recipes.runconfig import RunConfig
    from rljob.trainer import chip_memory
    from rljob.trainer.main import model_setup, settle_xla_flags
    from rljob.trainer.model import Policy
    from rljob.trainer.packing import pack_rollouts
    from rljob.trainer.train_step import Trainer, stack_micro_batches

    rc = RunConfig.load(str(CACHE / "run.json"))
    from rljob.recipes.generations import BY_ACCELERATOR, BY_DEVICE_KIND

    planned = BY_ACCELERATOR[rc.trainer.tpu.accelerator]
    if BY_DEVICE_KIND.get(chip.device_kind) is not planned:  # its programs are that generation's
        pytest.skip(f"the example is planned for {planned.prefix}; this chip is a {chip.device_kind}")
    settle_xla_flags(rc.trainer.maxtext)  # as rljob-trainer does before it compiles anything
    predicted = json.loads((CACHE / "compile.json").read_text())["compile"]
    lookups = _Lookups()
    for name in ("jax._src.compiler", "jax._src.compilation_cache", "jax._src.cache_key"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.DEBUG)
        lg.addHandler(lookups)
    # Seconds in the backend's compile-or-load of each program (a cache hit's load included), by name.
    backend: dict[str, float] = {}

    def on_duration(event: str, duration_secs: float, **kw: str | int) -> None:
        if event == BACKEND_COMPILE:
            # The event names a program ``jit(_accumulate)``; the cache's lookup ``jit__accumulate``.
            name = program_name(str(kw.get("fun_name", "?")))
            backend[name] = backend.get(name, 0.0) + duration_secs

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    sync = caches.jax_compilation_cache(
        caches.JAX_TRAINER, rc.storage.cache, Path(tempfile.mkdtemp()), jax.config.update, rc.trainer.maxtext
    )
    spec, step_cfg, _ = model_setup(rc, "config", STEPS + 1)
    # Random base weights, as the compile stage's shapes (no hub or storage on a TPU machine without network;
    # a program's cache key does not depend on the weights' values).
    policy = Policy(dataclasses.replace(spec, checkpoint=None))
    trainer = Trainer(policy, step_cfg)
    # As rljob.trainer.loop does before its first step: the step loaded and the base in its layouts, so that
    # the parity gate's program reads the base as the compile stage compiled it, at whichever step the gate
    # comes (before this, the 2026-12-07 run compiled the parity program again for a gate after a step).
    trainer.lay_out_base()
    scored = policy.scoring_program()

    def batch(seed: int) -> list[Any]:
        rs = rollouts(policy.vocab_size, lengths_for(step_cfg.budget, step_cfg.rows, seed=seed), seed=seed)
        packed = pack_rollouts(rs, step_cfg.pack_config())
        for mb in packed:
            args = [jax.numpy.asarray(a) for a in (mb.tokens, mb.positions, mb.segment_ids)]
            mb.fields["old_logprobs"] = np.asarray(scored(policy.base, policy.lora0, *args), np.float32)
        return packed

    before_step = len(lookups.seen)
    # The first batch scored before the first step (the gate's usual place), the others after steps (a
    # gate put off: a resumed run's first batch sampled by the previous adapter).
    batches = [batch(0)]
    state = trainer.init_state()
    state, _ = trainer.train_on_packed(state, batches[0])
    first = lookups.seen[before_step:]
    batches += [batch(i) for i in range(1, STEPS + 2)]
    times = []
    for i in range(STEPS):
        packed = batches[1 + i]
        t0 = time.perf_counter()
        state, _ = trainer.train_on_packed(state, packed)
        jax.block_until_ready(state.lora)  # type: ignore[no-untyped-call]
        times.append(time.perf_counter() - t0)
    sync.close()
    step_s = statistics.median(times)
    progs = predicted["programs"]
    misses = sorted({n for kind, n in lookups.seen if kind == "miss"})
    hits = sorted({n for kind, n in lookups.seen if kind == "hit"})
    misses_n = len([s for s in lookups.seen if s[0] == "miss"])
    # The step's programs as the chip holds them (loaded or compiled above: these lookups come after the
    # count), with a micro-batch and an accumulator live as during the step.
    acc = trainer.zero_acc(state.lora)
    call = trainer.device_batch(stack_micro_batches(batches[STEPS + 1], step_cfg.micro_batches)[0])
    on_chip = {
        "accumulate": trainer.compiled_accumulate(acc, state.lora, call).memory_analysis(),
        "apply": trainer.apply.lower(state, acc).compile().memory_analysis(),
    }
    mem = chip_memory.step_peak(chip, {k: chip_memory.scratch_bytes(v) for k, v in on_chip.items()})
    measured = int(mem["peak_bytes"])
    peak = max(int(p["peak_bytes_per_device"]) for p in progs.values())
    ctx = {"run": rc.name, "tpu": rc.trainer.tpu.type_name, "rows": step_cfg.rows, "budget": step_cfg.budget}

    # What the chip compiled: every program that missed at least once (a name can also hit: the chip's own
    # entry, written by its first compile, for a second call of the same shapes), and the seconds of its
    # backend compiles and loads; the step's programs and the test's random initialization apart.
    compiled_here = {
        n: round(backend.get(n, 0.0), 3) for n in misses if n not in STEP_PROGRAMS and n != RANDOM_INIT
    }
    step_loads = {n: backend.get(n) for n in STEP_PROGRAMS}
    record(
        "example_chip",
        "cache_misses",
        misses_n,
        **ctx,
        misses=misses,
        hits=hits,
        first_step=first,
        key_parts=lookups.parts,
        compiled_on_chip_seconds=compiled_here,
        random_init_seconds=backend.get(RANDOM_INIT),
        step_program_load_seconds=step_loads,
        backend_seconds={k: round(v, 3) for k, v in backend.items()},
    )
    record("example_chip", "step_seconds_median", step_s, **ctx, all=times)
    record(
        "example_chip",
        "peak_hbm_measured_bytes",
        measured,
        **ctx,
        **{k: v for k, v in mem.items() if k != "peak_bytes"},
    )
    temps = {k: (int(v.temp_size_in_bytes), int(progs[k]["temp_bytes"])) for k, v in on_chip.items()}
    record("example_chip", "temp_bytes_chip_vs_compile_stage", temps, **ctx)
    record(
        "example_chip",
        "peak_hbm_predicted_bytes",
        peak,
        **ctx,
        per_program={k: v["peak_bytes_per_device"] for k, v in progs.items()},
    )
    record("example_chip", "predicted_over_measured_peak", peak / max(measured, 1), **ctx)
    record(
        "example_chip",
        "roofline_over_measured_seconds",
        float(progs["accumulate"]["roofline_seconds"]) / step_s,
        **ctx,
    )
    return {
        "hits": hits,
        "misses": misses,
        "seen": lookups.seen,
        "compiled_here": compiled_here,
        "step_loads": step_loads,
        "predicted": peak,
        "measured": measured,
        "temps": temps,
    }


def test_the_step_compiles_nothing_on_the_chip(trained: dict[str, Any]) -> None:
    """The step's programs are loaded from the preflight's cache (hits, never a miss), and what the chip
    compiles besides them is glue that takes seconds, not the minutes the step's programs take."""
    assert set(trained["hits"]) >= STEP_PROGRAMS, trained["seen"]
    assert not STEP_PROGRAMS & set(trained["misses"]), trained["seen"]
    # The events name the step's programs as the lookups do (else the bound below would hold vacuously).
    assert None not in trained["step_loads"].values(), trained["step_loads"]
    assert sum(trained["compiled_here"].values()) < GLUE_SECONDS, trained["compiled_here"]


def test_the_compile_stage_predicts_the_peak_hbm(trained: dict[str, Any]) -> None:
    lo, hi = PREDICTION_BAND
    assert lo <= trained["predicted"] / trained["measured"] <= hi, trained


def test_the_compile_stage_assigns_the_chips_temporaries(trained: dict[str, Any]) -> None:
    """Same program, same compile options, same libtpu: the compile stage's temporaries are the chip's."""
    for name, (chip_temp, stage_temp) in trained["temps"].items():
        assert abs(chip_temp - stage_temp) <= 0.02 * max(stage_temp, 1), (name, chip_temp, stage_temp)
