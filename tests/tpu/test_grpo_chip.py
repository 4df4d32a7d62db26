"""A GRPO step of full-size models of three families on the chip, measured, beside what the compile stage
predicts for the same programs.

Per family (fixtures.chip_models.FAMILIES: qwen3-0.6b, gemma3-4b, and Llama 3.1-8B's full width at 8 of its
32 layers so that it fits one 16 GiB chip): bf16 weights with a realistic logit scale, Splash attention,
LoRA rank 16 on every projection the family supports, rows of 4,096 tokens packed from a long-tailed
rollout mix. The test asserts:
- step 0: the parity gate's scoring program (``Policy.scoring_program``) and the train step read the same
  log-probs: old log-probs taken from the scoring program give an importance ratio of 1 in the step;
- the step trains: finite loss, the adapter moves, a second step's ratio departs from 1;
- the compile stage (rljob.trainer.compilecheck: the same ``programs``, ``compile_program`` and
  ``figures`` the preflight and ``rljob drill --compile`` run, here compiled by the chip's libtpu)
  predicts the chip's peak HBM within a stated band; the chip's peak is
  rljob.trainer.chip_memory.step_peak (the bytes held, measured, plus the largest program's scratch as the
  compiler assigned it: the allocator's own peak leaves temporaries out; a peak it reached while the test
  built, scaled and laid out the weights is the setup's, recorded per stage, not the step's);
- setting up never peaks above the step's peak (a job whose step fits also starts).
Figures: step seconds (median of 5 after warm-up), useful tokens/s, MFU (MaxText's model FLOPs per token),
peak HBM measured and predicted. Run each family in a process of its own (hack/tpu/run.sh does): the
chip's peak counter only grows, so a process that ran something larger before would hide this step's peak.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import pytest
from fixtures.chip_models import (
    FAMILIES,
    PREDICTION_BAND,
    chip_figures,
    fullsize_keys,
    lengths_for,
    realistic_head,
    rollouts,
)

BUDGET = 4096
ROWS = 2
STEPS = 5


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grpo_step_at_full_size(chip: Any, record: Any, family: str) -> None:
    import jax
    import jax.numpy as jnp
    from rljob.recipes import lora_targets
    from rljob.trainer import chip_memory, compilecheck
    from rljob.trainer.model import ModelSpec, Policy
    from rljob.trainer.packing import PackConfig, pack_rollouts
    from rljob.trainer.train_step import StepConfig, Trainer

    model = FAMILIES[family]
    keys = fullsize_keys(model["model_name"], budget=BUDGET, depth=model["depth"])
    targets = tuple(
        t for t in lora_targets.ATTENTION + lora_targets.MLP if t in lora_targets.SUPPORTED[family]
    )
    policy = Policy(ModelSpec(maxtext=keys, lora_rank=16, lora_alpha=32.0, lora_targets=targets))
    # The allocator's peak after each stage before the first step (its counter only grows): where a peak
    # above the step's comes from.
    stages: dict[str, dict[str, int]] = {}

    def stage(name: str) -> None:
        stats = chip_memory.allocator_stats(chip)
        stages[name] = {k: stats.get(k, 0) for k in ("bytes_in_use", "peak_bytes_in_use")}

    stage("built")
    cfg = StepConfig(
        budget=BUDGET,
        rows=ROWS,
        micro_batches=1,
        learning_rate=1e-4,
        grad_dtype="float32",
        mu_dtype="float32",
    )
    trainer = Trainer(policy, cfg)
    pack = cfg.pack_config()

    def batch(seed: int) -> list[Any]:
        rs = rollouts(policy.vocab_size, lengths_for(BUDGET, ROWS, seed=seed), seed=seed)
        for r in rs:
            r.per_token["old_logprobs"] = np.zeros(np.size(r.completion_ids), np.float32)
        return pack_rollouts(rs, PackConfig(budget=BUDGET, rows=ROWS))

    packed = batch(0)
    factor = realistic_head(
        policy, {k: getattr(packed[0], k) for k in ("tokens", "positions", "segment_ids")}
    )
    stage("head_scaled")

    # What the compile stage predicts for these programs, from the programs the chip runs: the step compiled
    # and the base laid out as rljob.trainer.loop does first (Trainer.lay_out_base), the parity gate's and
    # the update's programs compiled for the layouts it chose (compilecheck.compile_program, as the compile
    # stage compiles them), each program compiled once (Gemma 3 4B's step takes a minute to compile).
    chip_fig = chip_figures()
    progs = {p.name: p for p in compilecheck.programs(policy, trainer, pack)}  # the base as shapes
    t0 = time.monotonic()
    compiled = {"accumulate": trainer.lay_out_base()}
    seconds = {"accumulate": time.monotonic() - t0}
    stage("laid_out")
    layouts = {"accumulate": compiled["accumulate"].input_formats[0][2]}
    for name in ("parity_logprobs", "apply"):
        t0 = time.monotonic()
        compiled[name] = compilecheck.compile_program(progs[name], layouts)
        seconds[name] = time.monotonic() - t0
    predicted = {k: compilecheck.figures(progs[k], c, chip_fig, seconds[k]) for k, c in compiled.items()}

    # Step 0: old log-probs from the parity gate's scoring program (Policy.scoring_program, compiled above).
    scored = compiled["parity_logprobs"]

    def score(mbs: list[Any], lora: Any) -> None:
        for mb in mbs:
            args = (jnp.asarray(a) for a in (mb.tokens, mb.positions, mb.segment_ids))
            mb.fields["old_logprobs"] = np.asarray(scored(policy.base, lora, *args), np.float32)

    score(packed, policy.lora0)
    state = trainer.init_state()
    stage("scored")
    lora_before = jax.tree.map(np.asarray, state.lora)
    state, m0 = trainer.train_on_packed(state, packed)
    record("grpo_step", "step0_ratio_minus_1", m0["ratio"] - 1.0, family=family)
    assert abs(m0["ratio"] - 1.0) < 2e-3, m0
    assert np.isfinite(m0["loss"]) and m0["update_skipped"] == 0, m0
    moved = max(
        float(np.abs(np.asarray(a) - b).max())
        for a, b in zip(jax.tree.leaves(state.lora), jax.tree.leaves(lora_before), strict=True)
    )
    assert moved > 0.0

    # Timed steps, each batch scored by the step-0 adapter (a sampler one version behind): the ratio
    # departs from 1 as the adapter moves.
    times, ratios, useful = [], [], []
    for i in range(STEPS):
        packed_i = batch(1 + i)
        score(packed_i, jax.tree.map(jnp.asarray, lora_before))
        t0 = time.perf_counter()
        state, m = trainer.train_on_packed(state, packed_i)
        jax.block_until_ready(state.lora)  # type: ignore[no-untyped-call]
        times.append(time.perf_counter() - t0)
        ratios.append(m["ratio"])
        useful.append(sum(int((mb.segment_ids > 0).sum()) for mb in packed_i))
    # A step is as many accumulate calls as its rollouts pack into (1 or 2 here): tokens over time, summed.
    step_s = statistics.median(times)
    tokens_per_s = sum(useful) / sum(times)
    flops_per_token = compilecheck.model_flops(policy.cfg, 1.0, backward=True)
    scratch = {k: chip_memory.figures_scratch(f) for k, f in predicted.items()}
    mem = chip_memory.step_peak(chip, scratch, stages["scored"]["peak_bytes_in_use"])
    measured_peak = int(mem["peak_bytes"])
    acc = predicted["accumulate"]
    predicted_peak = max(int(f.get("peak_bytes_per_device", 0)) for f in predicted.values())
    ctx = {
        "family": family,
        "model": model["model_name"],
        "layers": int(policy.cfg.num_decoder_layers),
        "rows": ROWS,
        "budget": BUDGET,
        "head_scale": factor,
    }
    record("grpo_step", "step_seconds_median", step_s, **ctx, steps=STEPS, all=times, useful_tokens=useful)
    record("grpo_step", "useful_tokens_per_s", tokens_per_s, **ctx)
    record(
        "grpo_step",
        "mfu",
        tokens_per_s * flops_per_token / chip_fig.peak_bf16_flops,
        **ctx,
        model_flops_per_token=flops_per_token,
    )
    parts = {k: v for k, v in mem.items() if k != "peak_bytes"}
    record("grpo_step", "peak_hbm_measured_bytes", measured_peak, **ctx, **parts, stages=stages)
    record(
        "grpo_step",
        "peak_hbm_predicted_bytes",
        predicted_peak,
        **ctx,
        per_program={k: v.get("peak_bytes_per_device") for k, v in predicted.items()},
    )
    record("grpo_step", "predicted_over_measured_peak", predicted_peak / max(measured_peak, 1), **ctx)
    record(
        "grpo_step", "roofline_over_measured_seconds", float(acc.get("roofline_seconds", 0.0)) / step_s, **ctx
    )
    assert all(np.isfinite(ratios)) and max(abs(r - 1.0) for r in ratios) > 1e-4, ratios
    assert measured_peak > 0
    # Setting up (building the weights, scaling the head, laying the base out, the gate's scoring) never
    # peaks above the step: a job whose step fits starts (on a v5e, 2026-12-07: Llama's setup 6.70 GB, its
    # step 8.49 GB; Gemma 3 4B's 10.53 and 13.04 GB)
    assert stages["scored"]["peak_bytes_in_use"] <= measured_peak, (stages, measured_peak)
    lo, hi = PREDICTION_BAND
    assert lo <= predicted_peak / measured_peak <= hi, (predicted_peak, measured_peak)
