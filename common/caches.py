"""Caches that make a restart cheap: kept under ``storage.cache`` (``{root}/.../cache/<name>/``), restored
to the pod's local disk before start, and seeded back while the process runs.

A preempted slice's replacement should not compute again what the last one already had: XLA's
compilations (a fresh compile of a large model takes far longer than copying its cache) and the
sampler's model download. Each cache is a directory of files copied whole between storage and local
disk (``$RLJOB_LOCAL_CACHE``), never read through a mount; a file already on local disk is not copied
again (files are renamed into place once complete), and only files storage lacks are written back, so
every process can seed the same cache.

- ``jax-trainer`` / ``jax-sampler``: JAX's persistent compilation cache (``jax_compilation_cache_dir``,
  https://docs.jax.dev/en/latest/persistent_compilation_cache.html), one per role, set by
  :func:`jax_compilation_cache` through the caller's ``jax.config.update`` (this package imports no JAX);
  the vLLM sampler's is tpu-inference's ``VLLM_XLA_CACHE_PATH``;
- ``hf``: vLLM's ``--download-dir`` (the Hugging Face weights the sampler serves).

Each restore prints one line: what was restored, how much and how long it took.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.common.storage import join, open_store
from rljob.recipes.runconfig import LOCAL_CACHE_DEFAULT, LOCAL_CACHE_ENV

log = logging.getLogger("rljob.caches")

MAXTEXT_CACHE_ENV = "M_JAX_CACHE_DIR"
JAX_TRAINER = "jax-trainer"
JAX_SAMPLER = "jax-sampler"
HF = "hf"


def local_root() -> Path:
    """The pod's (or laptop's) local disk for the caches ($RLJOB_LOCAL_CACHE)."""
    return Path(os.environ.get(LOCAL_CACHE_ENV) or LOCAL_CACHE_DEFAULT)


@dataclass(frozen=True)
class Restored:
    name: str
    uri: str
    files: int  # copied from storage
    present: int  # already on local disk
    bytes: int
    seconds: float

    def line(self) -> str:
        if not self.files and not self.present:
            return f"cache {self.name}: nothing at {self.uri} yet (first start), {self.seconds:.2f}s"
        return (
            f"cache {self.name}: restored {self.files} files ({self.bytes / 1e6:.1f} MB) from {self.uri} in "
            f"{self.seconds:.2f}s ({self.present} already on local disk)"
        )


def restore(name: str, uri: str, local: Path) -> Restored:
    """Copy the files of the cache at ``uri`` that ``local`` lacks (or holds at another size) to ``local``."""
    t0 = time.monotonic()
    store = open_store(uri)
    local.mkdir(parents=True, exist_ok=True)
    files = present = size = 0
    for key in store.list():
        dest = local / key
        if dest.is_file():  # complete: files are only ever renamed into place
            present += 1
            continue
        data = store.read(key)
        if data is None:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".rljob-partial")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        files, size = files + 1, size + len(data)
    return Restored(name, uri, files, present, size, time.monotonic() - t0)


def save(uri: str, local: Path) -> int:
    """Write to the cache at ``uri`` the regular files of ``local`` it lacks (not symlinks); the number
    written."""
    if not local.is_dir():
        return 0
    store = open_store(uri)
    have = set(store.list())
    written = 0
    for p in sorted(local.rglob("*")):
        key = p.relative_to(local).as_posix()
        # A symlink is not saved: the Hugging Face cache that vLLM's --download-dir holds links each
        # snapshot file to its blob (huggingface_hub's cache layout), and saving both would restore the
        # weights twice over on the next host. The download recreates the links from the restored blobs.
        if p.is_symlink():
            continue
        if p.is_file() and key not in have and not key.endswith(".rljob-partial"):
            store.write(key, p.read_bytes())
            written += 1
    return written


class LoadGuard:
    """Whether a cache's entries may be loaded by this process, across its restarts: a process that dies
    while it loads its programs from a restored cache (a TPU runtime can abort the whole process on a bad
    entry: seen on a v5e, docs/drill.md "Zero-compile start") would die the same way at every restart, a
    crash loop that no log explains. Before loading, the process writes ``loading-<process>`` beside the
    cache (``<cache>-guard/`` in storage); once its programs ran (:meth:`CacheSync.loaded`) it deletes it.
    A restart that finds the marker of an attempt that restored files writes ``off`` with the reason: the
    run compiles without that cache from then on (slower restarts, never a loop). An attempt that restored
    nothing loaded nothing, so its marker does not count (a first start preempted while it compiles)."""

    def __init__(self, uri: str, process: int) -> None:
        self.store, self.key = open_store(uri), f"loading-{process}"

    def refusal(self) -> str | None:
        """Why this process must not load the cache (``None``: it may)."""
        off = self.store.read("off")
        if off is not None:
            return off.decode(errors="replace")
        last = self.store.read(self.key)
        if last is None or not last.strip().startswith(b"restored ") or last.split()[1] == b"0":
            return None
        why = (
            f"an earlier attempt died before its first step while loading programs from this cache "
            f"({last.decode(errors='replace').strip()}): this run compiles without it"
        )
        self.store.write("off", why.encode())
        return why

    def arm(self, restored: int) -> None:
        self.store.write(self.key, f"restored {restored} files at {time.time():.0f}\n".encode())

    def disarm(self) -> None:
        self.store.delete(self.key)


class CacheSync:
    """Restore a cache now; write new local files back every ``every_s`` seconds and at ``close``."""

    def __init__(self, name: str, cache_root: str, local_root: Path, every_s: float = 120.0) -> None:
        self.name, self.uri, self.local = name, join(cache_root, name), local_root / name
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.restored: Restored | None = None
        self.guard: LoadGuard | None = None
        self.disabled = False

    def loaded(self) -> None:
        """The process's programs ran: its cache loads do not kill it (:class:`LoadGuard`)."""
        if self.guard is not None:
            self.guard.disarm()
            self.guard = None

    def restore(self) -> Restored:
        self.restored = restore(self.name, self.uri, self.local)
        print(self.restored.line(), file=sys.stderr, flush=True)
        return self.restored

    def start(self) -> CacheSync:
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"cache-{self.name}")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.flush()

    def flush(self) -> int:
        if self.disabled:
            return 0
        try:
            n = save(self.uri, self.local)
        except Exception as e:
            log.warning("cache %s: not saved (%s)", self.name, e)
            return 0
        if n:
            log.warning("cache %s: %d new files saved to %s", self.name, n, self.uri)
        return n

    def close(self) -> int:
        """At the process's orderly end (a Python exception included: only an abort skips it)."""
        self._stop.set()
        self.loaded()
        return self.flush()


