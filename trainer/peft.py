"""The trainer's LoRA state in the PEFT layout (contract 5 in docs/architecture.md): the Hugging Face
tensor names and shapes vLLM and peft load, the map from MaxText's stacked LoRA leaves to them and back,
``adapter_config.json``, and the adapter files in a local directory (publishing to storage:
rljob.trainer.export).

A :class:`PeftAdapter` is built by :class:`rljob.trainer.model.Policy` from its initial LoRA state and
MaxText config (``policy.peft``):

  tensors = policy.peft.to_peft(lora)      # {name: lora_A (r, in) | lora_B (out, r)}, float32
  lora = policy.peft.from_peft(tensors)    # the inverse; ValueError on a tensor that does not fit
  policy.peft.config()                     # adapter_config.json
  policy.peft.save(lora, directory); policy.peft.load(directory)
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rljob.recipes import families
from rljob.trainer.expert_lora import EXPERT_HF_NAMES

if TYPE_CHECKING:
    from rljob.trainer.model import LoraState, ModelSpec

__all__ = [
    "DEFAULT_HF_LAYERS_PREFIX",
    "HF_LAYERS_PREFIX",
    "HF_PROJ",
    "MLA_HF_PROJ",
    "LeafLayout",
    "PeftAdapter",
    "decoder_block",
    "hf_layers_prefix",
    "hf_projection",
    "output_map",
    "peft_layout",
    "rope_pairs",
]

# MaxText module name -> (Hugging Face parent, Hugging Face projection) for llama/qwen3-style models.
HF_PROJ: dict[str, tuple[str, str]] = {
    "query": ("self_attn", "q_proj"),
    "key": ("self_attn", "k_proj"),
    "value": ("self_attn", "v_proj"),
    "out": ("self_attn", "o_proj"),
    "wi_0": ("mlp", "gate_proj"),
    "wi_1": ("mlp", "up_proj"),
    "wo": ("mlp", "down_proj"),
}

# DeepSeek's multi-head latent attention (MaxText 0.2.5 layers/attention_mla.py; Hugging Face
# DeepseekV3Attention / DeepseekV2Attention, transformers 5.x models/deepseek_v3/modeling_deepseek_v3.py):
# MaxText's MLA uses ``query`` (q_proj, q_lora_rank 0) and ``out`` (o_proj) as above and these. Kept apart
# from HF_PROJ, whose modules are every other block's default LoRA targets.
MLA_HF_PROJ: dict[str, tuple[str, str]] = {
    "wq_a": ("self_attn", "q_a_proj"),
    "wq_b": ("self_attn", "q_b_proj"),
    "wkv_a": ("self_attn", "kv_a_proj_with_mqa"),
    "wkv_b": ("self_attn", "kv_b_proj"),
}
_PROJ = HF_PROJ | MLA_HF_PROJ

# PEFT name prefix of the decoder layers of the Hugging Face model each decoder block is converted from (the
# PEFT model wraps it as base_model.model): rljob.recipes.families ``hf_layers_prefix``. Qwen3ForCausalLM,
# Qwen3MoeForCausalLM, LlamaForCausalLM, MixtralForCausalLM and GptOssForCausalLM keep them at
# model.layers; Qwen3_5MoeForConditionalGeneration, Gemma4ForConditionalGeneration and
# Gemma3ForConditionalGeneration at model.language_model.layers (transformers 5.x,
# models/qwen3_5_moe/modeling_qwen3_5_moe.py, models/gemma4/modeling_gemma4.py and
# models/gemma3/modeling_gemma3.py: ``self.model = ...Model(config)`` whose ``self.language_model`` holds
# ``self.layers``; https://github.com/huggingface/transformers/tree/main/src/transformers/models). MaxText's
# gemma3 configs (gemma3-4b, -12b, -27b) are the image-text checkpoints google/gemma-3-*-it, whose
# conversion writes model.language_model.layers (checkpoint_conversion/utils/param_mapping.py
# GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING); the text-only Gemma3ForCausalLM (gemma-3-1b) has no MaxText config.
DEFAULT_HF_LAYERS_PREFIX = families.DEFAULT_HF_LAYERS_PREFIX
HF_LAYERS_PREFIX: dict[str, str] = {
    b: f.hf_layers_prefix
    for b, f in families.FAMILIES.items()
    if f.hf_layers_prefix != DEFAULT_HF_LAYERS_PREFIX
}


def decoder_block(cfg: Any) -> str:
    """The config's decoder block as its config files spell it (``gemma4``, ``qwen3_5``, ...)."""
    block = cfg.decoder_block
    return str(getattr(block, "value", block)).lower()


