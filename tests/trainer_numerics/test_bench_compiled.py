"""The pure parts of bench/train_step_compiled.py: its length traces hold the fill they are named by, its
collectives estimate counts what a device receives, and its ratio line is the product of what it says it is
made of."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "bench" / "train_step_compiled.py"
    spec = importlib.util.spec_from_file_location("train_step_compiled", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_step_compiled"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("fill", [0.3, 0.5, 0.7, 0.9])
def test_fill_trace_mean_is_the_fill(fill: float) -> None:
    b = _bench()
    lengths = b.trace_lengths(4096, 1024, 4096, 0, str(fill))
    mean = sum(p + c for p, c in lengths) / len(lengths) / (1024 + 4096)
    assert mean == pytest.approx(fill, abs=0.02)
    assert all(256 <= p <= 1024 and 1 <= c <= 4096 for p, c in lengths)


def test_loguniform_trace_is_the_cpu_bench_spread() -> None:
    b = _bench()
    assert b.trace_lengths(64, 1024, 4096, 3, "loguniform") == b.cpu_bench.rollout_lengths(
        64, 1, 3, max_prompt=1024, max_completion=4096
    )


def test_gathered_bytes_is_what_a_device_lacks() -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    b = _bench()
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1), ("fsdp",))
    one = NamedSharding(mesh, P("fsdp"))  # type: ignore[no-untyped-call]
    whole = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=one)  # type: ignore[no-untyped-call]
    # a 2-byte leaf a quarter of which a device holds (four devices on fsdp)
    quarter = SimpleNamespace(
        shape=(8, 4),
        dtype=np.dtype("float16"),
        sharding=SimpleNamespace(shard_shape=lambda s: (s[0] // 4, s[1])),
    )
    assert b.gathered_bytes([whole]) == 0  # one device holds it all
    assert b.gathered_bytes([quarter, quarter]) == 2 * (8 * 4 * 2 - 2 * 4 * 2)


def _step(
    arm: str, useful: int, computed: int, seconds: float, peak: int, per_device: float
) -> dict[str, Any]:
    return {
        "metric": "step",
        "arm": arm,
        "recipe": "r",
        "trace": "fill 0.5",
        "useful_tokens": useful,
        "computed_tokens": computed,
        "roofline_seconds": seconds,
        "roofline_s_per_computed_token": seconds / computed,
        "useful_tokens_per_roofline_s": useful / seconds,
        "peak_bytes_per_device": peak,
        "tokens_per_device_per_call": per_device,
        "fits": True,
        "call_roofline": {"p": {"bound": "compute"}},
    }


def test_ratio_is_made_of_computed_tokens_and_cost_per_token() -> None:
    b = _bench()
    lines = [
        _step("rljob", 100, 200, 2.0, 10, 5120.0),
        _step("tunix_packed", 100, 300, 3.3, 30, 5120.0),
        _step("tunix_padded", 100, 600, 6.0, 20, 5120.0),
        _step("maxtext", 100, 150, 1.0, 5, 5120.0) | {"fits": False},  # fastest, but does not fit
    ]
    out = io.StringIO()
    with redirect_stdout(out):
        b.ratios_from_lines(lines)
    got = {d["metric"]: d for d in map(json.loads, out.getvalue().splitlines())}
    tokens = got["rljob_over_best_peer_tokens_ratio"]
    assert tokens["peer"] == "tunix_packed"
    assert tokens["value"] == pytest.approx(3.3 / 2.0)
    made = tokens["made_of"]
    assert made["computed_tokens_ratio"] == pytest.approx(1.5)
    product = made["computed_tokens_ratio"] * made["per_computed_token_cost_ratio"]
    assert product == pytest.approx(tokens["value"])
    hbm = got["rljob_over_best_peer_peak_hbm_ratio"]
    assert (hbm["peer"], hbm["value"], hbm["equal_tokens_per_device"]) == ("tunix_padded", 0.5, True)
