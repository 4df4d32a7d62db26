"""XLA_FLAGS settled before a process compiles anything, so that the compile stage files the trainer's
programs under the cache keys the trainer looks up (rljob.recipes.libtpu.settled_xla_flags,
rljob.trainer.main.settle_xla_flags).

The fault, measured on a TPU v5e: MaxText writes its HLO-dump defaults into an empty XLA_FLAGS when it builds
a config; XLA reads the variable into the compile options once, at the process's first compile, and JAX's
cache key hashes the variable at each compile. A trainer pod compiles before its first MaxText config (its
first collective), the compile stage after, so the same program got other compile options in each and
missed the cache. Here, with libtpu compiling for the compile-only v5e:1x1 topology (real MaxText, real
JAX): each process builds a MaxText config and then compiles one program, either first ("early") or after a
program of its own ("late"), and prints the hash of each part of that program's cache key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from rljob.recipes import libtpu

Runs = dict[tuple[bool, str], dict[str, Any]]

pytest.importorskip("libtpu")

_PROCESS = r"""
import json, logging, os, re, sys, tempfile
settle, order = sys.argv[1] == "settle", sys.argv[2]
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
from rljob.trainer.main import settle_xla_flags
from rljob.trainer.model import maxtext_config, tiny_keys

keys = tiny_keys()
if settle:
    settle_xla_flags(keys)
import jax
import jax.numpy as jnp
from jax.experimental.topologies import get_topology_desc
from jax.sharding import Mesh, NamedSharding, PartitionSpec

jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
parts = {}


class Parts(logging.Handler):
    def emit(self, record):
        m = re.search(r"get_cache_key hash of serialized (.+): ([0-9a-f]+)", record.getMessage())
        if m:
            parts[m[1]] = m[2]


log = logging.getLogger("jax._src.cache_key")
log.setLevel(logging.DEBUG)
log.addHandler(Parts())
if order == "late":  # as a trainer pod: a program of its own (its first collective) before any MaxText config
    jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(3)))
maxtext_config(keys)
devices = list(get_topology_desc(topology_name="v5e:1x1", platform="tpu").devices)
one = NamedSharding(Mesh(devices[:1], ("x",)), PartitionSpec())
arg = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=one)
parts.clear()
jax.jit(lambda a: jnp.tanh(a @ a).sum()).lower(arg).compile()
print("PARTS " + json.dumps({"parts": parts, "xla_flags": os.environ.get("XLA_FLAGS")}))
"""


def _key_parts(settle: bool, order: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != libtpu.XLA_FLAGS_ENV}
    env.update(JAX_PLATFORMS="cpu", PYTHONSAFEPATH="1")
    proc = subprocess.run(
        [sys.executable, "-c", _PROCESS, "settle" if settle else "as-is", order],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PARTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][6:])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def runs() -> Runs:
    cases = [(settle, order) for settle in (False, True) for order in ("early", "late")]
    with ThreadPoolExecutor(len(cases)) as pool:
        return dict(zip(cases, pool.map(lambda c: _key_parts(*c), cases), strict=True))


def test_without_settling_the_compile_options_depend_on_what_compiled_first(runs: Runs) -> None:
    """The fault: the same program, the same variable when its key is taken, other compile options."""
    early, late = runs[(False, "early")], runs[(False, "late")]
    assert early["xla_flags"] == late["xla_flags"] and "--xla_dump_large_constants" in str(early["xla_flags"])
    assert early["parts"]["XLA flags"] == late["parts"]["XLA flags"]
    assert early["parts"]["compile_options"] != late["parts"]["compile_options"]


def test_settled_flags_give_one_key_whatever_compiled_first(runs: Runs) -> None:
    early, late = runs[(True, "early")], runs[(True, "late")]
    assert early["xla_flags"] == late["xla_flags"] == libtpu.INERT_XLA_FLAGS  # MaxText left it alone
    assert early["parts"] == late["parts"]
    assert set(early["parts"]) >= {"computation", "XLA flags", "compile_options", "accelerator_config"}


@pytest.mark.parametrize(
    ("env", "maxtext", "want"),
    [
        ({}, {}, libtpu.INERT_XLA_FLAGS),
        ({"XLA_FLAGS": ""}, {"model_name": "qwen3-0.6b"}, libtpu.INERT_XLA_FLAGS),
        ({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, {}, None),  # a drill's, a user's: kept
        ({}, {"dump_hlo": True}, None),  # MaxText's own dump flags, asked for
        ({}, {"dump_hlo_xla_flags": "--xla_dump_to=/tmp/d"}, None),  # MaxText refuses XLA_FLAGS beside it
        ({}, {"dump_hlo": False, "dump_hlo_xla_flags": ""}, libtpu.INERT_XLA_FLAGS),
    ],
)
def test_settled_xla_flags(env: dict[str, str], maxtext: dict[str, object], want: str | None) -> None:
    assert libtpu.settled_xla_flags(env, maxtext) == want
