"""Run storage: objects under ``gs://`` (google-cloud-storage) or a local directory, one API.

Every reader and writer of a run's storage (adapters and LATEST, rollouts, caches, the progress file,
the Tinker service's state, TensorBoard events) goes through :func:`open_store`; nothing else in rljob
talks to google-cloud-storage. On GCP the client finds credentials the usual way (Workload Identity in a
pod); against the emulator it reads ``STORAGE_EMULATOR_HOST`` (tests/fixtures/gcs.py) and goes
anonymous, exactly as google-cloud-storage does. Local paths (laptop runs) use the filesystem with
write-to-temp-then-rename, so a reader never sees a half-written object on either backend (a GCS object
appears whole when its upload ends).

Keys are contained: a key (or a downloaded object's name below its prefix) that is absolute or has a
``..`` segment is refused with :class:`StorageError` before anything is read or written, so no object
name, however it was written, reaches outside the store's root or a download's ``dest``.

Errors are the backend's own for a local directory (``OSError``); GCS errors become
:class:`StorageError` (an ``OSError``), :class:`StorageDenied` for access the run will never get and
:class:`NoCredentials` when google-auth finds no credentials, so callers need no google import.

  store = open_store("gs://bucket/ns/job/rollouts")     # or "/tmp/run/rollouts"
  store.write("step-00000003.npz", data); store.read("step-00000003.npz") -> bytes | None
  store.list("v3/") -> ["v3/adapter_config.json", ...]; store.download("v3/", Path("/tmp/v3"))
"""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from rljob.recipes.runconfig import split_gs

__all__ = [
    "GcsStore",
    "LocalStore",
    "NoCredentials",
    "StorageDenied",
    "StorageError",
    "Store",
    "contained",
    "join",
    "open_store",
]

# Objects at least this large are downloaded from GCS in parallel ranged reads.
CHUNKED_DOWNLOAD_BYTES = 32 * 1024 * 1024
CHUNK_BYTES = 16 * 1024 * 1024


class StorageError(OSError):
    """A storage request failed (GCS: the google.api_core error is its ``__cause__``)."""


class StorageDenied(StorageError):
    """Access the run will never get: a bad request (bucket name), no permission, no authorization."""


class NoCredentials(StorageError):
    """google-auth found no credentials for ``gs://`` storage."""


class Store(Protocol):
    uri: str

    def write(self, key: str, data: bytes) -> None: ...
    def read(self, key: str) -> bytes | None: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def download(self, prefix: str, dest: Path, *, workers: int = 8) -> builtins.list[str]: ...


def contained(key: str, what: str = "key") -> str:
    """``key`` when it stays below its root: not absolute, no ``..`` segment; else StorageError."""
    if key.startswith("/") or ".." in key.split("/"):
        raise StorageError(f"{what} {key!r}: leads outside its folder (absolute, or a '..' segment)")
    return key


def join(root: str, *parts: str) -> str:
    """Join a gs:// or local root with relative parts using '/'."""
    out = root.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


@contextlib.contextmanager
def _gcs_errors() -> Iterator[None]:
    """google-auth and google.api_core errors as :class:`StorageError` (same message, chained)."""
    from google.api_core import exceptions as gexc
    from google.auth import exceptions as gauth

    try:
        yield
    except gauth.DefaultCredentialsError as e:
        raise NoCredentials(str(e)) from e
    except (gexc.Forbidden, gexc.Unauthorized, gexc.BadRequest) as e:
        raise StorageDenied(str(e)) from e
    except gexc.GoogleAPIError as e:
        raise StorageError(str(e)) from e


class GcsStore:
    """Objects under ``gs://bucket/prefix`` through google-cloud-storage."""

    def __init__(self, uri: str) -> None:
        from google.cloud import storage  # type: ignore[import-untyped]

        self.uri = uri.rstrip("/")
        bucket, self._prefix = split_gs(self.uri)
        with _gcs_errors():
            self._client = storage.Client()
        self._bucket = self._client.bucket(bucket)

    def _name(self, key: str) -> str:
        contained(key)
        return f"{self._prefix}/{key}" if self._prefix else key

    def _blobs(self, prefix: str) -> list[Any]:
        """The objects under ``prefix``, name order, without folder placeholders (names ending in /)."""
        blobs = self._client.list_blobs(self._bucket, prefix=self._name(prefix))
        return sorted((b for b in blobs if not b.name.endswith("/")), key=lambda b: b.name)

    def write(self, key: str, data: bytes) -> None:
        with _gcs_errors():
            self._bucket.blob(self._name(key)).upload_from_string(data)

    def read(self, key: str) -> bytes | None:
        from google.api_core import exceptions

        with _gcs_errors():
            try:
                return bytes(self._bucket.blob(self._name(key)).download_as_bytes())
            except exceptions.NotFound:
                return None

    def exists(self, key: str) -> bool:
        with _gcs_errors():
            return bool(self._bucket.blob(self._name(key)).exists())

    def list(self, prefix: str = "") -> list[str]:
        base = len(self._name(""))
        with _gcs_errors():
            return [b.name[base:] for b in self._blobs(prefix)]

    def delete(self, key: str) -> None:
        from google.api_core import exceptions

        with _gcs_errors(), contextlib.suppress(exceptions.NotFound):
            self._bucket.blob(self._name(key)).delete()

    def download(self, prefix: str, dest: Path, *, workers: int = 8) -> builtins.list[str]:
        """Copy the objects under ``prefix`` to ``dest``/<key after prefix>; large objects in parallel
        ranged reads (``workers`` threads). Returns the keys copied."""
        from google.cloud.storage import transfer_manager  # type: ignore[import-untyped]

        base = len(self._name(""))
        keys = []
        with _gcs_errors():
            for blob in self._blobs(prefix):
                key = blob.name[base:]
                # An object named with a '..' segment (any writer of the bucket can make one) is refused:
                # dest / "../x" would write outside dest.
                target = dest / contained(key[len(prefix) :], f"object {blob.name!r} below {prefix!r}:")
                target.parent.mkdir(parents=True, exist_ok=True)
                if (blob.size or 0) > CHUNKED_DOWNLOAD_BYTES:
                    transfer_manager.download_chunks_concurrently(
                        blob,
                        str(target),
                        chunk_size=CHUNK_BYTES,
                        max_workers=workers,
                        worker_type=transfer_manager.THREAD,
                    )
                else:
                    blob.download_to_filename(str(target))
                keys.append(key)
        return keys


class LocalStore:
    """Objects as files under a local directory (atomic: temp file, fsync, rename)."""

    def __init__(self, root: str) -> None:
        self.uri = root.rstrip("/")
        self._root = Path(self.uri)

    def _path(self, key: str) -> Path:
        return self._root / contained(key)

    def write(self, key: str, data: bytes) -> None:
        path = self._path(key)
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
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

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
        self._path(key).unlink(missing_ok=True)

    def download(self, prefix: str, dest: Path, *, workers: int = 8) -> builtins.list[str]:
        """Copy the files under ``prefix`` to ``dest``/<key after prefix> (``workers`` is GCS's)."""
        keys = self.list(contained(prefix, "prefix"))
        for key in keys:
            target = dest / contained(key[len(prefix) :], f"file {key!r} below {prefix!r}:")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self._root / key, target)
        return keys


def open_store(uri: str) -> Store:
    """A :class:`GcsStore` for ``gs://`` URIs, else a :class:`LocalStore`."""
    return GcsStore(uri) if uri.startswith("gs://") else LocalStore(uri)
