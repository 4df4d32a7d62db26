"""Warm start from a PEFT adapter (spec.lora.initFrom): the LoRA factors a run without a checkpoint starts
from, read from gs:// or a local directory through the run's Store and mapped into the trainer's LoRA state
by the inverse of the adapter export's name map (rljob.trainer.peft: ``PeftAdapter.from_files``)."""

from __future__ import annotations

from typing import Any

from rljob.common.storage import open_store
from rljob.trainer.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def load_adapter(uri: str, peft: Any) -> Any:
    """The LoRA state of the PEFT adapter directory ``uri``; ValueError naming spec.lora.initFrom when it is
    missing, unreadable or not this run's adapter shape (the loop exits 2)."""
    where = f"spec.lora.initFrom: {uri}"
    try:
        store = open_store(uri)
        config, weights = store.read(ADAPTER_CONFIG), store.read(ADAPTER_WEIGHTS)
    except OSError as e:  # StorageError is one
        raise ValueError(f"{where}: not readable: {e}") from None
    missing = [name for name, data in ((ADAPTER_CONFIG, config), (ADAPTER_WEIGHTS, weights)) if data is None]
    if missing:
        raise ValueError(f"{where}: no {', '.join(missing)} there")
    assert config is not None and weights is not None
    return peft.from_files(config, weights, where)


__all__ = ["load_adapter"]
