"""The service's state on storage (``{storage.checkpoints}/tinker``; ``{model}`` is storage_key(model id)).

- ``registry.json``: the live training models, with their sessions and owners (rewritten when a model is
  created, loaded or unloaded: at most spec.service.maxTrainingClients entries);
- ``sessions/{session}.json``: one object per live client session with its owner, written when the
  session is created and deleted when it ends or expires (constant work per session; a registry.json of an
  older version, which listed sessions, is still read);
- ``sampling/{sampler}.json``: one object per sampling session, deleted when it is dropped;
- ``{model}/checkpoints.json``: the index of a model's save_state and sampler checkpoints that RestClient
  lists (with the owner), next to the model's ``auto/`` and ``weights/{name}`` states.

Sampler weights are PEFT directories under ``{storage.adapters}/tinker/{model}/{name}/{digest}``.
"""

from __future__ import annotations

import json
from typing import Any

from rljob.common.storage import join, open_store
from rljob.trainer.tinker.server.auth import storage_key

__all__ = ["CHECKPOINTS_INDEX", "REGISTRY", "SAMPLING_DIR", "SESSIONS_DIR", "State"]

REGISTRY = "registry.json"
CHECKPOINTS_INDEX = "checkpoints.json"
SAMPLING_DIR = "sampling"
SESSIONS_DIR = "sessions"


class State:
    """Reads and writes of the service's objects (any thread; the callers order writes of one object)."""

    def __init__(self, checkpoints: str, adapters: str) -> None:
        self.root = join(checkpoints, "tinker")
        self.adapters = join(adapters, "tinker")

    def _store(self, *parts: str) -> Any:
        return open_store(join(self.root, *parts))

    # ------------------------------------------------------------------ registry (models)

    def write_registry(self, models: dict[str, Any]) -> None:
        self._store().write(REGISTRY, json.dumps({"models": models}, indent=1).encode())

    def read_registry(self) -> dict[str, Any]:
        raw = self._store().read(REGISTRY)
        return json.loads(raw) if raw is not None else {}

    # ------------------------------------------------------------------ sessions, sampling sessions

    def put_session(self, sid: str, owner: str) -> None:
        self._store(SESSIONS_DIR).write(
            f"{storage_key(sid)}.json", json.dumps({"id": sid, "owner": owner}).encode()
        )

    def drop_session(self, sid: str) -> None:
        self._store(SESSIONS_DIR).delete(f"{storage_key(sid)}.json")

    def sessions(self) -> dict[str, str]:
        """Session id -> owner of every session on storage (a legacy registry's too)."""
        out = {str(k): str(v) for k, v in self.read_registry().get("sessions", {}).items()}
        store = self._store(SESSIONS_DIR)
        for k in store.list():
            body = store.read(k)
            if body is not None:
                obj = json.loads(body)
                out[str(obj["id"])] = str(obj.get("owner", ""))
        return out

    def put_sampling(self, sampler_id: str, obj: dict[str, Any]) -> None:
        self._store(SAMPLING_DIR).write(f"{storage_key(sampler_id)}.json", json.dumps(obj).encode())

    def drop_sampling(self, sampler_ids: list[str]) -> None:
        if sampler_ids:
            store = self._store(SAMPLING_DIR)
            for sid in sampler_ids:
                store.delete(f"{storage_key(sid)}.json")

    def sampling(self) -> list[dict[str, Any]]:
        store = self._store(SAMPLING_DIR)
        out = []
        for k in store.list():
            body = store.read(k)
            if body is not None:
                out.append(json.loads(body))
        return out

    # ------------------------------------------------------------------ models' folders and indexes

    def model_dir(self, model_id: str, *parts: str) -> str:
        return join(self.root, storage_key(model_id), *parts)

    def sampler_dir(self, model_id: str, name: str) -> str:
        """The folder of a name's sampler weights; each saved version is a PEFT directory below it."""
        return join(self.adapters, storage_key(model_id), name)

    def index(self, model_id: str) -> dict[str, Any]:
        """``{checkpoint_id: entry}`` of a model's save_state and sampler weights (CHECKPOINTS_INDEX)."""
        raw = self._store(storage_key(model_id)).read(CHECKPOINTS_INDEX)
        return json.loads(raw) if raw else {}

    def write_index(self, model_id: str, index: dict[str, Any]) -> None:
        self._store(storage_key(model_id)).write(CHECKPOINTS_INDEX, json.dumps(index, indent=1).encode())