JaxConfigUpdate = Callable[[str, Any], None]


def jax_compilation_cache(
    name: str,
    cache_root: str,
    local_root: Path,
    update: JaxConfigUpdate,
    maxtext_keys: Mapping[str, object] | None = None,
    guard_process: int | None = None,
) -> CacheSync:
    """Restore the JAX compilation cache ``name`` and point this process's JAX at it (every compilation
    is cached, also the CPU path's short ones); the caller closes the returned sync at exit.

    ``guard_process``: this process's index, for a caller that calls :meth:`CacheSync.loaded` once its
    programs ran (:class:`LoadGuard`); a cache that killed an earlier attempt of it is then not used.
    ``update`` is the caller's ``jax.config.update``: rljob.common imports no JAX (docs/architecture.md)."""
    sync = CacheSync(name, cache_root, local_root)
    if guard_process is not None:
        guard = LoadGuard(join(cache_root, name + "-guard"), guard_process)
        why = guard.refusal()
        if why is not None:
            print(f"cache {name}: not used: {why}", file=sys.stderr, flush=True)
            update("jax_enable_compilation_cache", False)
            sync.disabled = True
            return sync
        restored = sync.restore()
        guard.arm(restored.files + restored.present)
        sync.guard = guard
    else:
        sync.restore()
    update("jax_compilation_cache_dir", str(sync.local))
    # MaxText points JAX's cache at its own jax_cache_dir (default ~/jax_cache) whenever it builds a
    # config (maxtext/configs/pyconfig.py); its M_<KEY> environment override keeps it on this one.
    # (A run that sets jax_cache_dir itself keeps it: MaxText refuses a key set both ways.)
    if "jax_cache_dir" not in (maxtext_keys or {}):
        os.environ[MAXTEXT_CACHE_ENV] = str(sync.local)
    update("jax_persistent_cache_min_compile_time_secs", 0.0)
    update("jax_persistent_cache_min_entry_size_bytes", 0)
    return sync.start()


__all__ = [
    "HF",
    "JAX_SAMPLER",
    "JAX_TRAINER",
    "CacheSync",
    "JaxConfigUpdate",
    "LoadGuard",
    "Restored",
    "jax_compilation_cache",
    "local_root",
    "restore",
    "save",
]
