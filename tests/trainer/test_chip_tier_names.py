"""The chip tier (tests/tpu/test_example_chip.py) adds up the seconds of JAX's compile events by the name the
persistent cache's lookups give each program: the two name programs differently (``jit(<lambda>)`` against
``jit__lambda``). Here, on the CPU with a real persistent cache, fixtures.chip_models.program_name maps every
compile event's name to the name of the lookup made for the same program."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from fixtures.chip_models import CACHE_LOOKUP, program_name
from fixtures.jax_compiles import backend_compiles


def parity_logprobs(x: Any) -> Any:
    return x * 2


def _apply(x: Any) -> Any:
    return x + 1


def test_compile_events_and_cache_lookups_name_a_program_alike(tmp_path: Path) -> None:
    import jax
    import jax.numpy as jnp
    from jax._src import compilation_cache

    lookups: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            m = CACHE_LOOKUP.search(record.getMessage())
            if m:
                lookups.append(m[3] or m[2])

    def setting(key: str, value: Any) -> None:
        jax.config.update(key, value)  # type: ignore[no-untyped-call]

    handler = Handler(logging.DEBUG)
    logger = logging.getLogger("jax._src.compiler")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    saved = {
        k: getattr(jax.config, k)
        for k in (
            "jax_enable_compilation_cache",
            "jax_compilation_cache_dir",
            "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes",
        )
    }
    try:
        setting("jax_enable_compilation_cache", True)
        setting("jax_compilation_cache_dir", str(tmp_path))
        setting("jax_persistent_cache_min_compile_time_secs", 0)
        setting("jax_persistent_cache_min_entry_size_bytes", 0)
        compilation_cache.reset_cache()
        x = jnp.arange(7.0) + 0.5  # shapes no other test compiles, so every program here is compiled anew
        with backend_compiles() as events:
            for f in (jax.jit(lambda v: v - 3), jax.jit(parity_logprobs), jax.jit(_apply)):
                f(x).block_until_ready()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        for k, v in saved.items():
            setting(k, v)
        compilation_cache.reset_cache()
    want = {"jit__lambda", "jit_parity_logprobs", "jit__apply"}
    assert want <= set(lookups), lookups
    named = {program_name(e) for e, _ in events}
    assert want <= named, events
    # every jitted program compiled here was looked up in the cache first, under the name mapped to
    assert {n for n in named if n.startswith("jit_")} <= set(lookups), (events, lookups)


@pytest.mark.parametrize(
    ("event", "want"),
    [
        ("jit(_accumulate)", "jit__accumulate"),
        ("jit(<lambda>)", "jit__lambda"),
        ("jit(parity_logprobs)", "jit_parity_logprobs"),
        ("pmap(f)", "pmap(f)"),
    ],
)
def test_program_name_table(event: str, want: str) -> None:
    assert program_name(event) == want
