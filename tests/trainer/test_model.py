"""The real tiny MaxText model with qwix LoRA: packed rows compute what unpacked sequences compute,
only LoRA parameters are trainable, and the PEFT mapping round-trips."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rljob.trainer.losses import LossConfig
from rljob.trainer.packing import PackConfig, Rollout, pack_rollouts
from rljob.trainer.train_step import StepConfig, Trainer, stack_micro_batches

pytestmark = pytest.mark.jax


def _rollouts(vocab: int, seed: int = 0) -> list[Rollout]:
    rng = np.random.default_rng(seed)
    out = []
    for n_p, n_c in [(5, 9), (3, 14), (7, 4)]:
        c = rng.integers(1, vocab, n_c).astype(np.int32)
        old = (-np.log(vocab) + 0.3 * rng.standard_normal(n_c)).astype(np.float32)
        out.append(
            Rollout(
                rng.integers(1, vocab, n_p), c, advantage=float(rng.normal()), per_token={"old_logprobs": old}
            )
        )
    return out


def _perturbed(lora: Any, seed: int = 1) -> Any:
    """LoRA with both factors non-zero (qwix starts lora_b at 0, which would hide lora_a's gradient)."""
    leaves, tree = jax.tree.flatten(lora)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    )


def _loss_and_grads(trainer: Trainer, lora: Any, packed: list[Any]) -> tuple[float, Any]:
    (batch,) = stack_micro_batches(packed, len(packed))

    def total(lo: Any) -> jax.Array:
        losses = [
            trainer.micro_loss(lo, {k: jnp.asarray(v[i]) for k, v in batch.items()})[0]
            for i in range(len(packed))
        ]
        return jnp.sum(jnp.stack(losses))

    loss, grads = jax.jit(jax.value_and_grad(total))(lora)
    return float(loss), grads


@pytest.mark.parametrize(
    "layout",
    [{}, {"pad_position": "start", "pad_align": 8}],
    ids=["pad-end", "pad-start"],
)
def test_packed_equals_unpacked(tiny_policy: Any, layout: dict[str, Any]) -> None:
    cfg = StepConfig(
        budget=64,
        rows=1,
        loss=LossConfig(kind="ppo", clip_low=0.2, clip_high=0.2),
        token_tile=16,
        vocab_chunk=100,
    )
    trainer = Trainer(tiny_policy, cfg)
    lora = _perturbed(tiny_policy.lora0)
    rollouts = _rollouts(tiny_policy.vocab_size)
    packed = pack_rollouts(rollouts, PackConfig(budget=64, rows=1, segment_align=8, **layout))
    assert len(packed) == 1 and int(packed[0].num_segments[0]) == 3
    if layout:  # the row really moved: padding first, segments after
        assert packed[0].segment_ids[0, 0] == 0 and packed[0].segment_ids[0, 8] != 0
    # Unpacked: each rollout alone in its own row (same per-token weights: one global token mean).
    alone = [pack_rollouts([r], PackConfig(budget=64, rows=1))[0] for r in rollouts]
    total = sum(float(b.loss_mask.sum()) for b in alone)
    assert total == float(packed[0].loss_mask.sum())
    loss_p, g_p = _loss_and_grads(trainer, lora, packed)
    loss_u, g_u = _loss_and_grads(trainer, lora, alone)
    assert loss_p == pytest.approx(loss_u, abs=1e-6)
    gmax = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_u))
    assert gmax > 0
    for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_u), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * gmax)
    # Every LoRA factor gets a gradient; nothing else is trainable.
    assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(g_p))


def test_segments_do_not_attend_across(tiny_policy: Any) -> None:
    """Changing one segment's tokens leaves the other segment's log-probs unchanged (a broken mask,
    e.g. segment ids dropped, fails this)."""
    tok = np.zeros((1, 32), np.int32)
    seg = np.zeros((1, 32), np.int32)
    pos = np.zeros((1, 32), np.int32)
    tok[0, :10] = np.arange(3, 13)
    seg[0, :10], pos[0, :10] = 1, np.arange(10)
    tok[0, 16:24] = np.arange(20, 28)
    seg[0, 16:24], pos[0, 16:24] = 2, np.arange(8)
    lora = _perturbed(tiny_policy.lora0)
    f = jax.jit(tiny_policy.next_token_logprobs)
    a = np.asarray(f(lora, tok, pos, seg))
    tok2 = tok.copy()
    tok2[0, :10] = np.arange(40, 50)
    b = np.asarray(f(lora, tok2, pos, seg))
    np.testing.assert_array_equal(a[0, 16:24], b[0, 16:24])
    assert np.abs(a[0, 1:10] - b[0, 1:10]).max() > 1e-3
    # Without segment ids (all one segment) the second segment does see the first.
    ones = np.where(np.arange(32) < 24, 1, 0)[None].astype(np.int32)
    c = np.asarray(f(lora, tok, np.arange(32, dtype=np.int32)[None], ones))
    d = np.asarray(f(lora, tok2, np.arange(32, dtype=np.int32)[None], ones))
    assert np.abs(c[0, 17:24] - d[0, 17:24]).max() > 1e-4


