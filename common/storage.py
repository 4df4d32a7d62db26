"""Run storage: small objects under ``gs://`` (google-cloud-storage) or a local directory, one API.

On GCP the clients find credentials the usual way (Workload Identity in a pod); against the emulator
they read ``STORAGE_EMULATOR_HOST`` (tests/fixtures/gcs.py) and go anonymous, exactly as google-cloud-
storage does. Local paths (laptop runs) use the filesystem with write-to-temp-then-rename, so a reader
never sees a half-written object on either backend (a GCS object appears whole when its upload ends).

  store = open_store("gs://bucket/ns/job/rollouts")     # or "/tmp/run/rollouts"
  store.write("step-00000003.npz", data); store.read("step-00000003.npz") -> bytes | None
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Protocol

from rljob.recipes.runconfig import split_gs

__all__ = ["GcsStore", "LocalStore", "Store", "join", "open_store"]


class Store(Protocol):
    uri: str

    def write(self, key: str, data: bytes) -> None: ...
    def read(self, key: str) -> bytes | None: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, key: str) -> None: ...


def join(root: str, *parts: str) -> str:
    """Join a gs:// or local root with relative parts using '/'."""
    out = root.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


class GcsStore:
    """Objects under ``gs://bucket/prefix`` through google-cloud-storage."""

    def __init__(self, uri: str) -> None:
        from google.cloud import storage  # type: ignore[import-untyped]

        self.uri = uri.rstrip("/")
        bucket, self._prefix = split_gs(self.uri)
        self._client = storage.Client()
        self._bucket = self._client.bucket(bucket)

    def _name(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def write(self, key: str, data: bytes) -> None:
        self._bucket.blob(self._name(key)).upload_from_string(data)

    def read(self, key: str) -> bytes | None:
        from google.api_core import exceptions

        try:
            return bytes(self._bucket.blob(self._name(key)).download_as_bytes())
        except exceptions.NotFound:
            return None

    def exists(self, key: str) -> bool:
        return bool(self._bucket.blob(self._name(key)).exists())

    def list(self, prefix: str = "") -> list[str]:
        base = self._name("")
        blobs = self._client.list_blobs(self._bucket, prefix=self._name(prefix))
        return sorted(b.name[len(base) :] for b in blobs)

    def delete(self, key: str) -> None:
        from google.api_core import exceptions

        with contextlib.suppress(exceptions.NotFound):
            self._bucket.blob(self._name(key)).delete()


class LocalStore:
    """Objects as files under a local directory (atomic: temp file, fsync, rename)."""

    def __init__(self, root: str) -> None:
        self.uri = root.rstrip("/")
        self._root = Path(self.uri)

    def write(self, key: str, data: bytes) -> None:
        path = self._root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read(self, key: str) -> bytes | None:
        try:
            return (self._root / key).read_bytes()
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return (self._root / key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        if not self._root.is_dir():
            return []
        out = []
        for p in self._root.rglob("*"):
            rel = p.relative_to(self._root).as_posix()
            if p.is_file() and rel.startswith(prefix) and not p.name.startswith("."):
                out.append(rel)
        return sorted(out)

    def delete(self, key: str) -> None:
        (self._root / key).unlink(missing_ok=True)


def open_store(uri: str) -> Store:
    """A :class:`GcsStore` for ``gs://`` URIs, else a :class:`LocalStore`."""
    return GcsStore(uri) if uri.startswith("gs://") else LocalStore(uri)
