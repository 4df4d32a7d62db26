"""The trainer's log-prob head computes what MaxText's output head computes, for every head the catalog's
families use: an untied logits_dense kernel (Qwen3, gpt-oss, Qwen3.5) or tied embedding logits divided
by sqrt(emb_dim) and soft-capped (Gemma 4: final_logits_soft_cap 30). The trainer used to refuse any soft
cap at start; here a tiny model with Gemma's head (on the qwen3 block, so that only the head differs)
trains through the fused head, checked against MaxText's own ``apply_output_head`` and a log-softmax of
its logits, values and gradients."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rljob.trainer.logprobs import LogitTransform, next_token_targets, shift_to_tokens
from rljob.trainer.model import ModelSpec, Policy, head_transform, tiny_keys

pytestmark = pytest.mark.jax


@pytest.mark.parametrize(
    ("cfg", "want"),
    [
        # qwen3 / gpt-oss / qwen3.5: an untied kernel, used as is
        (
            {
                "logits_via_embedding": False,
                "normalize_embedding_logits": True,
                "final_logits_soft_cap": None,
            },
            (1.0, 0.0),
        ),
        # MaxText applies the cap only to tied embedding logits (NNXDecoder.apply_output_head)
        (
            {
                "logits_via_embedding": False,
                "normalize_embedding_logits": False,
                "final_logits_soft_cap": 30.0,
            },
            (1.0, 0.0),
        ),
        # gemma4-31b: tied, / sqrt(5376) (normalize_embedding_logits defaults to true), cap 30
        (
            {"logits_via_embedding": True, "normalize_embedding_logits": True, "final_logits_soft_cap": 30.0},
            (float(np.sqrt(np.float32(5376))), 30.0),
        ),
        (
            {"logits_via_embedding": True, "normalize_embedding_logits": False, "final_logits_soft_cap": 0.0},
            (1.0, 0.0),
        ),
    ],
)
def test_head_transform_follows_maxtext(cfg: dict[str, Any], want: tuple[float, float]) -> None:
    tf = head_transform(SimpleNamespace(emb_dim=5376, **cfg))
    assert (tf.divisor, tf.soft_cap, tf.temperature) == (*want, 1.0)


@pytest.fixture(scope="module")
def gemma_head_policy() -> Policy:
    keys = tiny_keys(logits_via_embedding=True, normalize_embedding_logits=True, final_logits_soft_cap=3.0)
    return Policy(ModelSpec(maxtext=keys, lora_rank=8, lora_alpha=16.0))


def _maxtext_logits(policy: Policy, lora: Any, toks: jax.Array, pos: jax.Array, seg: jax.Array) -> jax.Array:
    """MaxText's own output head on the policy's final hidden states (before its norm)."""
    import flax.linen as nn
    from flax import nnx

    model = nnx.merge(policy.graphdef, policy.as_state(lora), policy.base)
    with nn.logical_axis_rules(policy.cfg.logical_axis_rules):
        model(toks, pos, decoder_segment_ids=seg, enable_dropout=False)
        y = nnx.pop(model, nnx.Intermediate)["decoder"]["hidden_states"].get_value()[0]
        return model.decoder.apply_output_head(model.token_embedder, y, True, "train")  # type: ignore[no-any-return]


def test_tied_scaled_capped_head_matches_maxtext(gemma_head_policy: Policy) -> None:
    policy = gemma_head_policy
    assert policy.logit_transform == LogitTransform(divisor=8.0, soft_cap=3.0)  # sqrt(64), the cap
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(1, policy.vocab_size, (2, 24)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    seg = jnp.asarray([[1] * 10 + [2] * 14, [1] * 20 + [0] * 4], jnp.int32)
    lora = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), jnp.float32), policy.lora0)
    g = jnp.asarray(rng.standard_normal((2, 24)), jnp.float32)

    mt = _maxtext_logits(policy, lora, toks, pos, seg)
    # the logits saturate against the cap: the soft cap is doing something
    assert float(jnp.abs(mt).max()) > 2.0
    np.testing.assert_array_equal(np.asarray(policy.logits(lora, toks, pos, seg)), np.asarray(mt))

    def naive(lo: Any) -> jax.Array:
        logp = jax.nn.log_softmax(_maxtext_logits(policy, lo, toks, pos, seg).astype(jnp.float32), -1)
        tg, valid = next_token_targets(toks, seg)
        return shift_to_tokens(jnp.where(valid, jnp.take_along_axis(logp, tg[..., None], -1)[..., 0], 0.0))

    def fused(lo: Any) -> jax.Array:
        return policy.next_token_logprobs(lo, toks, pos, seg, token_tile=7, vocab_chunk=50)

    want, want_vjp = jax.vjp(naive, lora)
    got, got_vjp = jax.vjp(fused, lora)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-6)
    (dw,), (dg,) = want_vjp(g), got_vjp(g)
    for a, b in zip(jax.tree.leaves(dg), jax.tree.leaves(dw), strict=True):
        scale = float(jnp.abs(b).max())
        assert scale > 0 and float(jnp.abs(a - b).max()) <= 1e-5 * scale
