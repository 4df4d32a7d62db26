"""What the chip's allocator counts: a running program's temporaries are not in ``peak_bytes_in_use``.

rljob.trainer.chip_memory reads a step's peak HBM as the bytes held plus the largest program's scratch
from the chip compiler's buffer assignment, because on a TPU the allocator's ``peak_bytes_in_use`` does not
count a program's temporaries (a v5e run: Qwen3-0.6B's step peaked at the same 1.60 GB with
``remat_policy`` ``full`` and ``minimal``, about 3 GB apart in activations). This test decides it (it
passed on a v5e, 2026-12-07: the allocator's peak 0.008 of what counting the temporary would give): one
program whose only large buffer is a temporary of known size (the [n, n] product ``a @ a.T`` behind an
optimization barrier feeds a second matmul, so it must exist in HBM while the program runs; the compiler's
own analysis is asserted to say so), sized past everything the process peaked at before. Without the
barrier the chip's compiler fuses ``tanh(a @ a.T) @ a`` into tiles and assigns no temporary at all (a v5e,
2026-12-07). Were the temporaries counted, the allocator's peak
after the call would reach the held bytes plus the argument plus that temporary.
"""

from __future__ import annotations

import math
from typing import Any

GIB = 2**30


def test_the_allocators_limit_is_the_generation_tables(chip: Any, record: Any) -> None:
    """What one process may allocate on this chip is what the compile stage fits programs into
    (rljob.recipes.generations, ``hbm_limit_bytes_per_chip``, measured on a v5e): a libtpu that keeps more
    of the HBM for itself would let the stage accept a program the chip cannot allocate."""
    from fixtures.chip_models import chip_figures
    from rljob.trainer import chip_memory

    limit = chip_memory.allocator_stats(chip).get("bytes_limit", 0)
    table = chip_figures()
    record("memory_stats", "bytes_limit", limit, table=table.device_limit, published=table.device_hbm)
    assert limit > 0
    assert table.device_limit <= limit, (
        f"this chip's allocator offers {limit} bytes a device, less than the {table.device_limit} the "
        "compile stage fits programs into: set hbm_limit_bytes_per_chip in rljob.recipes.generations"
    )


def test_the_allocators_peak_leaves_out_a_programs_temporaries(chip: Any, record: Any) -> None:
    import jax
    import jax.numpy as jnp
    from rljob.trainer import chip_memory

    before = chip_memory.allocator_stats(chip)
    held = before.get("bytes_in_use", 0)
    # A temporary larger than the gap between what the process holds and its peak so far (plus 1 GiB),
    # so that the peak after the call shows whether the temporary was counted.
    want = max(2 * GIB, before.get("peak_bytes_in_use", 0) - held + GIB)
    n = (math.isqrt(want // 2) // 128 + 1) * 128
    temp_lower_bound = n * n * 2  # the [n, n] bfloat16 product
    limit = before.get("bytes_limit", 16 * GIB)
    assert held + temp_lower_bound < 0.8 * limit, (before, n)

    a = jax.device_put(jnp.ones((n, 128), jnp.bfloat16), chip)
    f = jax.jit(lambda a: jnp.tanh(jax.lax.optimization_barrier(a @ a.T)) @ a)  # type: ignore[no-untyped-call]
    compiled = f.lower(a).compile()
    ma = compiled.memory_analysis()
    assert ma is not None and ma.temp_size_in_bytes >= 0.9 * temp_lower_bound, ma
    jax.block_until_ready(compiled(a))  # type: ignore[no-untyped-call]
    after = chip_memory.allocator_stats(chip)

    arg = n * 128 * 2
    with_temp = held + arg + int(ma.temp_size_in_bytes)
    record(
        "memory_stats",
        "allocator_peak_after_over_held_arg_temp",
        after.get("peak_bytes_in_use", 0) / with_temp,
        n=n,
        temp_bytes=int(ma.temp_size_in_bytes),
        before=before,
        after=after,
    )
    # Counted, the peak would be at least held + arg + temp; left out, it stays below held + arg + temp / 2.
    assert after.get("peak_bytes_in_use", 0) < held + arg + int(ma.temp_size_in_bytes) // 2, (
        "the allocator's peak counts the program's temporaries on this chip: rljob.trainer.chip_memory's "
        f"docstring and docs/drill.md must say so (before {before}, after {after}, "
        f"temp {ma.temp_size_in_bytes})"
    )