def hf_projection(module: str) -> str:
    """The Hugging Face projection of a MaxText LoRA module (``query`` -> ``q_proj``, ``wkv_b`` ->
    ``kv_b_proj``); a name of neither table (the target ``experts``) as it is."""
    return _PROJ[module][1] if module in _PROJ else module


def hf_layers_prefix(decoder_block: str) -> str:
    """The PEFT name prefix of the Hugging Face decoder layers of a MaxText decoder block."""
    return HF_LAYERS_PREFIX.get(decoder_block.lower(), DEFAULT_HF_LAYERS_PREFIX)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one LoRA leaf's layers are in the Hugging Face model.

    The leaf holds one [d0, d1] matrix per layer (lora_a [in, r], lora_b [r, out]) stacked on
    ``len(scan_shape)`` scan axes inserted at ``scan_axis`` (MaxText's param_scan_axis); ``layers`` is
    the Hugging Face layer index of each scan position, row-major over ``scan_shape``."""

    path: str  # the leaf's MaxText path, '/'-joined
    module: str  # MaxText projection: query, key, value, out, wi_0, wi_1, wo
    which: str  # "a" | "b"
    hf_parent: str  # "self_attn", "mlp" or "mlp.shared_expert"
    matrix_shape: tuple[int, int]
    scan_axis: int
    scan_shape: tuple[int, ...]
    layers: tuple[int, ...]
    # How a lora_b's output features differ from the Hugging Face projection's (query and key only, where
    # the MaxText conversion of the checkpoint changes them; :func:`output_map`): the head width, whether
    # MaxText's RoPE rotates interleaved pairs (2i, 2i+1) within each head where Hugging Face rotates
    # (i, i + head_dim/2), and the factor MaxText's kernel is smaller by (1/sqrt(head_dim) folded in).
    head_dim: int = 0
    rope_pairs: bool = False
    scale: float = 1.0
    # An expert LoRA leaf (rljob.trainer.expert_lora): the number of routed experts, each with its own
    # [d0, d1] matrix per layer (experts first, then the matrix, once the scan axes are taken out), and
    # the Hugging Face projection inside ``hf_parent.{j}`` (gate_proj, up_proj, down_proj).
    experts: int = 0
    hf_proj: str = ""

    def to_hf(self, m: np.ndarray) -> np.ndarray:
        """A layer's PEFT tensor from its [d0, d1] matrix: lora_A (r, in), lora_B (out, r) in the Hugging
        Face model's feature order and scale."""
        t = np.ascontiguousarray(m.T)
        if self.rope_pairs:
            # per head: MaxText's interleaved pairs -> Hugging Face's halves (evens, then odds), as the
            # MaxText->HF conversion's adjust_rope does to the kernel
            h = t.reshape(-1, self.head_dim, t.shape[-1])
            t = np.concatenate([h[:, ::2], h[:, 1::2]], axis=1).reshape(t.shape)
        if self.scale != 1.0:
            t = (t.astype(np.float64) * self.scale).astype(np.float32)
        return np.ascontiguousarray(t)

    def from_hf(self, t: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`to_hf` (exact up to the float32 rounding of a non-power-of-two scale)."""
        t = np.asarray(t, np.float32)
        if self.scale != 1.0:
            t = (t.astype(np.float64) / self.scale).astype(np.float32)
        if self.rope_pairs:
            half = self.head_dim // 2
            h = t.reshape(-1, self.head_dim, t.shape[-1])
            t = np.stack([h[:, :half], h[:, half:]], axis=2).reshape(t.shape)
        return np.ascontiguousarray(t.T)

    @property
    def unscanned_shape(self) -> tuple[int, ...]:
        """One layer's share of the leaf: [d0, d1], or [experts, d0, d1] for an expert leaf."""
        return ((self.experts,) if self.experts else ()) + self.matrix_shape

    def per_layer(self, arr: np.ndarray) -> np.ndarray:
        """[n_layers, d0, d1] (an expert leaf: [n_layers, experts, d0, d1]) from the stacked leaf."""
        k = len(self.scan_shape)
        moved = np.moveaxis(arr, list(range(self.scan_axis, self.scan_axis + k)), list(range(k)))
        return moved.reshape(-1, *self.unscanned_shape)

    def stack(self, mats: list[np.ndarray]) -> np.ndarray:
        """The inverse of :meth:`per_layer`."""
        k = len(self.scan_shape)
        arr = np.stack(mats).reshape(*self.scan_shape, *self.unscanned_shape)
        return np.moveaxis(arr, list(range(k)), list(range(self.scan_axis, self.scan_axis + k)))


_ATTENTION_MODULES = ("query", "key", "value", "out", *MLA_HF_PROJ)

# Decoder blocks whose attention applies no 1/sqrt(head_dim) to the query: MaxText folds it into the
# query kernel (layers/attentions.py init_query_w: no qk norm, no query_pre_attn_scalar; models/llama2.py
# and models/mixtral.py pass none), and its Hugging Face conversion divides q_proj by sqrt(head_dim)
# (checkpoint_conversion/utils/param_mapping.py LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN and
# MIXTRAL_MAXTEXT_TO_HF_PARAM_HOOK_FN, scale_query_layer). Mixtral's RoPE rotates halves as Hugging
# Face's does (MaxText's default RotaryEmbedding; its conversion reorders nothing).
QUERY_SCALE_FOLDED = families.blocks_where("query_scale_folded")


def rope_pairs(cfg: Any) -> bool:
    """Whether MaxText's RoPE for ``cfg`` rotates interleaved pairs (2i, 2i+1) of each head: the
    llama3.1 rotary embedding (MaxText 0.2.5 layers/attentions.py init_rotary_embedding picks
    LLaMARotaryEmbedding for a model_name or rope_type starting with llama3.1, layers/embeddings.py),
    whose checkpoint conversion interleaves q_proj's and k_proj's halves (adjust_rope)."""
    if bool(getattr(cfg, "use_mrope", False)) or str(getattr(cfg, "attention_type", "")) == "mla":
        return False
    name, rope = str(getattr(cfg, "model_name", "")), str(getattr(cfg, "rope_type", ""))
    return name.startswith("llama3.1") or rope.startswith("llama3.1")


def output_map(cfg: Any, module: str, which: str) -> dict[str, Any]:
    """The :class:`LeafLayout` fields (head_dim, rope_pairs, scale) of a LoRA leaf of ``module``: only a
    lora_b of the query or key differs from Hugging Face's layout, and only where MaxText's checkpoint
    conversion changes that kernel (:func:`rope_pairs`, QUERY_SCALE_FOLDED)."""
    if which != "b" or module not in ("query", "key"):
        return {}
    hd = int(cfg.head_dim)
    out: dict[str, Any] = {}
    if rope_pairs(cfg):
        out |= {"head_dim": hd, "rope_pairs": True}
    if module == "query" and decoder_block(cfg) in QUERY_SCALE_FOLDED:
        out["scale"] = float(np.sqrt(np.float64(hd)))
    return out


_SUBLAYER = re.compile(r"^layers?_(\d+)$")


def _gemma4_pattern() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local positions, global positions) of a Gemma 4 scanned block (MaxText 0.2.5 models/gemma4.py:
    GEMMA4_ATTENTION_PATTERN, five LOCAL_SLIDING layers then one GLOBAL)."""
    from maxtext.models import gemma4

    pattern = gemma4.GEMMA4_ATTENTION_PATTERN
    local = tuple(i for i, t in enumerate(pattern) if t == gemma4.AttentionType.LOCAL_SLIDING)
    return local, tuple(i for i in range(len(pattern)) if i not in local)


def _gemma3_block() -> int:
    """Layers per scanned Gemma 3 block (MaxText 0.2.5 models/gemma3.py GEMMA3_ATTENTION_PATTERN: five
    LOCAL_SLIDING then one GLOBAL; layers/nnx_decoders.py _init_scanned_gemma3 scans blocks of it as
    ``layers`` with sub-layers ``layers_<j>`` and keeps the layers after the last whole block unscanned in
    ``layers_remainder``)."""
    from maxtext.models import gemma3

    return len(gemma3.GEMMA3_ATTENTION_PATTERN)


def _leaf_layers(keys: list[str], scan_shape: tuple[int, ...], cfg: Any) -> tuple[int, ...] | None:
    """Hugging Face layer indices of a LoRA leaf at MaxText path ``keys`` (``decoder/<container>/...``)
    with ``scan_shape`` scan axes, or None for a layout not known here. MaxText 0.2.5's NNX decoder
    (layers/nnx_decoders.py) stacks the layers as

    - ``layers`` (one scan axis): one layer per position (Qwen3), or blocks of
      ``inhomogeneous_layer_cycle_interval`` layers whose sub-layers are ``layers_<j>`` (gpt-oss: block
      of 2) or ``layer_<j>`` (Qwen3.5: block of 4): layer = block x interval + j; Gemma 3 scans blocks of
      its attention pattern (6) the same way, its remainder layers in ``layers_remainder/layers_<j>``;
    - ``scanned_blocks`` (Gemma 4): blocks of GEMMA4_ATTENTION_PATTERN, the local layers stacked again
      within a block (``local_layers``: scan axes [blocks, local]), the global layer once per block;
    - ``layers_remainder``: the layers after the last whole block, one short block;
    - ``layers_<i>`` without scan axes: unscanned layers (scan_layers false).
    """
    if len(keys) < 2 or keys[0] != "decoder":
        return None
    container, inner = keys[1], keys[2:]
    n = int(cfg.num_decoder_layers)
    plain = _SUBLAYER.match(container)
    if plain and not scan_shape:
        return (int(plain.group(1)),)
    if container == "layers" and len(scan_shape) == 1:
        sub = _SUBLAYER.match(inner[0]) if inner else None
        if sub is None:
            return tuple(range(scan_shape[0]))
        interval = int(cfg.inhomogeneous_layer_cycle_interval)
        if decoder_block(cfg) == "gemma3":
            interval = _gemma3_block()
        return tuple(b * interval + int(sub.group(1)) for b in range(scan_shape[0]))
    if decoder_block(cfg) == "gemma3" and container == "layers_remainder" and not scan_shape:
        sub = _SUBLAYER.match(inner[0]) if inner else None
        if sub is not None:
            return ((n // _gemma3_block()) * _gemma3_block() + int(sub.group(1)),)
    if decoder_block(cfg) == "deepseek":
        return _deepseek_layers(container, scan_shape, cfg)
    if decoder_block(cfg) == "gemma4" and container in ("scanned_blocks", "layers_remainder"):
        local, glob = _gemma4_pattern()
        block = len(local) + len(glob)
        if container == "scanned_blocks" and inner[:1] == ["local_layers"] and len(scan_shape) == 2:
            return tuple(b * block + local[j] for b in range(scan_shape[0]) for j in range(scan_shape[1]))
        if container == "scanned_blocks" and inner[:1] == ["global_layer"] and len(scan_shape) == 1:
            return tuple(b * block + glob[0] for b in range(scan_shape[0]))
        start = (n // block) * block
        if container == "layers_remainder" and inner[:1] == ["local_layers"] and len(scan_shape) == 1:
            return tuple(start + local[j] for j in range(scan_shape[0]))
    return None


_DEEPSEEK_UNSCANNED = re.compile(r"^(dense|moe)_layers_(\d+)$")


def _deepseek_layers(container: str, scan_shape: tuple[int, ...], cfg: Any) -> tuple[int, ...] | None:
    """Hugging Face layers of a DeepSeek LoRA leaf: MaxText 0.2.5 (layers/nnx_decoders.py
    _init_scanned_deepseek_standard, _init_sequential_deepseek) keeps the ``first_num_dense_layers``
    dense layers in ``dense_layers`` and the MoE layers after them in ``moe_layers`` (one scan axis
    each), or unscanned in ``dense_layers_<i>`` and ``moe_layers_<i>``, as its Hugging Face conversion
    (checkpoint_conversion/utils/param_mapping.py DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING) maps them to
    model.layers.{i} and model.layers.{first_num_dense_layers + i}. Engram and pipeline layouts are not
    known here (None)."""
    dense = int(cfg.first_num_dense_layers)
    start = {"dense_layers": 0, "moe_layers": dense}
    if container in start and len(scan_shape) == 1:
        return tuple(start[container] + i for i in range(scan_shape[0]))
    plain = _DEEPSEEK_UNSCANNED.match(container)
    if plain and not scan_shape:
        return ((0 if plain.group(1) == "dense" else dense) + int(plain.group(2)),)
    return None


def _mlp_parent(keys: list[str]) -> str:
    """The Hugging Face parent of an MLP LoRA leaf at MaxText path ``keys``: Qwen3.5's shared expert
    (``mlp.shared_expert``), DeepSeek's shared experts (MaxText ``DeepSeekMoeBlock_0/shared_experts``,
    Hugging Face ``mlp.shared_experts``, one MLP as wide as all of them: DeepseekV3MoE), else ``mlp``."""
    if "shared_experts" in keys:
        return "mlp.shared_experts"
    return "mlp.shared_expert" if "shared_expert" in keys else "mlp"


def peft_layout(lora: Any, cfg: Any) -> list[LeafLayout]:
    """The :class:`LeafLayout` of every leaf of ``lora`` (pytree order) for MaxText config ``cfg``;
    ValueError naming the leaf for a layout not known here, a layer out of range or twice."""
    out: list[LeafLayout] = []
    axis = int(cfg.param_scan_axis)
    seen: dict[tuple[str, str, str], set[int]] = {}
    for path, arr in jax.tree_util.tree_flatten_with_path(lora)[0]:
        keys = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
        expert = _EXPERT_LEAF.match(keys[-1]) if keys else None
        module, which = (expert.group("w"), expert.group("which")) if expert else _parse_lora_path(path)
        shape = tuple(int(d) for d in np.shape(arr))
        k = len(shape) - (3 if expert else 2)
        scan_axis = axis if k else 0
        if k < 0 or scan_axis > 2:
            raise ValueError(f"LoRA parameter {'/'.join(keys)}: shape {shape} is not a stack of matrices")
        scan_shape = shape[scan_axis : scan_axis + k]
        matrix = shape[:scan_axis] + shape[scan_axis + k :]
        layers = _leaf_layers(keys[:-1] if expert else keys[:-2], scan_shape, cfg)
        if layers is None:
            raise ValueError(
                f"LoRA parameter {'/'.join(keys)} (scan axes {scan_shape}): a layer layout of the "
                f"{decoder_block(cfg)} decoder that the PEFT export does not know"
            )
        parent = "self_attn" if module in _ATTENTION_MODULES else _mlp_parent(keys)
        extra: dict[str, Any] = {}
        if expert:
            if decoder_block(cfg) not in EXPERT_HF_NAMES:
                raise ValueError(
                    f"LoRA parameter {'/'.join(keys)}: no PEFT layout of the {decoder_block(cfg)} "
                    "decoder's routed experts"
                )
            parent, projections = EXPERT_HF_NAMES[decoder_block(cfg)]
            extra = {"experts": matrix[0], "hf_proj": projections[module]}
            matrix = matrix[1:]
        key = (parent, module, which)
        if any(not 0 <= i < int(cfg.num_decoder_layers) for i in layers) or seen.get(key, set()) & set(
            layers
        ):
            raise ValueError(f"LoRA parameter {'/'.join(keys)}: layers {layers} out of range or mapped twice")
        seen.setdefault(key, set()).update(layers)
        out.append(
            LeafLayout(
                "/".join(keys),
                module,
                which,
                parent,
                (matrix[0], matrix[1]),
                scan_axis,
                scan_shape,
                layers,
                **(extra or output_map(cfg, module, which)),
            )
        )
    return out


# An expert LoRA factor (rljob.trainer.expert_lora): <wi_0|wi_1|wo>_lora_<a|b> on the MoE module.
_EXPERT_LEAF = re.compile(r"^(?P<w>wi_0|wi_1|wo)_lora_(?P<which>[ab])$")


_LORA_LEAF = re.compile(r"^(?P<module>\w+)\.kernel_lora_(?P<which>[ab])$")


def _parse_lora_path(path: tuple[Any, ...]) -> tuple[str, str]:
    key = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
    tail = ".".join(key.split(".")[-2:])
    m = _LORA_LEAF.match(tail)
    if not m or m.group("module") not in _PROJ:
        raise ValueError(f"unexpected LoRA parameter {key}")
    return m.group("module"), m.group("which")


class PeftAdapter:
    """The PEFT layout of one policy's LoRA state: where each leaf's layers go (``layout``, pytree
    order), the tensor name prefix of the Hugging Face decoder layers, and the adapter's settings."""

    def __init__(self, spec: ModelSpec, lora0: LoraState, cfg: Any) -> None:
        self.spec = spec
        self.lora0 = lora0
        # PEFT name prefix of the Hugging Face decoder layers: the spec's, else the decoder block's.
        self.layers_prefix = spec.hf_layers_prefix or hf_layers_prefix(decoder_block(cfg))
        # Where each LoRA leaf's layers sit in the Hugging Face model (peft_layout); ValueError on a
        # layout this code does not know.
        self.layout: list[LeafLayout] = peft_layout(lora0, cfg)

    def lora_paths(self) -> list[tuple[str, str]]:
        """(MaxText module, 'a'|'b') of every LoRA leaf, in pytree order."""
        return [(leaf.module, leaf.which) for leaf in self.layout]

    def to_peft(self, lora: LoraState) -> dict[str, np.ndarray]:
        """LoRA parameters as PEFT tensors, float32: ``lora_A`` (r, in), ``lora_B`` (out, r) per layer.

        qwix keeps a layer's factors as lora_a [in, r] and lora_b [r, out] (multi-axis kernels, heads x
        head_dim, flattened in MaxText's order, which is Hugging Face's ``num_heads * head_dim`` order),
        stacked on the scan axes of the leaf (:class:`LeafLayout`: one axis of layers, of blocks of
        layers, or blocks and the layers within); the layout names each scan position's layer."""
        out: dict[str, np.ndarray] = {}
        pure = nnx.to_pure_dict(lora) if isinstance(lora, nnx.State) else lora
        leaves = jax.tree_util.tree_flatten_with_path(pure)[0]
        if len(leaves) != len(self.layout):
            raise ValueError(f"adapter has {len(leaves)} LoRA leaves, the model {len(self.layout)}")
        for (_, arr), leaf in zip(leaves, self.layout, strict=True):
            per_layer = leaf.per_layer(np.asarray(arr, np.float32))
            for layer, m in zip(leaf.layers, per_layer, strict=True):
                # lora_A (r, in) from [in, r]; lora_B (out, r) from [r, out]; an expert leaf: per expert
                for name, mj in zip(self._names(leaf, layer), m if leaf.experts else [m], strict=True):
                    out[name] = leaf.to_hf(mj)
        return out

    def _names(self, leaf: LeafLayout, layer: int) -> list[str]:
        """The PEFT tensor names of one layer of ``leaf``: one, or one per expert."""
        if not leaf.experts:
            return [self.name(layer, leaf)]
        return [self.name(layer, leaf, expert=j) for j in range(leaf.experts)]

    def from_peft(self, tensors: Mapping[str, np.ndarray]) -> LoraState:
        """The inverse of :meth:`to_peft`; ValueError on a missing, extra or misshapen tensor."""
        want = {
            name: leaf.matrix_shape[::-1]
            for leaf in self.layout
            for layer in leaf.layers
            for name in self._names(leaf, layer)
        }
        if set(tensors) != set(want):
            missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
            raise ValueError(
                f"adapter tensors do not match the model: missing {missing[:3]}, extra {extra[:3]}"
            )
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(want[name]):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the model needs {tuple(want[name])}")
        leaves, treedef = jax.tree_util.tree_flatten(self.lora0)
        out = []
        for arr, leaf in zip(leaves, self.layout, strict=True):
            mats = []
            for layer in leaf.layers:
                per = [leaf.from_hf(tensors[n]) for n in self._names(leaf, layer)]
                mats.append(np.stack(per) if leaf.experts else per[0])
            out.append(jnp.asarray(leaf.stack(mats), arr.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)

    def name(
        self, layer: int, leaf: LeafLayout | str, which: str | None = None, expert: int | None = None
    ) -> str:
        """The PEFT tensor name of ``leaf`` (or of MaxText module ``leaf`` under ``self_attn``/``mlp``, and
        ``which``) at Hugging Face layer ``layer``; an expert leaf's names the expert (``expert``):
        ``...layers.{i}.mlp.experts.{j}.gate_proj.lora_A.weight``."""
        if isinstance(leaf, str):
            parent, proj = _PROJ[leaf]
            which = which or "a"
        else:
            parent, proj, which = leaf.hf_parent, leaf.hf_proj or _PROJ[leaf.module][1], leaf.which
        if expert is not None:
            parent = f"{parent}.{expert}"
        return f"{self.layers_prefix}.{layer}.{parent}.{proj}.lora_{which.upper()}.weight"

    def save(self, lora: LoraState, directory: Path) -> None:
        """Write the PEFT files into a local directory (publishing goes through rljob.trainer.export)."""
        from safetensors.numpy import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.to_peft(lora), str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(self.config(), indent=1))

    def load(self, directory: Path) -> LoraState:
        return self.from_files(
            (directory / "adapter_config.json").read_bytes(),
            (directory / "adapter_model.safetensors").read_bytes(),
            str(directory),
        )

    def from_files(self, config: bytes, weights: bytes, where: str) -> LoraState:
        """The LoRA state of a PEFT adapter's adapter_config.json and adapter_model.safetensors (the bytes
        of each); ValueError, naming ``where``, when its rank, alpha or target modules are not this
        model's adapter's or a tensor does not fit."""
        from safetensors.numpy import load

        try:
            cfg = json.loads(config)
        except ValueError as e:
            raise ValueError(f"{where}: adapter_config.json is not JSON: {e}") from None
        own = self.config()
        for key in ("r", "lora_alpha", "target_modules"):
            theirs: Any = cfg.get(key)
            if key == "target_modules" and isinstance(theirs, list):
                theirs = sorted(theirs)
            if theirs != own[key]:  # JSON's 32 and 32.0 compare equal
                raise ValueError(f"{where}: the adapter's {key} is {theirs!r}, this run's {own[key]!r}")
        try:
            tensors = load(weights)
        except Exception as e:  # safetensors raises its own error types on a malformed file
            raise ValueError(f"{where}: adapter_model.safetensors: {e}") from None
        return self.from_peft(tensors)

    def config(self) -> dict[str, Any]:
        """adapter_config.json of the PEFT layout (what vLLM and peft read)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.spec.base_model,
            "r": self.spec.lora_rank,
            "lora_alpha": self.spec.lora_alpha,
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            # the experts' projections are modules named gate_proj/up_proj/down_proj inside experts.{j}
            "target_modules": sorted(
                {leaf.hf_proj or _PROJ[leaf.module][1] for leaf in self.layout}
                | {_PROJ[m][1] for m in self.spec.maxtext_targets if m in _PROJ}
            ),
        }
