"""The LoRA factors of the trainer's model, created before qwix wraps it (:func:`add_lora_params`, as
qwix's LoraProvider would create them in its first call), and their sharding metadata
(:func:`lora_sharding_meta`: the scan axis named, the rest replicated).
:class:`rljob.trainer.model.Policy` uses both; the PEFT layout of the factors is rljob.trainer.peft.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["FactorDraw", "add_lora_params", "create_factors", "lora_sharding_meta", "replicated_on"]


def lora_sharding_meta(var: Any) -> Any:
    """qwix copies the base kernel's logical axis names onto its LoRA factors, whose rank differs
    (a [embed, layers, heads, head_dim] kernel gives a [embed, layers, r] lora_a): MaxText's scan then
    refuses the metadata. LoRA factors are small: keep only the scan axis name, replicate the rest."""
    if not isinstance(var, nnx.Variable):
        return var
    meta = var.get_metadata()
    axis_name = meta.get(nnx.PARTITION_NAME, "layers")
    scan_axis = meta.get("param_scan_axis", 1)
    # An expert LoRA factor (rljob.trainer.expert_lora) also keeps its experts axis's name.
    kept = set(meta.get("lora_kept_axes", ()))
    old = tuple(meta.get("sharding_names") or meta.get("out_sharding") or ())
    names = tuple(
        axis_name if i == scan_axis else (old[i] if i in kept and i < len(old) else None)
        for i in range(var.get_value().ndim)
    )
    updates = {k: names for k in ("out_sharding", "sharding_names", "sharding") if meta.get(k) is not None}
    return var.replace(**updates) if updates else var


def add_lora_params(model: Any, module_path: str, rank: int, seed: int, cfg: Any) -> None:
    """Create the LoRA factors of every projection of ``model`` whose module path matches
    ``module_path`` (a qwix rule's regex, matched as qwix matches it: re.fullmatch on the '/'-joined
    path), as qwix's LoraProvider would create them in its first call (qwix 0.1.8 providers/lora.py):
    ``kernel_lora_a`` [prod(in), r] drawn he_uniform (bound sqrt(6 / prod(in))) per layer,
    ``kernel_lora_b`` [r, prod(out)] zero, in the kernel's dtype, stacked on the kernel's scan axes.
    qwix then finds them (flax_util.get_or_create_param) and creates none during a scan.

    Every factor is drawn by one program (:func:`create_factors`): a program per factor shape was a
    compile each on every process's start (4.6 s of a TPU v5e's start for Qwen3-0.6B's projections)."""
    from maxtext.layers.linears import DenseGeneral

    pattern = re.compile(module_path)
    axis = int(cfg.param_scan_axis)
    draws: list[FactorDraw] = []
    for path, module in nnx.iter_modules(model):
        name = "/".join(map(str, path))
        if (
            not isinstance(module, DenseGeneral)
            or not pattern.fullmatch(name)
            or hasattr(module, "kernel_lora_a")
        ):
            continue
        kernel = module.kernel
        value = kernel.get_value()
        n_in, n_out = len(module.in_features_shape), len(module.out_features_shape)
        k = value.ndim - n_in - n_out
        at = axis if k else 0
        scan = tuple(value.shape[at : at + k])
        per = tuple(value.shape[:at]) + tuple(value.shape[at + k :])
        fan_in, fan_out = int(np.prod(per[:n_in])), int(np.prod(per[n_in:]))
        # Metadata as the kernel's: the scan axes keep their names (MaxText's scans move and strip them),
        # the matrix axes are replicated (LoRA factors are small; lora_sharding_meta says the same).
        kmeta = kernel.get_metadata()
        meta = {k2: kmeta[k2] for k2 in ("param_scan_axis", "partition_name") if k2 in kmeta}
        names = tuple(kmeta.get("sharding_names") or ())
        if len(names) == value.ndim:
            sharding = (None,) * at + names[at : at + k] + (None,) * (2 - at)
            meta |= {"sharding_names": sharding, "out_sharding": sharding}
        draws.append(
            FactorDraw(
                module=module,
                a_name="kernel_lora_a",
                b_name="kernel_lora_b",
                meta=meta,
                salt=zlib.crc32(name.encode()),
                a_shape=(fan_in, rank)[:at] + scan + (fan_in, rank)[at:],
                b_shape=(rank, fan_out)[:at] + scan + (rank, fan_out)[at:],
                dtype=str(value.dtype),
                bound=float(np.sqrt(6.0 / fan_in)),
                sharding=replicated_on(value),
            )
        )
    create_factors(seed, draws)


def replicated_on(value: Any) -> NamedSharding | None:
    """Replicated on the mesh of ``value``'s NamedSharding; None where it has none (one device)."""
    sharding = getattr(value, "sharding", None)
    return NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None  # type: ignore[no-untyped-call]


@dataclasses.dataclass(frozen=True)
class FactorDraw:
    """One pair of LoRA factors to create as ``module.<a_name>`` and ``module.<b_name>`` (nnx.LoRAParam
    with ``meta``): A drawn uniform in [-bound, bound] from the run's key folded with ``salt`` (the
    CRC-32 of the factor's path), B zero; created replicated on ``sharding``'s mesh."""

    module: Any
    a_name: str
    b_name: str
    meta: dict[str, Any]
    salt: int
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    dtype: str
    bound: float
    sharding: NamedSharding | None


def create_factors(seed: int, draws: list[FactorDraw]) -> None:
    """Create every factor pair of ``draws`` on its module, all drawn by one jitted program per output
    placement (one in practice: the model's mesh), replicated on that mesh (on every process of a
    multi-process run, as the base weights are: never one process's local array). The values are those
    of a draw per factor: ``uniform(fold_in(key(seed), salt), a_shape, dtype, -bound, bound)``; a
    program per factor shape is a compile each on every process's start (seconds each on a TPU)."""
    groups: dict[NamedSharding | None, list[FactorDraw]] = {}
    for d in draws:
        groups.setdefault(d.sharding, []).append(d)
    for sharding, group in groups.items():

        def draw(group: list[FactorDraw] = group) -> list[tuple[jax.Array, jax.Array]]:
            key = jax.random.key(seed)  # a constant of the program: any int, as jax.random.key takes it
            return [
                (
                    jax.random.uniform(
                        jax.random.fold_in(key, d.salt), d.a_shape, d.dtype, -d.bound, d.bound
                    ),
                    jnp.zeros(d.b_shape, d.dtype),
                )
                for d in group
            ]

        fn = jax.jit(draw) if sharding is None else jax.jit(draw, out_shardings=sharding)
        for d, (a, b) in zip(group, fn(), strict=True):
            setattr(d.module, d.a_name, nnx.LoRAParam(a, **d.meta))
            setattr(d.module, d.b_name, nnx.LoRAParam(b, **d.meta))
