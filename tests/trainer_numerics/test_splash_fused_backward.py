"""Splash attention's fused backward kernel (``sa_use_fused_bwd_kernel: true``, what the v5e recipe sets)
gives the gradients of masked attention over packed rows: dq, dk and dv equal a dense reference's and the
separate dq and dkv kernels' (MaxText's default), with segment ids and a causal mask, at block sizes scaled
down from recipes/catalog/qwen3-0.6b-v5e.yaml's.

The kernels run under Pallas's interpreter on the CPU: this checks the kernel's algorithm (its blocks, the
mask's skipping, the fused accumulation of dq), not the TPU's lowering of it, which
tests/tpu/test_splash_backward_chip.py checks on the chip at full size. A broken variant (segment ids dropped
from the kernel) must differ, so the comparison can fail.
"""

from __future__ import annotations

import pytest
from fixtures.splash_backward import dense, grads, inputs, splash, worst

HEADS, SEQ, DIM = 2, 512, 128
LENGTHS = [200, 130, 150]  # three packed sequences, then 32 tokens of padding
BOUND = 2e-4  # float32 on the CPU: the kernels' and the reference's sums differ only in order


@pytest.mark.parametrize("block", [128, 256])
def test_the_fused_backward_equals_the_reference_and_the_separate_kernels(block: int) -> None:
    q, k, v, do, seg = inputs(HEADS, SEQ, DIM, LENGTHS)
    ref = grads(dense, q, k, v, do, seg)
    fused = grads(splash(True, block, HEADS, SEQ, interpret=True), q, k, v, do, seg)
    separate = grads(splash(False, block, HEADS, SEQ, interpret=True), q, k, v, do, seg)
    assert max(worst(fused, ref).values()) <= BOUND, worst(fused, ref)
    assert max(worst(fused, separate).values()) <= BOUND, worst(fused, separate)


def test_a_kernel_without_the_segment_ids_differs() -> None:
    """The broken variant: without segment ids every token attends across its row's sequences."""
    q, k, v, do, seg = inputs(HEADS, SEQ, DIM, LENGTHS)
    ref = grads(dense, q, k, v, do, seg)
    broken = grads(splash(True, 128, HEADS, SEQ, interpret=True, segments=False), q, k, v, do, seg)
    assert max(worst(broken, ref).values()) > 0.05, worst(broken, ref)