def test_only_lora_is_trainable_and_peft_round_trips(tiny_policy: Any) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(tiny_policy.lora0)[0]
    names = {".".join(str(getattr(k, "key", k)) for k in path) for path, _ in leaves}
    assert names and all("_lora_" in n for n in names)
    lora = _perturbed(tiny_policy.lora0)
    tensors = tiny_policy.peft.to_peft(lora)
    layers = tiny_policy.num_layers
    assert len(tensors) == 7 * 2 * layers
    h, r = tiny_policy.hidden_size, tiny_policy.spec.lora_rank
    q_out = tiny_policy.cfg.num_query_heads * tiny_policy.cfg.head_dim
    kv_out = tiny_policy.cfg.num_kv_heads * tiny_policy.cfg.head_dim
    mlp = tiny_policy.cfg.mlp_dim
    expected = {
        "self_attn.q_proj": ((r, h), (q_out, r)),
        "self_attn.k_proj": ((r, h), (kv_out, r)),
        "self_attn.v_proj": ((r, h), (kv_out, r)),
        "self_attn.o_proj": ((r, q_out), (h, r)),
        "mlp.gate_proj": ((r, h), (mlp, r)),
        "mlp.up_proj": ((r, h), (mlp, r)),
        "mlp.down_proj": ((r, mlp), (h, r)),
    }
    for i in range(layers):
        for mod, (a_shape, b_shape) in expected.items():
            assert tensors[f"base_model.model.model.layers.{i}.{mod}.lora_A.weight"].shape == a_shape
            assert tensors[f"base_model.model.model.layers.{i}.{mod}.lora_B.weight"].shape == b_shape
    back = tiny_policy.peft.from_peft(tensors)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(lora), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The mapping is per layer: swapping two layers' tensors changes the restored parameters.
    swapped = dict(tensors)
    k0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    k1 = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    swapped[k0], swapped[k1] = tensors[k1], tensors[k0]
    back2 = tiny_policy.peft.from_peft(swapped)
    q = back2["decoder"]["layers"]["self_attention"]["query"]["kernel_lora_a"]
    np.testing.assert_array_equal(np.asarray(q)[:, 0], tensors[k1].T)
    with pytest.raises(ValueError, match="shape"):
        bad = dict(tensors)
        bad[k0] = np.zeros((r + 1, h), np.float32)
        tiny_policy.peft.from_peft(bad)


def test_generate_logprobs_match_the_fused_head(tiny_policy: Any, tmp_path: Any) -> None:
    """The sampler path (full logits of the last token) and the trainer path (fused head over the whole
    sequence) agree on the sampled tokens' log-probs; PEFT files round-trip through a directory."""
    lora = _perturbed(tiny_policy.lora0, seed=2)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    from rljob.trainer.tinypolicy import Sampler  # the CPU sampler's decoder over this Policy

    toks, lps = Sampler(tiny_policy).generate(lora, prompts, max_tokens=4, temperature=1.0, seed=0)
    assert toks.shape == (2, 4) and lps.shape == (2, 4)
    for p, t, lp in zip(prompts, toks, lps, strict=True):
        seq = np.asarray([*p, *t], np.int32)[None]
        n = seq.shape[1]
        ref = tiny_policy.next_token_logprobs(
            lora,
            seq,
            np.arange(n, dtype=np.int32)[None],
            np.ones((1, n), np.int32),
            token_tile=8,
            vocab_chunk=64,
        )
        np.testing.assert_allclose(np.asarray(ref)[0, len(p) :], lp, atol=2e-5)
    tiny_policy.peft.save(lora, tmp_path / "v1")
    back = tiny_policy.peft.load(tmp_path / "v1")
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(lora), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
