"""Splash attention's backward on the chip, compiled (not interpreted), at a full-size layer's shape
(Qwen3-0.6B: 16 query heads of 128, one row of 4,096 tokens packed from a long-tailed mix) and the blocks
recipes/catalog/qwen3-0.6b-v5e.yaml sets (1,024): the fused backward kernel (``sa_use_fused_bwd_kernel``,
the recipe's) and the separate dq and dkv kernels (MaxText's default) give the same output and dq, dk, dv,
and both are within a bound of dense masked attention computed at the highest matmul precision. Inputs are
float32; the kernels' matmuls take the chip's default precision (bfloat16 passes), hence the bounds; the
same comparison at float32 under Pallas's interpreter is tests/trainer_numerics/test_splash_fused_backward.py.
Figures: the worst relative difference per output."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.splash_backward import dense, grads, inputs, splash, worst

HEADS, SEQ, DIM = 16, 4096, 128
LENGTHS = [1800, 900, 620, 400, 250]  # 3,970 tokens of five sequences, then padding
# largest |difference| over the largest |reference|. A v5e (2026-12-07, blocks 512 and 1,024): the fused
# and the separate kernels gave bit-equal output, dq, dk and dv (0.0); either against dense attention at the
# highest precision 3.2e-3 (output), 3.3e-3 (dq), 5.5e-3 (dk), 2.6e-3 (dv): the chip's bf16 matmul passes.
BOUND_KERNELS = 1e-3
BOUND_REFERENCE = 1.5e-2


@pytest.mark.parametrize("block", [512, 1024])
def test_the_fused_backward_on_the_chip(chip: Any, record: Any, block: int) -> None:
    q, k, v, do, seg = inputs(HEADS, SEQ, DIM, LENGTHS)
    ref = grads(dense, q, k, v, do, seg)
    fused = grads(splash(True, block, HEADS, SEQ, interpret=False), q, k, v, do, seg)
    separate = grads(splash(False, block, HEADS, SEQ, interpret=False), q, k, v, do, seg)
    figures = {
        "fused_vs_separate": worst(fused, separate),
        "fused_vs_dense": worst(fused, ref),
        "separate_vs_dense": worst(separate, ref),
    }
    for name, value in figures.items():
        record("splash_backward", name, value, block=block, heads=HEADS, seq=SEQ, lengths=LENGTHS)
    assert max(figures["fused_vs_separate"].values()) <= BOUND_KERNELS, figures
    assert max(figures["fused_vs_dense"].values()) <= BOUND_REFERENCE, figures
    assert max(figures["separate_vs_dense"].values()) <= BOUND_REFERENCE, figures
