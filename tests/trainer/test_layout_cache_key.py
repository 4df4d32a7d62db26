"""A program that reads arrays put in a compiled program's memory layouts (rljob.trainer.placement.lay_out)
is filed in JAX's persistent cache under the key of the same program lowered from their shapes in those
formats (placement.abstract). The trainer relies on it: it lays its base weights out as the step's program
chose (Trainer.lay_out_base) and then calls the parity gate's program on them, while the compile stage
(rljob.trainer.compilecheck) compiles that program from shapes in the step's formats, on a machine without
the chip; the chip run must find that entry, not compile the model's forward pass again.

Here on JAX's CPU backend, with layouts other than the default forced (the TPU compiler chooses such
layouts for the step's stacked weights: tests/trainer/test_compilecheck.py), three processes share one cache
directory: the compile stage's way writes the entry, the trainer's way hits it, and the same program on
arrays in the default layouts misses (another program: the variant this test must tell apart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.jax

_PROCESS = r"""
import json, sys
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
from jax.experimental.layout import Format, Layout
from rljob.trainer.placement import abstract, lay_out

s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
tree = {"w": jnp.arange(24.0).reshape(4, 6), "b": jnp.arange(60.0).reshape(3, 4, 5)}
formats = {  # column-major, and a 3-D array with its middle axis minor: neither is the CPU's default
    "w": Format(Layout(major_to_minor=(1, 0)), s),
    "b": Format(Layout(major_to_minor=(0, 2, 1)), s),
}

def parity_like(t):
    return jnp.tanh(t["w"]).sum() + (t["b"] * 2.0).sum(axis=1)

f = jax.jit(parity_like)
way = sys.argv[2]
args = {"compile_stage": None, "trainer": lay_out(tree, formats), "default": tree}[way]
events = []
jax.monitoring.register_event_listener(lambda e, **kw: events.append(e))
if way == "compile_stage":
    f.lower(abstract(tree, formats)).compile()
else:
    jax.block_until_ready(f(args))
print(json.dumps({
    "hits": events.count("/jax/compilation_cache/cache_hits"),
    "misses": events.count("/jax/compilation_cache/cache_misses"),
    "laid_out": way != "trainer" or all(
        args[k].format.layout.major_to_minor == formats[k].layout.major_to_minor for k in formats
    ),
}))
"""


def _run(cache: Path, way: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROCESS, str(cache), way],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_the_trainers_call_hits_the_entry_the_compile_stage_wrote(tmp_path: Path) -> None:
    cache = tmp_path / "jax-cache"
    wrote = _run(cache, "compile_stage")
    assert wrote["misses"] == 1 and wrote["hits"] == 0, wrote
    trainer = _run(cache, "trainer")
    assert trainer["laid_out"], "lay_out left the arrays in their default layouts"
    assert trainer == {"hits": 1, "misses": 0, "laid_out": True}, trainer
    # The same function on arrays in their default layouts is another program: a miss (so the hit above
    # is the layouts' doing, not a key that ignores them).
    assert _run(cache, "default") == {"hits": 0, "misses": 1, "laid_out": True}
