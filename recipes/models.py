"""Facts about the catalog's models that the sampler plan checks its parallelism against.

``num_kv_heads`` and ``num_experts`` are MaxText 0.2.5's own values (``base_num_kv_heads``,
``num_experts`` in ``maxtext/configs/models/<maxtextModel>.yml``; tests/recipes/test_models.py reads the
installed MaxText and compares). A model outside this table is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFacts:
    num_kv_heads: int
    num_experts: int = 0  # 0: a dense model


# Keyed by spec.model.maxtextModel.
MODELS: dict[str, ModelFacts] = {
    "qwen3-0.6b": ModelFacts(num_kv_heads=8),
    "qwen3-8b": ModelFacts(num_kv_heads=8),
    "gemma4-31b": ModelFacts(num_kv_heads=16),
    "gpt-oss-20b": ModelFacts(num_kv_heads=8, num_experts=32),
    "qwen3.5-397b-a17b": ModelFacts(num_kv_heads=2, num_experts=512),
}


def facts(maxtext_model: str | None) -> ModelFacts | None:
    return MODELS.get(maxtext_model or "")


__all__ = ["MODELS", "ModelFacts", "facts"]
