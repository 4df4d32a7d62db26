"""Adapter export in the PEFT layout vLLM and peft load, published so that no reader sees half of one.

Layout under ``{storage.adapters}`` (gs:// or local):

  v{N}/adapter_model.safetensors   lora_A (r, in) and lora_B (out, r) per layer and projection, float32,
                                   Hugging Face names (``base_model.model.model.layers.{i}.self_attn.
                                   q_proj.lora_A.weight`` for Qwen3 and gpt-oss, ``...model.
                                   language_model.layers.{i}...`` for Qwen3.5 and Gemma 4:
                                   rljob.trainer.peft.HF_LAYERS_PREFIX)
  v{N}/adapter_config.json         peft_type LORA, r, lora_alpha, target_modules, base model
  LATEST                           the text ``N``, written last

Both files of ``v{N}`` are complete objects before LATEST names them; readers (the samplers' adapter
watchers, rljob.sampler.adapters) only follow LATEST, so they never see a partial version.

:class:`AdapterPublisher` runs the uploads off the training loop: one background thread, one publish
in flight; an export submitted while another is still queued (not yet started) replaces it (the
superseded version is never written, LATEST only moves forward); an upload error is raised at the next
``submit``/``check`` and at ``close``, which waits for the last export.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from rljob.common.storage import open_store
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LATEST",
    "AdapterPublisher",
    "PublishError",
    "latest_version",
    "publish_adapter",
    "read_adapter",
]

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


class PublishError(RuntimeError):
    """A background adapter upload failed (raised on the training thread at the next step or at exit)."""


PublishFn = Callable[[str, int, dict[str, np.ndarray], dict[str, Any]], str]


class AdapterPublisher:
    """Publishes adapters in a background thread: at most one in flight, a newer export supersedes a
    queued one, errors surface on the caller's thread, :meth:`close` waits for the last export."""

    def __init__(
        self, adapters_uri: str, config: dict[str, Any], publish: PublishFn = publish_adapter
    ) -> None:
        self.uri, self.config, self._publish = adapters_uri, config, publish
        self._cv = threading.Condition()
        self._queued: tuple[int, dict[str, np.ndarray]] | None = None
        self._busy = False
        self._stop = False
        self._error: tuple[int, BaseException] | None = None
        self.published: int | None = None  # newest version whose files and LATEST are written
        self.publish_seconds: float | None = None  # wall time of that upload
        self.superseded: list[int] = []
        self._thread = threading.Thread(target=self._work, name="adapter-publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, tensors: dict[str, np.ndarray]) -> None:
        """Queue ``v{version}`` (host arrays); returns at once. Raises a previous upload's error."""
        self.check()
        with self._cv:
            if self._stop:
                raise PublishError("adapter publisher is closed")
            if self._queued is not None:
                self.superseded.append(self._queued[0])
            self._queued = (version, tensors)
            self._cv.notify_all()

    def check(self) -> None:
        with self._cv:
            err, self._error = self._error, None
        if err is not None:
            raise PublishError(f"{self.uri}/v{err[0]}: adapter upload failed: {err[1]}") from err[1]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or in flight; False on timeout. Raises an upload error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queued is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(left)
            idle = self._queued is None and not self._busy
        self.check()
        return idle

    def close(self, timeout: float | None = None) -> None:
        """Publish what is queued, then stop the thread (raises an upload error)."""
        try:
            self.flush(timeout)
        finally:
            with self._cv:
                self._stop = True
                self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while self._queued is None and not self._stop:
                    self._cv.wait()
                if self._queued is None:
                    return
                (version, tensors), self._queued = self._queued, None
                self._busy = True
            t0 = time.monotonic()
            try:
                self._publish(self.uri, version, tensors, self.config)
            except BaseException as e:  # surfaced on the training thread
                with self._cv:
                    if self._error is None:  # the first failure is the one reported
                        self._error = (version, e)
            else:
                with self._cv:
                    self.published, self.publish_seconds = version, time.monotonic() - t0
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
