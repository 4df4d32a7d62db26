"""A step's peak HBM on a TPU chip, read from what the chip reports (the chip tier, tests/tpu, and
bench/train_step_chip.py).

``Device.memory_stats()['peak_bytes_in_use']`` is the allocator's high-water mark of the buffers the
process holds: arrays (weights, optimizer state, a program's arguments and outputs). On a TPU it does not
count a running program's temporaries (XLA's scratch: the activations a backward pass keeps, the
attention and log-prob head's intermediates). On a v5e chip (hack/tpu/README.md) Qwen3-0.6B's step peaked
at the same 1.60 GB with ``remat_policy`` ``full`` and ``minimal``, although ``minimal`` keeps about 115 MB
more activations a layer at that step's 5,120 tokens (the same step's compiled temporaries at 2 and 4
layers), about 3 GB over 28 layers; Reactant.jl reports the same of TPU allocator statistics
(https://github.com/EnzymeAD/Reactant.jl/issues/2815). tests/tpu/test_memory_stats_chip.py decided it on
a v5e (2026-12-07): a program whose one large buffer is a 2.16 GB temporary left the allocator's peak at
17.5 MB, while ``bytes_reserved`` rose by about the temporary's size.

So the peak of a step is read as :func:`step_peak`: the bytes held between programs (measured:
``bytes_in_use``) plus the largest program's scratch (its temporaries and non-aliased outputs, from the
chip compiler's own buffer assignment, ``Compiled.memory_analysis()``: :func:`scratch_bytes`), or the
allocator's own peak where that is larger (were the temporaries counted there, it is the larger). The
compile stage (rljob.trainer.compilecheck) predicts the same sum from the same buffer assignment, compiled
on a CPU machine for the chip's topology.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["allocator_stats", "figures_scratch", "scratch_bytes", "step_peak"]


def scratch_bytes(memory_analysis: Any) -> int:
    """What a compiled program allocates while it runs beyond its arguments: temporaries plus the outputs
    not aliased to a donated argument (0 where the backend gives no analysis)."""
    if memory_analysis is None:
        return 0
    ma = memory_analysis
    return int(ma.temp_size_in_bytes) + int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes)


def figures_scratch(fig: Mapping[str, Any]) -> int:
    """:func:`scratch_bytes` of a program from its compile-stage figures
    (rljob.trainer.compilecheck.compile_one)."""
    return int(fig.get("temp_bytes", 0)) + int(fig.get("output_bytes", 0)) - int(fig.get("alias_bytes", 0))


def allocator_stats(device: Any) -> dict[str, int]:
    """``device.memory_stats()`` (the numbers only; empty where the backend keeps none, as on CPU)."""
    return {k: int(v) for k, v in (device.memory_stats() or {}).items() if isinstance(v, int | float)}


def step_peak(device: Any, scratch: Mapping[str, int], setup_peak: int = 0) -> dict[str, Any]:
    """The step's peak HBM on ``device``, called after the step's programs ran (between steps): the held
    bytes plus the largest of ``scratch`` (program name -> :func:`scratch_bytes`), or the allocator's peak
    where larger; with the figures it is made of. ``setup_peak``: the allocator's peak read before the
    step's first program ran (building the weights, laying them out); the counter only grows, so a peak
    not above it was reached before the step and is not the step's."""
    stats = allocator_stats(device)
    held = stats.get("bytes_in_use", 0)
    allocator_peak = stats.get("peak_bytes_in_use", 0)
    largest = max(scratch.values(), default=0)
    during = allocator_peak if allocator_peak > setup_peak else 0
    return {
        "peak_bytes": max(held + largest, during),
        "held_bytes": held,
        "scratch_bytes": dict(scratch),
        "allocator_peak_bytes": allocator_peak,
        "setup_peak_bytes": setup_peak,
        "memory_stats": stats,
    }
