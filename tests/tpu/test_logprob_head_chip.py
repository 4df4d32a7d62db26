"""The fused, tiled log-prob head (rljob.trainer.logprobs.token_logprobs) against the naive head
(``log_softmax(h @ w)``, the whole [T, V] logits) on the chip: values and gradients, at a full-size model's
shape (qwen3-0.6b: H 1024, V 151,936) and the trainer's default tiles. Both compute in float32 from the same
bf16 or float32 operands, so they differ only by the order of the sums."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

T, H, V = 4096, 1024, 151_936
# dtype of hidden and head -> (value bound, relative gradient bound)
TOLERANCE = {"bfloat16": (2e-3, 2e-2), "float32": (1e-4, 1e-3)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_head_equals_the_naive_head(chip: Any, record: Any, dtype: str) -> None:
    import jax
    import jax.numpy as jnp
    from rljob.trainer import logprobs as lp

    k = jax.random.split(jax.random.key(0), 4)
    h = (jax.random.normal(k[0], (T, H), jnp.float32)).astype(dtype)
    w = (jax.random.normal(k[1], (H, V), jnp.float32) * (2.5 / np.sqrt(H))).astype(dtype)  # logit std ~2.5
    targets = jax.random.randint(k[2], (T,), 0, V)
    mask = jax.random.uniform(k[3], (T,)) < 0.9
    cot = jnp.where(mask, 1.0, 0.0) / T

    def fused(hh: Any, ww: Any) -> Any:
        return (lp.token_logprobs(hh, ww, targets, mask) * cot).sum()

    def naive(hh: Any, ww: Any) -> Any:
        return (lp.naive_token_logprobs(hh, ww, targets, mask) * cot).sum()

    with jax.default_matmul_precision("highest"):
        vf = np.asarray(jax.jit(lambda a, b: lp.token_logprobs(a, b, targets, mask))(h, w))
        vn = np.asarray(jax.jit(lambda a, b: lp.naive_token_logprobs(a, b, targets, mask))(h, w))
        gf = jax.jit(jax.grad(fused, argnums=(0, 1)))(h, w)
        gn = jax.jit(jax.grad(naive, argnums=(0, 1)))(h, w)
    value_err = float(np.abs(vf - vn)[np.asarray(mask)].max())
    rel = []
    for a, b in zip(gf, gn, strict=True):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        rel.append(float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-30)))
    record("fused_head", "max_abs_value_diff_nats", value_err, dtype=dtype, T=T, H=H, V=V)
    record("fused_head", "grad_hidden_rel_diff", rel[0], dtype=dtype)
    record("fused_head", "grad_head_rel_diff", rel[1], dtype=dtype)
    value_tol, grad_tol = TOLERANCE[dtype]
    assert value_err < value_tol, value_err
    assert max(rel) < grad_tol, rel
    assert float(np.abs(vn[np.asarray(mask)]).mean()) > 1.0  # the values are real log-probs, not zeros
