"""Adapter hot-swap: follow the trainer's published LoRA versions and keep the sampler serving the newest.

The trainer publishes each adapter version as a PEFT directory `{adapters}/v{N}/` and then rewrites the
pointer object `{adapters}/LATEST` (its text is the version: `N` or `vN`). The watcher polls LATEST,
downloads a new version to local disk, loads it into the server under a versioned name
(`POST /v1/load_lora_adapter`), and only then unloads the previous version
(`POST /v1/unload_lora_adapter`), so a request never finds no adapter. The same two endpoints exist in
vLLM (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True) and in the CPU backend (rljob.sampler.cpu_server).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.common.credentials import bearer
from rljob.common.http import HttpError, HttpStatusError, HttpUnavailable, Retry, shared
from rljob.common.storage import Store, open_store
from rljob.recipes.runconfig import named_adapter

log = logging.getLogger("rljob.sampler.adapters")

LATEST = "LATEST"
_NAME_RE = re.compile(r"^(?P<prefix>.+)-v(?P<version>\d+)$")


def adapter_name(prefix: str, version: int) -> str:
    """The name an adapter version is served under; requests select it as `model`."""
    return f"{prefix}-v{version}"


def version_of(name: str) -> int | None:
    m = _NAME_RE.match(name)
    return int(m.group("version")) if m else None


def parse_latest(text: str) -> int:
    """LATEST holds `N` or `vN` (optionally JSON {"version": N})."""
    t = text.strip()
    if t.startswith("{"):
        return int(json.loads(t)["version"])
    return int(t[1:] if t.startswith("v") else t)


class AdapterStore:
    """Read access to `{adapters}` (gs:// or a local directory, rljob.common.storage): the LATEST pointer
    and the version directories."""

    def __init__(self, adapters_uri: str, store: Store | None = None) -> None:
        self.store = store or open_store(adapters_uri)
        self.uri = self.store.uri

    def latest(self) -> int | None:
        raw = self.store.read(LATEST)
        return None if raw is None else parse_latest(raw.decode())

    def download(self, version: int, dest: Path, *, workers: int = 8) -> Path:
        """Copy `v{version}/` to `dest` (atomically: a staging dir renamed at the end)."""
        return self.download_dir(f"v{version}", dest, workers=workers)

    def download_dir(self, rel: str, dest: Path, *, workers: int = 8) -> Path:
        """Copy the objects under `{uri}/{rel}/` to `dest` (atomically: a staging dir renamed at the end;
        large objects in parallel ranged reads on gs://)."""
        staging = dest.with_name(dest.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        if not self.store.download(f"{rel.strip('/')}/", staging, workers=workers):
            shutil.rmtree(staging, ignore_errors=True)
            raise FileNotFoundError(f"{self.uri}/{rel.strip('/')}/ is empty")
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
        return dest


class ServerError(RuntimeError):
    pass


# A load or an unload is retried a little on no connection or a 5xx: the watcher and the agent's caller
# retry the rest.
_RETRY = Retry(attempts=3, base_s=0.5, cap_s=2.0)


def _post_json(url: str, body: dict[str, Any], timeout: float, token: str | None) -> tuple[int, str]:
    """The status and text of a POST's answer (a 4xx's too); ServerError when there is none."""
    try:
        resp = shared().post(url, json=body, headers=bearer(token), timeout=timeout, retry=_RETRY)
    except (HttpStatusError, HttpUnavailable) as e:
        if e.status is not None:
            return e.status, e.text
        raise ServerError(str(e)) from e
    except HttpError as e:
        raise ServerError(str(e)) from e
    return resp.status, resp.text


class LoraEndpoint:
    """The runtime-LoRA endpoints of one server (vLLM or the CPU backend), called with the run's ``token``
    (the server requires it under /v1: rljob.common.credentials)."""

    def __init__(self, base_url: str, timeout: float = 600.0, token: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.token = token

    def load(self, name: str, path: str) -> None:
        code, text = _post_json(
            f"{self.base_url}/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": path},
            self.timeout,
            self.token,
        )
        if code != 200 and "already" not in text:
            raise ServerError(f"load_lora_adapter {name}: HTTP {code}: {text[:300]}")

    def unload(self, name: str) -> None:
        code, text = _post_json(
            f"{self.base_url}/v1/unload_lora_adapter", {"lora_name": name}, self.timeout, self.token
        )
        if code not in (200, 404):
            raise ServerError(f"unload_lora_adapter {name}: HTTP {code}: {text[:300]}")


@dataclass
class SwapRecord:
    version: int
    name: str
    download_s: float
    load_s: float
    unload_s: float
    swapped_at: float


class AdapterWatcher:
    """Polls LATEST and hot-swaps the server to each new version (load new, then unload old)."""

    def __init__(
        self,
        store: AdapterStore,
        endpoint: LoraEndpoint,
        local_dir: Path,
        name_prefix: str,
        poll_s: float = 0.5,
    ) -> None:
        self.store = store
        self.endpoint = endpoint
        self.local_dir = local_dir
        self.name_prefix = name_prefix
        self.poll_s = poll_s
        self.served: SwapRecord | None = None
        self.lock = threading.Lock()

    @property
    def served_version(self) -> int | None:
        return self.served.version if self.served else None

    def status(self) -> dict[str, Any]:
        s = self.served
        return {
            "version": s.version if s else None,
            "name": s.name if s else None,
            "swapped_at": s.swapped_at if s else None,
            "download_s": s.download_s if s else None,
            "load_s": s.load_s if s else None,
        }

    def poll_once(self) -> SwapRecord | None:
        """Swap to LATEST if it is newer than the served version; returns the new record, if any."""
        latest = self.store.latest()
        if latest is None or (self.served is not None and latest <= self.served.version):
            return None
        with self.lock:
            t0 = time.monotonic()
            path = self.store.download(latest, self.local_dir / f"v{latest}")
            t1 = time.monotonic()
            name = adapter_name(self.name_prefix, latest)
            self.endpoint.load(name, str(path))
            t2 = time.monotonic()
            prev = self.served
            unload_s = 0.0
            if prev is not None:
                self.endpoint.unload(prev.name)
                unload_s = time.monotonic() - t2
                shutil.rmtree(self.local_dir / f"v{prev.version}", ignore_errors=True)
            self.served = SwapRecord(latest, name, t1 - t0, t2 - t1, unload_s, time.time())
            log.info("serving %s (download %.2fs, load %.2fs)", name, t1 - t0, t2 - t1)
            return self.served

    def run(self, stop: threading.Event) -> None:
        """Poll until `stop`; storage or server errors are logged and retried, never fatal."""
        while not stop.is_set():
            try:
                self.poll_once()
            except (OSError, ServerError, ValueError) as e:  # storage errors are OSErrors
                log.warning("adapter swap failed, retrying: %s", e)
            stop.wait(self.poll_s)

    def start(self) -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        t = threading.Thread(target=self.run, args=(stop,), name="adapter-watcher", daemon=True)
        t.start()
        return t, stop


# An adapter name the agent accepts: one path segment of a bounded charset, dots only between other
# characters (no '.', '..', leading dot or separator).
_AGENT_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")
_AGENT_SEGMENT = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


class AdapterAgent:
    """Loads adapters by name on request (the Tinker service's saved sampler weights), at most ``capacity``
    at once: :meth:`ensure` downloads ``{uri}/`` (a PEFT directory on gs://) and loads it under ``name``,
    after unloading the least recently used adapters beyond capacity. Served by the sampler on its port +
    ADAPTER_AGENT_PORT_OFFSET at ADAPTER_AGENT_PATH (rljob.sampler.main).

    Only the run's own adapters: ``uri`` must lie below ``allowed`` (``{storage.adapters}/tinker``, the
    folder the service writes sampler weights to) in plain segments, and ``name`` must be the name of that
    directory (rljob.recipes.runconfig.named_adapter, a digest of the uri whose last segment is the
    content's digest), so no caller can serve other weights under a name the service will ask for."""

    def __init__(self, endpoint: LoraEndpoint, local_dir: Path, capacity: int, allowed: str) -> None:
        self.endpoint, self.local_dir, self.capacity = endpoint, local_dir, max(capacity, 1)
        self.allowed = allowed.rstrip("/")
        self.loaded: dict[str, Path] = {}  # name -> local dir, least recently used first
        self.lock = threading.Lock()

    def check(self, name: str, uri: str) -> None:
        """ValueError naming the field unless ``name`` and ``uri`` are an adapter of this run."""
        if len(name) > 128 or not _AGENT_NAME.fullmatch(name):
            raise ValueError(
                f"name: {name[:200]!r} is not an adapter name (1-128 of A-Z a-z 0-9 _ - and inner dots)"
            )
        rest = uri[len(self.allowed) + 1 :] if uri.startswith(self.allowed + "/") else None
        if rest is None or len(uri) > 1024 or not all(_AGENT_SEGMENT.fullmatch(p) for p in rest.split("/")):
            raise ValueError(
                f"uri: {uri[:300]!r} is not a directory below {self.allowed}/ (this run's adapters)"
            )
        if name != named_adapter(uri):
            raise ValueError(f"name: {name!r} is not the name of {uri} (the service names each version)")

    def ensure(self, name: str, uri: str) -> bool:
        """Serve ``name`` from ``uri``; True when it was loaded now (False: it was served already)."""
        self.check(name, uri)
        with self.lock:
            if name in self.loaded:
                self.loaded[name] = self.loaded.pop(name)  # most recently used
                return False
            while len(self.loaded) >= self.capacity:
                old, path = next(iter(self.loaded.items()))
                self.endpoint.unload(old)
                shutil.rmtree(path, ignore_errors=True)
                del self.loaded[old]
            bucket_uri, _, rel = uri.rstrip("/").rpartition("/")
            dest = self.local_dir / name
            AdapterStore(bucket_uri).download_dir(rel, dest)
            self.endpoint.load(name, str(dest))
            self.loaded[name] = dest
            return True


__all__ = [
    "LATEST",
    "AdapterAgent",
    "AdapterStore",
    "AdapterWatcher",
    "LoraEndpoint",
    "ServerError",
    "SwapRecord",
    "adapter_name",
    "parse_latest",
    "version_of",
]
