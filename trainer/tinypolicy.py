"""The tiny policy of the CPU loop: a small Qwen3-architecture decoder (tunix's model) with a qwix LoRA.

Both processes of the CPU loop build it: the trainer (rljob.trainer.loop) trains its LoRA parameters,
the CPU sampler (rljob.sampler.cpu_server) serves it. The base weights come from a fixed seed, so both
processes hold bit-identical base weights (the step-0 parity gate checks it); the adapter travels in
the PEFT layout vLLM loads (`adapter_model.safetensors`: `...<proj>.lora_A.weight` (r, in),
`...lora_B.weight` (out, r), plus `adapter_config.json`).

This module is the loop's stand-in for the trainer runtime's MaxText model (trainer/model.py); the
loop and the CPU sampler only use the functions below, so switching the model is local to this file.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax  # type: ignore[import-untyped]
import qwix  # type: ignore[import-untyped]
from flax import nnx
from safetensors.numpy import load_file, save_file
from tunix.models.qwen3.model import ModelConfig, Qwen3  # type: ignore[import-untyped]

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
_PROJ_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_PEFT_RE = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_(A|B)\.weight$"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model and its adapter. `seed` fixes the base weights."""

    vocab_size: int = 32
    num_layers: int = 2
    embed_dim: int = 64
    hidden_dim: int = 128
    num_heads: int = 4
    head_dim: int = 16
    num_kv_heads: int = 2
    lora_rank: int = 8
    lora_alpha: float = 16.0
    seed: int = 0
    base_model: str = "rljob/tiny-qwen3"

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            num_layers=self.num_layers,
            vocab_size=self.vocab_size,
            embed_dim=self.embed_dim,
            hidden_dim=self.hidden_dim,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_kv_heads=self.num_kv_heads,
            rope_theta=10000,
            norm_eps=1e-6,
        )


LoraState = Any  # an nnx.State of nnx.LoRAParam leaves


