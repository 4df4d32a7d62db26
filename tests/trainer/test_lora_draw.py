"""LoRA's factors are created by one program (rljob.trainer.lora.add_lora_params): every projection's
``lora_a`` drawn he_uniform from the run's key folded with the CRC-32 of its module path, ``lora_b``
zero. On a TPU each program a process compiles at start is seconds (a program per factor shape was 4.6 s
of a v5e's start for Qwen3-0.6B), so the count of compiles is asserted, and the values against a draw
per factor."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest
from fixtures.jax_compiles import backend_compiles

pytestmark = pytest.mark.jax


def _fresh_model() -> tuple[Any, Any, Any]:
    from rljob.trainer.model import ModelSpec, build_model, maxtext_config

    spec = ModelSpec.tiny(lora_rank=8, lora_alpha=16.0)
    cfg = maxtext_config(spec.maxtext)
    return spec, cfg, build_model(cfg, spec.seed)


def _factors(model: Any) -> dict[str, tuple[Any, Any]]:
    from flax import nnx

    return {
        "/".join(map(str, path)): (m.kernel_lora_a.get_value(), m.kernel_lora_b.get_value())  # type: ignore[attr-defined]
        for path, m in nnx.iter_modules(model)
        if hasattr(m, "kernel_lora_a")
    }


@pytest.mark.parametrize("seed", [1000, 2**40 + 7])
def test_every_factor_comes_from_one_program_with_the_per_factor_values(seed: int) -> None:
    import jax
    from rljob.trainer.lora import add_lora_params
    from rljob.trainer.model import lora_module_path

    spec, cfg, model = _fresh_model()
    assert not _factors(model)
    with backend_compiles() as compiled:
        add_lora_params(model, lora_module_path(spec), spec.lora_rank, seed, cfg)
    assert [name for name, _ in compiled] == ["jit(draw)"], compiled

    factors = _factors(model)
    # Every targeted projection of the tiny model (attention and MLP) got factors.
    assert {name.rsplit("/", 1)[-1] for name in factors} >= {"query", "key", "value", "out", "wi_0", "wo"}
    key = jax.random.key(seed)
    for name, (a, b) in factors.items():
        # [fan_in, (layers,) r] with the scan axis at 1, [(layers,) fan_in, r] at 0.
        fan_in = a.shape[-2] if a.ndim == 2 or int(cfg.param_scan_axis) == 0 else a.shape[0]
        bound = float(np.sqrt(6.0 / fan_in))
        want = jax.random.uniform(
            jax.random.fold_in(key, zlib.crc32(name.encode())), a.shape, a.dtype, -bound, bound
        )
        np.testing.assert_array_equal(np.asarray(a), np.asarray(want), err_msg=name)
        assert np.abs(np.asarray(a, np.float32)).max() <= bound, name
        assert b.dtype == a.dtype and not np.asarray(b).any(), name
    # Distinct projections draw distinct values (the salt is the path, not the shape).
    firsts = [float(np.asarray(a).ravel()[0]) for a, _ in factors.values()]
    assert len(set(firsts)) == len(firsts)


def test_the_routed_experts_factors_come_from_one_program_with_the_per_factor_values() -> None:
    """rljob.trainer.expert_lora's per-expert factors (the LoRA target ``experts``) likewise: one
    program for every MoE layer's wi_0 / wi_1 / wo factors, A from the key folded with its path."""
    import jax
    from flax import nnx
    from rljob.recipes import miniature
    from rljob.trainer.expert_lora import EXPERT_WEIGHTS, add_expert_lora
    from rljob.trainer.model import CPU_KEYS, build_model, maxtext_config

    model_name, seed = "qwen3-30b-a3b", 2000
    keys = {"model_name": model_name, **miniature.miniature_overrides(model_name), **CPU_KEYS}
    cfg = maxtext_config({**keys, "max_target_length": 32})
    model = build_model(cfg, 0)
    with backend_compiles() as compiled:
        wrapped = add_expert_lora(model, 4, 8.0, seed, cfg)
    assert wrapped and [name for name, _ in compiled] == ["jit(draw)"], (wrapped, compiled)

    key = jax.random.key(seed)
    modules: dict[str, Any] = {"/".join(map(str, p)): m for p, m in nnx.iter_modules(model)}
    for name in wrapped:
        module = modules[name]
        assert module.expert_lora_scale == 2.0
        for w in EXPERT_WEIGHTS:
            a = getattr(module, f"{w}_lora_a").get_value()
            b = getattr(module, f"{w}_lora_b").get_value()
            bound = float(np.sqrt(6.0 / a.shape[-2]))  # [.., in, r] whatever the scan axis
            want = jax.random.uniform(
                jax.random.fold_in(key, zlib.crc32(f"{name}/{w}".encode())), a.shape, a.dtype, -bound, bound
            )
            np.testing.assert_array_equal(np.asarray(a), np.asarray(want), err_msg=f"{name}/{w}")
            assert not np.asarray(b).any()
