"""fixtures.chip_models.realistic_head, which the chip tier (tests/tpu) runs before it measures a step's peak
HBM on the chip: it scales the output head to a trained model's logit spread, and runs the forward pass as one
jitted program. Run eagerly, MaxText's scanned decoder copies each stacked weight to scan over it (one
``moveaxis`` program a weight), so the chip's allocator saw the decoder's weights twice before the step
(Llama 3.1 8B's width at 8 layers: 3.5 GB above its 5.8 GB base, read as the step's peak)."""

from __future__ import annotations

from typing import Any

import numpy as np
from fixtures.chip_models import LOGIT_STD, realistic_head
from fixtures.jax_compiles import backend_compiles


def _logits_std(policy: Any, batch: dict[str, np.ndarray]) -> float:
    import jax
    import jax.numpy as jnp

    toks, pos, seg = (jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids"))
    h = np.asarray(jax.jit(policy.hidden_states)(policy.lora0, toks, pos, seg, policy.base), np.float32)
    w = np.asarray(policy.head_weight(policy.lora0), np.float32)
    logits = np.asarray(policy.logit_transform(jnp.asarray(h.reshape(-1, h.shape[-1]) @ w)))
    return float(logits.std())


def test_realistic_head_scales_the_head_with_one_forward_program(tiny_policy: Any) -> None:
    import jax

    policy = tiny_policy
    t = 64
    batch = {
        "tokens": (np.arange(t, dtype=np.int32) * 7 % policy.vocab_size)[None],
        "positions": np.arange(t, dtype=np.int32)[None],
        "segment_ids": np.ones((1, t), np.int32),
    }
    base = policy.base
    try:
        with backend_compiles() as compiled:
            factor = realistic_head(policy, batch)
        names = [name for name, _ in compiled]
        assert not any("moveaxis" in n for n in names), names  # no eager copy of the stacked weights
        assert factor > 0 and np.isclose(_logits_std(policy, batch), LOGIT_STD, rtol=0.05)
        # only the head changed (the tiny model's embedding is tied: the table)
        changed = [
            jax.tree_util.keystr(p)
            for (p, a), b in zip(
                jax.tree_util.tree_leaves_with_path(base), jax.tree.leaves(policy.base), strict=True
            )
            if a is not b
        ]
        assert changed and all(("token_embedder" in c) or ("logits_dense" in c) for c in changed), changed
    finally:
        policy.base = base
