"""Splash attention (MaxText ``attention: flash``, the TPU kernel) against dot-product attention, on the chip.

The same full-size qwen3-0.6b weights (realistic logit scale: fixtures.chip_models.realistic_head), the same
packed rows with segment ids, laid out as the trainer packs them (``pad_position`` end, start and balanced);
the trainer's own next-token log-probs under each attention are compared at every position the loss reads.
Tolerances per dtype: the mean and the largest |difference| over those positions (nats). bf16 attention
rounds its probabilities and its P.V product differently in the two kernels, and the layers (8 here) carry
each rounding forward, hence the bf16 bounds; float32 narrows them (TOLERANCE says by how much on a TPU).
A masking bug moves the mean by whole nats."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fixtures.chip_models import fullsize_keys, lengths_for, realistic_head, rollouts

BUDGET = 4096
ROWS = 2
# Full width, 8 of the model's 28 layers (MaxText override_model_config): the kernels and masks are per layer,
# and 28 layers made 12 full compiles take longer than one chip call.
DEPTH = 8
# dtype -> (mean |diff| bound, max |diff| bound), nats over the loss's positions
# float32 on a TPU is not float32 throughout: at JAX's default matmul precision the MXU takes the operands
# of a float32 matmul as bfloat16, in both kernels, so the two differ by bfloat16 roundings still (measured
# on a v5e, 2026-12-07: mean 0.010, max 0.049 nats against bfloat16's 0.031 and 0.150). A masking bug moves
# the mean by whole nats: these bounds catch it in either dtype.
TOLERANCE = {"bfloat16": (0.05, 1.0), "float32": (0.025, 0.25)}


def _policy(attention: str, dtype: str) -> Any:
    from rljob.trainer.model import ModelSpec, Policy

    return Policy(
        ModelSpec(
            maxtext=fullsize_keys("qwen3-0.6b", attention=attention, dtype=dtype, budget=BUDGET, depth=DEPTH),
            lora_rank=16,
            lora_alpha=32.0,
        )
    )


def _packed(vocab: int, pad_position: str) -> Any:
    from rljob.trainer.packing import PackConfig, pack_rollouts

    kw: dict[str, Any] = {}
    if pad_position in ("start", "balanced"):
        kw["pad_align"] = 512
    if pad_position == "balanced":
        kw["context_ranks"] = 2
    cfg = PackConfig(budget=BUDGET, rows=ROWS, pad_position=pad_position, **kw)  # type: ignore[arg-type]
    (mb, *_) = pack_rollouts(rollouts(vocab, lengths_for(BUDGET, ROWS, fill=0.8)), cfg)
    return mb


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_splash_equals_dot_product_on_packed_rows(chip: Any, record: Any, dtype: str) -> None:
    import jax
    import jax.numpy as jnp

    flash = _policy("flash", dtype)
    dot = _policy("dot_product", dtype)
    first = _packed(flash.vocab_size, "end")
    factor = realistic_head(
        flash, {"tokens": first.tokens, "positions": first.positions, "segment_ids": first.segment_ids}
    )
    dot.base = flash.base  # the same weights (same tree: only the attention kernel differs)
    # One program each, compiled once: every layout has the same shapes.
    flash_lp, dot_lp = jax.jit(flash.next_token_logprobs), jax.jit(dot.next_token_logprobs)
    for pad_position in ("end", "start", "balanced"):
        mb = _packed(flash.vocab_size, pad_position)
        args = [jnp.asarray(a) for a in (mb.tokens, mb.positions, mb.segment_ids)]
        a = np.asarray(flash_lp(flash.lora0, *args), np.float64)
        b = np.asarray(dot_lp(dot.lora0, *args), np.float64)
        seg = mb.segment_ids
        # the positions the loss reads: a token whose previous token is in its segment
        live = (seg > 0) & (np.roll(seg, 1, axis=-1) == seg)
        live[:, 0] = False
        diff = np.abs(a - b)[live]
        mean_lp = float(b[live].mean())
        context = {
            "dtype": dtype,
            "pad_position": pad_position,
            "positions": int(live.sum()),
            "head_scale": factor,
            "mean_token_logprob": mean_lp,
            "layers": DEPTH,
        }
        record("splash_vs_dot_product", "mean_abs_diff_nats", float(diff.mean()), **context)
        record("splash_vs_dot_product", "max_abs_diff_nats", float(diff.max()), **context)
        assert -40.0 < mean_lp < -5.0, f"weights without a realistic logit scale: mean log-prob {mean_lp}"
        mean_tol, max_tol = TOLERANCE[dtype]
        assert diff.mean() < mean_tol and diff.max() < max_tol, (pad_position, diff.mean(), diff.max())
