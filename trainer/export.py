"""Adapter export in the PEFT layout vLLM and peft load, published so that no reader sees half of one.

Layout under ``{storage.adapters}`` (gs:// or local):

  v{N}/adapter_model.safetensors   lora_A (r, in) and lora_B (out, r) per layer and projection, float32,
                                   Hugging Face names (``base_model.model.model.layers.{i}.self_attn.
                                   q_proj.lora_A.weight`` for llama/qwen3-style models)
  v{N}/adapter_config.json         peft_type LORA, r, lora_alpha, target_modules, base model
  LATEST                           the text ``N``, written last

Both files of ``v{N}`` are complete objects before LATEST names them; readers (the samplers' adapter
watchers, rljob.sampler.adapters) only follow LATEST, so they never see a partial version.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from rljob.trainer.storage import open_store
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "LATEST", "latest_version", "publish_adapter", "read_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LATEST = "LATEST"


def publish_adapter(
    adapters_uri: str, version: int, tensors: dict[str, np.ndarray], config: dict[str, Any]
) -> str:
    """Write ``v{version}/`` then point LATEST at it; returns the version's URI."""
    store = open_store(adapters_uri)
    prefix = f"v{version}"
    store.write(
        f"{prefix}/{ADAPTER_WEIGHTS}", st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()})
    )
    store.write(f"{prefix}/{ADAPTER_CONFIG}", json.dumps(config, indent=1, sort_keys=True).encode())
    store.write(LATEST, str(version).encode())
    return f"{store.uri}/{prefix}"


def latest_version(adapters_uri: str) -> int | None:
    """The version LATEST names (``N`` or ``vN``), or None before the first publish."""
    raw = open_store(adapters_uri).read(LATEST)
    if raw is None:
        return None
    return int(raw.decode().strip().lstrip("v"))


def read_adapter(adapters_uri: str, version: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, adapter_config) of ``v{version}``."""
    store = open_store(adapters_uri)
    weights = store.read(f"v{version}/{ADAPTER_WEIGHTS}")
    config = store.read(f"v{version}/{ADAPTER_CONFIG}")
    if weights is None or config is None:
        raise FileNotFoundError(f"{store.uri}/v{version}: adapter files missing")
    return dict(st_load(weights)), json.loads(config)
