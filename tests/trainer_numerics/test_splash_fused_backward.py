"""Splash attention's fused backward kernel (``sa_use_fused_bwd_kernel: true``, what the v5e recipe sets)
gives the gradients of masked attention over packed rows: dq, dk and dv equal a dense reference's and the
separate dq and dkv kernels' (MaxText's default), with segment ids and a causal mask, at the block sizes
recipes/catalog/qwen3-0.6b-v5e.yaml ships scaled down.

The kernels run under Pallas's interpreter on the CPU: this checks the kernel's algorithm (its blocks, the
mask's skipping, the fused accumulation of dq), not the TPU's lowering of it; the chip runs the same kernel
in tests/tpu and bench/train_step_chip.py. A broken variant (segment ids dropped from the kernel) must
differ, so the comparison can fail.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

HEADS, SEQ, DIM = 2, 512, 128


def _inputs(seed: int = 0) -> tuple[Any, ...]:
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    q, k, v, do = (jnp.asarray(rng.normal(size=(HEADS, SEQ, DIM)), jnp.float32) for _ in range(4))
    # three packed sequences and a padded tail (segment 0), as the trainer's rows hold them
    seg = np.zeros(SEQ, np.int32)
    seg[:200], seg[200:330], seg[330:480] = 1, 2, 3
    return q, k, v, do, jnp.asarray(seg)


def _dense(q: Any, k: Any, v: Any, seg: Any) -> Any:
    import jax
    import jax.numpy as jnp

    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    same = seg[:, None] == seg[None, :]
    logits = jnp.einsum("hqd,hkd->hqk", q, k, precision="highest")
    logits = jnp.where(causal & same, logits, -1e30)
    return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(logits, axis=-1), v, precision="highest")


def _splash(fused: bool, block: int, *, segments: bool = True) -> Any:
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((SEQ, SEQ)) for _ in range(HEADS)])
    sizes = sk.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=None if fused else block,
        block_kv_dq=None if fused else block,
        use_fused_bwd_kernel=fused,
    )
    kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=True)

    def attend(q: Any, k: Any, v: Any, seg: Any) -> Any:
        ids = sk.SegmentIds(q=seg, kv=seg) if segments else None
        return kernel(q, k, v, segment_ids=ids)

    return jax.jit(attend)


def _grads(attend: Any, q: Any, k: Any, v: Any, do: Any, seg: Any) -> tuple[Any, ...]:
    import jax

    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
    return (out, *vjp(do))


@pytest.mark.parametrize("block", [128, 256])
def test_the_fused_backward_equals_the_reference_and_the_separate_kernels(block: int) -> None:
    q, k, v, do, seg = _inputs()
    real = np.asarray(seg) > 0  # padding's own rows attend to padding only: compared on real tokens
    ref = _grads(_dense, q, k, v, do, seg)
    fused = _grads(_splash(True, block), q, k, v, do, seg)
    separate = _grads(_splash(False, block), q, k, v, do, seg)
    for name, r, f, s in zip(("out", "dq", "dk", "dv"), ref, fused, separate, strict=True):
        r, f, s = (np.asarray(x)[:, real] for x in (r, f, s))
        scale = float(np.abs(r).max())
        assert np.abs(f - r).max() <= 2e-4 * scale, (name, float(np.abs(f - r).max()), scale)
        assert np.abs(f - s).max() <= 2e-4 * scale, (name, float(np.abs(f - s).max()), scale)


def test_a_kernel_without_the_segment_ids_differs() -> None:
    """The broken variant: without segment ids every token attends across its row's sequences."""
    q, k, v, do, seg = _inputs()
    real = np.asarray(seg) > 0
    ref = _grads(_dense, q, k, v, do, seg)
    broken = _grads(_splash(True, 128, segments=False), q, k, v, do, seg)
    worst = max(float(np.abs(np.asarray(b - r)[:, real]).max()) for r, b in zip(ref, broken, strict=True))
    assert worst > 0.1, worst