class TinyPolicy:
    """The model split into a graph, frozen base parameters and trainable LoRA parameters."""

    def __init__(self, spec: TinySpec) -> None:
        self.spec = spec
        model = Qwen3(spec.model_config(), rngs=nnx.Rngs(spec.seed))
        provider = qwix.LoraProvider(
            module_path=r".*(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
            rank=spec.lora_rank,
            alpha=spec.lora_alpha,
        )
        toks = jnp.ones((1, 2), jnp.int32)
        pos = jnp.arange(2)[None]
        mask = jnp.ones((1, 2, 2), bool)
        lora_model = qwix.apply_lora_to_model(
            model, provider, toks, pos, None, mask, rngs=nnx.Rngs(spec.seed + 1)
        )
        parts: Any = nnx.split(lora_model, nnx.LoRAParam, ...)
        self.graphdef: Any = parts[0]
        self.lora0: Any = parts[1]
        self.base: Any = parts[2]
        self._paths = [
            _key(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(self.lora0))[0]
        ]

    # ---------------------------------------------------------------- forward and log-probs

    @partial(jax.jit, static_argnums=0)
    def logits(
        self, lora: LoraState, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        """[B, T, V] float32 logits of packed rows (attention within a segment, causal; 0 = padding)."""
        model = nnx.merge(self.graphdef, lora, self.base)
        t = tokens.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))[None]
        same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] > 0)
        out, _ = model(tokens, positions, None, causal & same)
        return jnp.asarray(out)

    @partial(jax.jit, static_argnums=0)
    def next_token_logprobs(
        self, lora: LoraState, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        """[B, T]: entry i is log p(tokens[i] | tokens[<i] of its segment); 0 on segment starts/pads."""
        lp = jax.nn.log_softmax(self.logits(lora, tokens, positions, segment_ids), axis=-1)
        tgt = jnp.roll(tokens, -1, axis=1)
        nxt_seg = jnp.roll(segment_ids, -1, axis=1)
        valid = (
            (segment_ids > 0) & (nxt_seg == segment_ids) & (jnp.arange(tokens.shape[1]) < tokens.shape[1] - 1)
        )
        picked = jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]
        picked = jnp.where(valid, picked, 0.0)
        return jnp.concatenate([jnp.zeros_like(picked[:, :1]), picked[:, :-1]], axis=1)

    # ---------------------------------------------------------------- sampling

    @partial(jax.jit, static_argnums=(0, 4))
    def _decode(
        self,
        lora: LoraState,
        tokens: jax.Array,
        lengths: jax.Array,
        max_tokens: int,
        temperature: jax.Array,
        key: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))

        def body(
            i: int, carry: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            toks, out_lp, k = carry
            cur = lengths + i
            seg = (jnp.arange(t)[None] < cur[:, None]).astype(jnp.int32)
            logits = self.logits(lora, toks, positions, seg)
            last = jnp.take_along_axis(logits, (cur - 1)[:, None, None], axis=1)[:, 0]
            k, sub = jax.random.split(k)
            greedy = jnp.argmax(last, axis=-1)
            sampled = jax.random.categorical(sub, last / jnp.maximum(temperature, 1e-6), axis=-1)
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
        lora: LoraState,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float,
        seed: int,
        bucket: int = 16,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Sample `max_tokens` tokens after each prompt: (tokens, raw log-probs), both [N, max_tokens].

        Log-probs are of the sampled tokens under the unscaled logits (vLLM's default raw_logprobs).
        Rows are padded to a multiple of `bucket` tokens so few shapes compile."""
        n = len(prompts)
        width = max(len(p) for p in prompts) + max_tokens
        width = -(-width // bucket) * bucket
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
        )
        return np.asarray(out)[:n], np.asarray(lps)[:n]

    # ---------------------------------------------------------------- PEFT files

    def to_peft(self, lora: LoraState) -> dict[str, np.ndarray]:
        """LoRA parameters as PEFT tensors: lora_A (r, in), lora_B (out, r), float32."""
        out: dict[str, np.ndarray] = {}
        pure = nnx.to_pure_dict(lora)
        for path, arr in jax.tree_util.tree_flatten_with_path(pure)[0]:
            layer, proj, which = _parse(_key(path))
            a = np.asarray(arr, np.float32)
            r = self.spec.lora_rank
            mat = a.reshape(-1, r).T if which == "A" else a.reshape(r, -1).T
            name = f"base_model.model.model.layers.{layer}.{_PROJ_PARENT[proj]}.{proj}.lora_{which}.weight"
            out[name] = np.ascontiguousarray(mat)
        return out

    def from_peft(self, tensors: dict[str, np.ndarray]) -> LoraState:
        """The inverse of `to_peft`; raises ValueError on a missing, extra or misshapen tensor."""
        want = self.to_peft(self.lora0)
        if set(tensors) != set(want):
            missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
            raise ValueError(
                f"adapter tensors do not match the model: missing {missing[:3]}, extra {extra[:3]}"
            )

        def convert(path: tuple[Any, ...], arr: jax.Array) -> jax.Array:
            layer, proj, which = _parse(_key(path))
            name = f"base_model.model.model.layers.{layer}.{_PROJ_PARENT[proj]}.{proj}.lora_{which}.weight"
            t = np.asarray(tensors[name], np.float32)
            if t.shape != want[name].shape:
                raise ValueError(f"{name}: shape {t.shape}, the model needs {want[name].shape}")
            return jnp.asarray(np.ascontiguousarray(t.T).reshape(arr.shape))

        new = jax.tree_util.tree_map_with_path(convert, nnx.to_pure_dict(self.lora0))
        state = jax.tree.map(lambda x: x, self.lora0)
        nnx.replace_by_pure_dict(state, new)
        return state

    def peft_config(self) -> dict[str, Any]:
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.spec.base_model,
            "r": self.spec.lora_rank,
            "lora_alpha": self.spec.lora_alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": sorted(_PROJ_PARENT),
            "rljob_tiny_spec": asdict(self.spec),
        }

    def save_peft(self, lora: LoraState, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.to_peft(lora), str(directory / PEFT_WEIGHTS))
        (directory / PEFT_CONFIG).write_text(json.dumps(self.peft_config(), indent=1))

    def load_peft(self, directory: Path) -> LoraState:
        cfg = json.loads((directory / PEFT_CONFIG).read_text())
        if int(cfg.get("r", -1)) != self.spec.lora_rank:
            raise ValueError(f"{directory}: adapter rank {cfg.get('r')} != served rank {self.spec.lora_rank}")
        return self.from_peft(load_file(str(directory / PEFT_WEIGHTS)))

    # ---------------------------------------------------------------- training

    def optimizer(self, learning_rate: float) -> optax.GradientTransformation:
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate))


def _key(path: tuple[Any, ...]) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def _parse(key: str) -> tuple[int, str, str]:
    m = re.match(r"^layers\.(\d+)\.(?:attn|mlp)\.(\w+_proj)\.(?:w|kernel)_lora_(a|b)$", key)
    if not m:
        raise ValueError(f"unexpected LoRA parameter {key}")
    return int(m.group(1)), m.group(2), m.group(3).upper()


__all__ = ["PEFT_CONFIG", "PEFT_WEIGHTS", "TinyPolicy", "TinySpec"]
