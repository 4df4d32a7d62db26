"""The CPU loop's model and its sampler: the trainer's tiny MaxText policy (rljob.trainer.model), decoded.

Both processes of the CPU loop build the same `Policy` from `cpu_model_spec` (same MaxText keys, and the
same base weights: the run config's `spec.model.checkpoint` when it names one, else the same seed; the
step-0 parity gate checks they agree): the trainer trains its LoRA through rljob.trainer.train_step,
the CPU sampler (rljob.sampler.cpu_server) serves it with `Sampler.generate`, a jitted decode loop over
`Policy.logits` (the sequences of the toy task are a few tokens, so a full forward per generated token
is cheap and needs no KV cache).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rljob.recipes.runconfig import RunConfig
from rljob.trainer.model import CPU_KEYS, ModelSpec, Policy, tiny_keys
from safetensors.numpy import load_file

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
# A small vocabulary: the toy task's answer is one token, so chance is 1/vocab for an untrained model.
TOY_VOCAB = 32
TOY_MAX_LEN = 32
# Text tasks (spec.dataset.task math) on the tiny model: the CPU sampler's tokenizer is UTF-8 bytes.
BYTE_VOCAB = 256
MAX_BYTE_LEN = 256


def cpu_shape(rc: RunConfig) -> tuple[int, int]:
    """(vocabulary, sequence length) of the tiny CPU model for a run: the toy task's, or byte tokens long
    enough for maxPromptTokens + maxTokens (rounded up to 32, at most MAX_BYTE_LEN) for a text task. A
    service (spec.service, text from its clients) without a toy dataset: byte tokens, MAX_BYTE_LEN long."""
    d, alg = rc.spec.dataset, rc.spec.algorithm
    if rc.spec.service is not None and d.task != "successor":
        return BYTE_VOCAB, MAX_BYTE_LEN
    if d.task == "successor":
        return TOY_VOCAB, TOY_MAX_LEN
    seq = alg.max_prompt_tokens + alg.max_tokens
    return BYTE_VOCAB, min(MAX_BYTE_LEN, max(TOY_MAX_LEN, -(-seq // 32) * 32))


def cpu_model_spec(
    lora_rank: int,
    lora_alpha: float,
    *,
    checkpoint: str | None = None,
    seed: int = 0,
    vocab_size: int = TOY_VOCAB,
    max_len: int = TOY_MAX_LEN,
) -> ModelSpec:
    """The tiny model of the CPU loop (trainer and CPU sampler build exactly this, shaped by cpu_shape);
    base weights from ``checkpoint`` (a converted MaxText checkpoint of this model, spec.model.checkpoint)
    or ``seed``."""
    return ModelSpec(
        maxtext=tiny_keys(vocab_size=vocab_size, max_target_length=max_len),
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        seed=seed,
        checkpoint=checkpoint,
    )


MESH_RULE_KEYS = ("context_parallel_load_balance", "custom_mesh_and_rule")


def miniature_keys(rc: RunConfig, *, mesh: bool) -> dict[str, Any]:
    """MaxText keys of the miniature of the run's model (``rljob drill``): the recipe's own model config with
    only sizes shrunk (rljob.recipes.miniature; a model it does not know: the tiny qwen3 model), at the CPU
    loop's vocabulary and length (cpu_shape: the toy task's tokens); with ``mesh``, the run config's mesh
    keys (``ici_*``, with ``dcn_*`` folded in: the trainer's, whose processes own that many devices; a CPU
    sampler is one process and keeps MaxText's default mesh)."""
    vocab, max_len = cpu_shape(rc)
    name = str(rc.trainer.maxtext.get("model_name", ""))
    from rljob.recipes import miniature

    if name in miniature.MODELS:
        # The model's own MaxText config (model_name) with only its sizes overridden.
        keys = {"model_name": name, **miniature.miniature_overrides(name), **CPU_KEYS}
    else:
        keys = tiny_keys()
    keys.update(vocab_size=vocab, max_target_length=max_len)
    if mesh:
        # The recipe's keys that say how the mesh's axes are used (MaxText refuses, e.g., context
        # parallelism over gated delta nets with the load-balanced layout; Qwen3.5's recipe turns it off).
        keys.update({k: v for k, v in rc.trainer.maxtext.items() if k in MESH_RULE_KEYS})
        # Host devices carry no slice ids (MaxText finds one slice): each dcn axis is folded into its ici
        # axis, the same devices in the same number of processes.
        src = rc.trainer.maxtext
        for k, v in src.items():
            if k.startswith("ici_"):
                keys[k] = int(v) * int(src.get("dcn_" + k[4:], 1))
            elif k.startswith("dcn_"):
                keys[k] = 1
        ici = {k[4:].removesuffix("_parallelism"): int(v) for k, v in keys.items() if k.startswith("ici_")}
        if miniature.moe_expert_parallelism(ici, keys.get("custom_mesh_and_rule")) > 1:
            # Expert parallelism's sparse (megablox) dispatch exchanges tokens with ragged-all-to-all, which
            # XLA:CPU does not implement; the dense dispatch keeps the expert axis and its collectives.
            # (With cp-as-ep the context axis is an expert axis of the MoE too.)
            keys.update(CPU_EXPERT_PARALLEL_KEYS)
    return keys


CPU_EXPERT_PARALLEL_KEYS: dict[str, Any] = {"sparse_matmul": False, "megablox": False}
"""What a CPU rehearsal of an expert-parallel MoE trainer changes (rljob drill says so in its report)."""


def miniature_spec(rc: RunConfig, *, mesh: bool, checkpoint: str | None = None) -> ModelSpec:
    """The ModelSpec of :func:`miniature_keys` with the run's LoRA rank, alpha and targets as the plan
    resolved them (same seed everywhere, so the trainer's processes and the CPU sampler build the same base
    weights)."""
    lora = rc.spec.lora
    return ModelSpec(
        maxtext=miniature_keys(rc, mesh=mesh),
        lora_rank=lora.rank,
        lora_alpha=lora.alpha,
        lora_targets=lora.targets,
        checkpoint=checkpoint,
    )


class Sampler:
    """Token sampling with per-token log-probs (raw logits, as vLLM's default `raw_logprobs`)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    @partial(jax.jit, static_argnums=(0, 4))
    def _decode(
        self,
        lora: Any,
        tokens: jax.Array,
        lengths: jax.Array,
        max_tokens: int,
        temperature: jax.Array,
        key: jax.Array,
        top_k: jax.Array,
        top_p: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))

        def body(
            i: int, carry: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            toks, out_lp, k = carry
            cur = lengths + i
            seg = (jnp.arange(t)[None] < cur[:, None]).astype(jnp.int32)
            logits = self.policy.logits(lora, toks, positions, seg)
            last = jnp.take_along_axis(logits, (cur - 1)[:, None, None], axis=1)[:, 0]
            k, sub = jax.random.split(k)
            greedy = jnp.argmax(last, axis=-1)
            sampled = jax.random.categorical(
                sub, filter_logits(last / jnp.maximum(temperature, 1e-6), top_k, top_p), axis=-1
            )
            nxt = jnp.where(temperature > 0, sampled, greedy).astype(toks.dtype)
            lp = jnp.take_along_axis(jax.nn.log_softmax(last, -1), nxt[:, None], axis=-1)[:, 0]
            toks = toks.at[jnp.arange(b), cur].set(nxt)
            return toks, out_lp.at[:, i].set(lp), k

        lp0 = jnp.zeros((b, max_tokens), jnp.float32)
        toks, lps, _ = jax.lax.fori_loop(0, max_tokens, body, (tokens, lp0, key))
        idx = lengths[:, None] + jnp.arange(max_tokens)[None]
        return jnp.take_along_axis(toks, idx, axis=1), lps

    def generate(
        self,
        lora: Any,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float,
        seed: int,
        bucket: int = 16,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sample `max_tokens` tokens after each prompt: (tokens, log-probs), both [N, max_tokens]; the
        logits divided by ``temperature`` (0: greedy), then cut to the ``top_k`` largest (0: off), then to
        the smallest set of probability ``top_p`` (1: off), in the order of vLLM's TPU backend
        (:func:`filter_logits`). The log-probs are the unscaled model's (vLLM's default raw_logprobs).

        Rows are padded to multiples of 8 and `bucket` tokens so few shapes compile."""
        n = len(prompts)
        width = -(-(max(len(p) for p in prompts) + max_tokens) // bucket) * bucket
        if width > self.policy.cfg.max_target_length:
            raise ValueError(
                f"prompt + max_tokens exceeds the model's length {self.policy.cfg.max_target_length}"
            )
        rows = -(-n // 8) * 8
        toks = np.zeros((rows, width), np.int32)
        lengths = np.ones((rows,), np.int32)
        for i, p in enumerate(prompts):
            toks[i, : len(p)] = p
            lengths[i] = len(p)
        out, lps = self._decode(
            lora,
            jnp.asarray(toks),
            jnp.asarray(lengths),
            max_tokens,
            jnp.float32(temperature),
            jax.random.key(seed),
            jnp.int32(top_k),
            jnp.float32(top_p),
        )
        return np.asarray(out)[:n], np.asarray(lps)[:n]


def filter_logits(z: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``z`` [B, V] (temperature applied) with the tokens outside the ``top_k`` largest (k > 0) and then
    outside the smallest set whose probability reaches ``top_p`` (p < 1) set to -inf: the order and rules
    of tpu-inference's _apply_sampling_transforms (tpu_inference/layers/jax/sample/sampling.py,
    https://github.com/vllm-project/tpu-inference). Ties at a threshold stay in."""
    desc = -jnp.sort(-z, axis=-1)
    v = z.shape[-1]
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, v - 1)[None, None].repeat(z.shape[0], 0), axis=-1)
    z = jnp.where((top_k > 0) & (z < kth), -jnp.inf, z)
    desc = -jnp.sort(-z, axis=-1)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the larger tokens
    kept = jnp.where(before < top_p, desc, jnp.inf).min(axis=-1, keepdims=True)
    return jnp.where((top_p < 1) & (z < kept), -jnp.inf, z)


def load_peft_dir(policy: Policy, directory: Path) -> Any:
    """A PEFT adapter directory as the policy's LoRA state; ValueError if it does not fit the model."""
    cfg = json.loads((directory / PEFT_CONFIG).read_text())
    if int(cfg.get("r", -1)) != policy.spec.lora_rank:
        raise ValueError(f"{directory}: adapter rank {cfg.get('r')} != served rank {policy.spec.lora_rank}")
    return policy.peft.from_peft(load_file(str(directory / PEFT_WEIGHTS)))


__all__ = [
    "BYTE_VOCAB",
    "PEFT_CONFIG",
    "PEFT_WEIGHTS",
    "TOY_VOCAB",
    "Sampler",
    "cpu_model_spec",
    "cpu_shape",
    "filter_logits",
    "load_peft_dir",
    "miniature_keys",
    "miniature_spec",
]
