# mypy: disable-error-code="no-untyped-call,attr-defined"
"""Which parts of JAX's persistent compilation-cache key a program gets, compiled for a TPU topology.

Run here (no TPU): ``--topology v5e:1x1`` compiles for libtpu's compile-only devices of that topology, as the
compile preflight does (rljob.trainer.compilecheck.topology_devices); on a TPU machine without
``--topology`` the same program compiles for the chip. Each run prints one JSON object: the cache key, the
hash of each part of it (JAX logs them at DEBUG: jax/_src/cache_key.py ``get``), the backend's platform and
version and the devices' kind, and what the cache directory holds after the compile, so that two runs'
objects can be compared part by part (docs/drill.md, "Zero-compile start").
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import sys
import tempfile
from pathlib import Path


class _Parts(logging.Handler):
    PART = re.compile(r"get_cache_key hash of serialized (.+): ([0-9a-f]+)")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.parts: dict[str, str] = {}
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        m = self.PART.search(msg)
        if m:
            self.parts[m[1]] = m[2][:16]
        elif "cache" in msg.lower() and len(self.lines) < 40:
            self.lines.append(msg[:300])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--topology", help="compile-only TPU topology, e.g. v5e:1x1 (default: this machine's chips)"
    )
    ap.add_argument("--cache-dir", help="JAX compilation cache directory (default: a new temporary one)")
    args = ap.parse_args(argv)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if args.topology:
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="jax-cache-"))
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    parts = _Parts()
    seen: dict[str, object] = {}
    from jax._src import cache_key

    class _Capture:
        def update(self, data: bytes) -> None:
            seen["compile_options_b64"] = base64.b64encode(data).decode()

    real_get = cache_key.get

    def get(module, devices, compile_options, backend, *a, **kw):  # type: ignore[no-untyped-def]
        cache_key._hash_serialized_compile_options(_Capture(), compile_options)
        seen["device_assignment"] = str(compile_options.device_assignment)
        seen["env_option_overrides"] = [list(x) for x in compile_options.env_option_overrides]
        seen["backend_platform_version"] = backend.platform_version
        try:
            from jax._src.lib import xla_client

            seen["topology_fingerprint"] = xla_client.get_topology_for_devices(
                list(devices.flat)
            ).fingerprint()
        except Exception as e:
            seen["topology_fingerprint"] = f"error: {e}"
        return real_get(module, devices, compile_options, backend, *a, **kw)

    cache_key.get = get
    for name in ("jax._src.cache_key", "jax._src.compiler", "jax._src.compilation_cache"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.DEBUG)
        lg.addHandler(parts)

    if args.topology:
        from jax.experimental.topologies import get_topology_desc

        platform, _, shape = args.topology.partition(":")
        devices = list(get_topology_desc(topology_name=f"{platform}:{shape}", platform="tpu").devices)
    else:
        devices = jax.devices()
    mesh = Mesh(devices[:1], ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    arg = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=sharding)
    compiled = f.lower(arg).compile()
    d = devices[0]
    out = {
        "where": args.topology or "chip",
        "parts": parts.parts,
        "device_kind": d.device_kind,
        "platform": d.platform,
        "client_platform_version": getattr(d.client, "platform_version", None),
        "cache_files": sorted(p.name for p in cache.iterdir()),
        "jax": jax.__version__,
        "log": parts.lines,
        **seen,
        "executable": type(compiled.runtime_executable()).__name__,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
