"""LoRA on the routed experts of a MaxText MoE block: an adapter per expert (the LoRA target ``experts``,
rljob.recipes.lora_targets).

MaxText keeps a block's routed experts as stacked parameters of its ``RoutedMoE`` module (MaxText 0.2.5
layers/moe.py): ``wi_0`` and ``wi_1`` [experts, emb, moe_mlp] (Hugging Face ``experts.{j}.gate_proj`` and
``up_proj``), ``wo`` [experts, moe_mlp, emb] (``down_proj``), with the layer scan axis inserted at
``param_scan_axis``. They are parameters, not modules, so qwix's module-regex LoRA (rljob.trainer.lora)
does not wrap them. :func:`add_expert_lora` gives each such module per-expert factors, as nnx.LoRAParam
(the trainable state, as qwix's are):

  ``wi_0_lora_a`` [experts, in, r] (he_uniform, bound sqrt(6 / in), as qwix draws its lora_a),
  ``wi_0_lora_b`` [experts, r, out] (zero), likewise for ``wi_1`` and ``wo``, stacked on the kernel's scan
  axes,

and switches the module to a subclass (:func:`expert_lora_class`) whose call runs MaxText's own
``RoutedMoE.__call__`` with each expert weight replaced by ``W[e] + (alpha / r) * A[e] @ B[e]`` for the
length of the call (the weights are put back after it). The merged weights are what MaxText reads before
it picks its expert matmul, so every path computes with them: the dense einsum path, the sparse path
(megablox's grouped matmul, interpreted on CPU, or ``jax.lax.ragged_dot``), and the gradients reach A and
B through them. The cost: each layer forms a [experts, in, out] delta per call (the size of its expert
weights, transient, laid out on the experts' mesh axis like the weights); and where the weights are
bfloat16 the merged weight is rounded to bfloat16 (the delta below a weight's last bit is lost in the
forward pass, as in a full fine-tune of the expert weights; the gradient is that of the merged weight).
The prefused ``wi`` layout (``prefuse_moe_weights``) and MaxText's TE MoE block are refused.

The PEFT layout (rljob.trainer.peft): one ``lora_A`` (r, in) and ``lora_B`` (out, r) per layer and expert,
``model.layers.{i}.mlp.experts.{j}.gate_proj.lora_A.weight`` and so on (Mixtral:
``model.layers.{i}.block_sparse_moe.experts.{j}.w1``, ``w3``, ``w2``; EXPERT_HF_NAMES): the checkpoint's
per-expert names (as MaxText's conversion names the expert weights), the layout PEFT writes for a model
whose experts are modules (transformers 4.x Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock) and which vLLM's
MoE LoRA (vllm/lora/layers/fused_moe.py) stacks per expert. transformers 5.x keeps Qwen3 MoE's experts as
3-D parameters (Qwen3MoeExperts.gate_up_proj, likewise Mixtral's; no per-expert module), so ``peft`` cannot
load this adapter into that model as is; tests/trainer/test_expert_lora.py merges it by name as peft merges
a LoRA into a Linear. vLLM's TPU backend serves no LoRA on MoE experts
(rljob.recipes.lora_targets.SERVING_REFUSED).
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rljob.recipes import families
from rljob.trainer.lora import FactorDraw, create_factors, replicated_on

__all__ = ["EXPERT_HF_NAMES", "EXPERT_WEIGHTS", "add_expert_lora", "expert_lora_class"]

# MaxText expert weight -> its Hugging Face projection inside ``experts.{j}`` (MaxText 0.2.5
# checkpoint_conversion/utils/param_mapping.py QWEN_MAXTEXT_TO_HF_PARAM_MAPPING: moe_block-wi_0 ->
# mlp.experts.{e}.gate_proj.weight, wi_1 -> up_proj, wo -> down_proj).
EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo")
# decoder block -> (the Hugging Face parent of the experts, {MaxText weight: projection}): the rows of
# rljob.recipes.families with ``experts``.
EXPERT_HF_NAMES: dict[str, tuple[str, dict[str, str]]] = {
    b: f.experts for b, f in families.FAMILIES.items() if f.experts is not None
}

_CLASSES: dict[type, type] = {}


def expert_lora_class(base: type) -> type:
    """The subclass of MaxText's ``RoutedMoE`` (``base``) whose call merges the expert LoRA factors (one
    class per base, so graph definitions of the same model compare equal)."""
    if base not in _CLASSES:

        def __call__(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            saved: dict[str, Any] = {}
            try:
                for w in EXPERT_WEIGHTS:
                    a = getattr(self, f"{w}_lora_a", None)
                    if a is None:
                        continue
                    var = getattr(self, w)
                    kernel = var.get_value()
                    b = getattr(self, f"{w}_lora_b")[...]
                    delta = jnp.einsum("eir,ero->eio", a[...], b, precision=jax.lax.Precision.HIGHEST)
                    saved[w] = kernel
                    var.set_value(kernel + (delta * self.expert_lora_scale).astype(kernel.dtype))
                return base.__call__(self, inputs, *args, **kwargs)
            finally:
                for w, kernel in saved.items():
                    getattr(self, w).set_value(kernel)

        _CLASSES[base] = type(f"ExpertLora{base.__name__}", (base,), {"__call__": __call__})
    return _CLASSES[base]


def add_expert_lora(model: Any, rank: int, alpha: float, seed: int, cfg: Any) -> list[str]:
    """Give every ``RoutedMoE`` of ``model`` per-expert LoRA factors of rank ``rank`` on ``wi_0``,
    ``wi_1`` and ``wo`` and switch it to :func:`expert_lora_class`; the module paths wrapped, '/'-joined.
    ValueError for a MoE layout this does not cover (prefused ``wi``, the TE MoE block)."""
    from maxtext.layers.moe import RoutedMoE

    if bool(getattr(cfg, "prefuse_moe_weights", False)) or bool(getattr(cfg, "te_moe_block", False)):
        raise ValueError(
            "spec.lora.targets: experts: the expert LoRA covers MaxText's wi_0/wi_1/wo expert weights, "
            "not prefuse_moe_weights or te_moe_block"
        )
    axis = int(cfg.param_scan_axis)
    wrapped: list[str] = []
    draws: list[FactorDraw] = []
    modules: list[Any] = []
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, RoutedMoE) or hasattr(module, "wi_0_lora_a"):
            continue
        name = "/".join(map(str, path))
        for w in EXPERT_WEIGHTS:
            kernel = getattr(module, w)
            value = kernel.get_value()
            k = value.ndim - 3  # scan axes inserted at param_scan_axis
            at = axis if k else 0
            scan = tuple(value.shape[at : at + k])
            e, d_in, d_out = tuple(value.shape[:at]) + tuple(value.shape[at + k :])
            a_shape = _insert((e, d_in, rank), at, scan)
            b_shape = _insert((e, rank, d_out), at, scan)
            kmeta = kernel.get_metadata()
            meta = {m: kmeta[m] for m in ("param_scan_axis", "partition_name") if m in kmeta}
            names = tuple(kmeta.get("sharding_names") or ())
            if len(names) == value.ndim:
                # the experts' and the scan axes keep their names (the delta is laid out on the mesh as
                # the weight is), the matrix axes are replicated; rljob.trainer.lora.lora_sharding_meta
                # keeps the experts' name (``lora_kept_axes``)
                experts_name = (tuple(names[:at]) + tuple(names[at + k :]))[0]
                keep = _insert((experts_name, None, None), at, names[at : at + k])
                meta |= {"sharding_names": keep, "out_sharding": keep, "lora_kept_axes": (0 if at else k,)}
            draws.append(
                FactorDraw(
                    module=module,
                    a_name=f"{w}_lora_a",
                    b_name=f"{w}_lora_b",
                    meta=meta,
                    salt=zlib.crc32(f"{name}/{w}".encode()),
                    a_shape=a_shape,
                    b_shape=b_shape,
                    dtype=str(value.dtype),
                    bound=float(np.sqrt(6.0 / d_in)),
                    sharding=replicated_on(value),
                )
            )
        modules.append(module)
        wrapped.append(name)
    create_factors(seed, draws)  # every factor by one program (rljob.trainer.lora.create_factors)
    for module in modules:
        module.expert_lora_scale = float(alpha) / float(rank)
        module.__class__ = expert_lora_class(type(module))
    return wrapped


def _insert(shape: tuple[Any, ...], at: int, scan: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(shape[:at]) + tuple(scan) + tuple(shape[at:])
