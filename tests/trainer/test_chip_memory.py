"""rljob.trainer.chip_memory: a step's peak HBM from the bytes held and the programs' scratch (the chip tier
runs it on a TPU: tests/tpu; here its arithmetic, on the CPU's own compiled programs)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from rljob.trainer.chip_memory import allocator_stats, figures_scratch, scratch_bytes, step_peak


class _Allocator:
    """A device whose allocator reports these numbers (the CPU keeps none)."""

    def __init__(self, stats: dict[str, Any] | None) -> None:
        self.stats = stats

    def memory_stats(self) -> dict[str, Any] | None:
        return self.stats


def test_scratch_is_temporaries_and_the_outputs_not_donated() -> None:
    x = jnp.ones((256, 256), jnp.float32)

    def f(x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ x.T) @ x

    plain = jax.jit(f).lower(x).compile().memory_analysis()
    donated = jax.jit(f, donate_argnums=0).lower(x).compile().memory_analysis()
    assert plain is not None and donated is not None
    out = 256 * 256 * 4
    assert plain.output_size_in_bytes == out and plain.alias_size_in_bytes == 0
    assert scratch_bytes(plain) == plain.temp_size_in_bytes + out
    # Donated, the output takes the argument's buffer: only the temporaries are new.
    assert donated.alias_size_in_bytes == out
    assert scratch_bytes(donated) == donated.temp_size_in_bytes
    fig = {
        "temp_bytes": plain.temp_size_in_bytes,
        "output_bytes": plain.output_size_in_bytes,
        "alias_bytes": 0,
    }
    assert figures_scratch(fig) == scratch_bytes(plain)
    assert scratch_bytes(None) == 0


@pytest.mark.parametrize(
    ("stats", "scratch", "setup", "peak"),
    [
        # the allocator leaves the temporaries out (a TPU): held plus the largest program's scratch
        ({"bytes_in_use": 1_000, "peak_bytes_in_use": 1_200}, {"accumulate": 3_000, "apply": 50}, 0, 4_000),
        # an allocator that counted them: its own peak, never the sum of both
        ({"bytes_in_use": 1_000, "peak_bytes_in_use": 4_500}, {"accumulate": 3_000}, 0, 4_500),
        # that peak reached before the step (setting up): not the step's
        ({"bytes_in_use": 1_000, "peak_bytes_in_use": 4_500}, {"accumulate": 3_000}, 4_500, 4_000),
        # the counter grew past the setup's peak: the step's own
        ({"bytes_in_use": 1_000, "peak_bytes_in_use": 4_500}, {"accumulate": 3_000}, 4_400, 4_500),
        # no statistics (the CPU): the scratch alone
        (None, {"accumulate": 3_000}, 0, 3_000),
        ({"bytes_in_use": 700}, {}, 0, 700),
    ],
)
def test_step_peak(stats: dict[str, Any] | None, scratch: dict[str, int], setup: int, peak: int) -> None:
    got = step_peak(_Allocator(stats), scratch, setup)
    assert got["peak_bytes"] == peak
    assert got["held_bytes"] == (stats or {}).get("bytes_in_use", 0)
    assert got["scratch_bytes"] == scratch
    assert got["allocator_peak_bytes"] == (stats or {}).get("peak_bytes_in_use", 0)


def test_allocator_stats_keeps_the_numbers() -> None:
    dev = _Allocator({"bytes_in_use": 5, "bytes_limit": 9.0, "kind": "x", "peak_bytes_in_use": 7})
    assert allocator_stats(dev) == {"bytes_in_use": 5, "bytes_limit": 9, "peak_bytes_in_use": 7}
    assert allocator_stats(jax.devices("cpu")[0]) == {}
