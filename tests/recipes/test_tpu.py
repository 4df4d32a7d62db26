"""TPU catalog: shorthand and object forms, sizes, labels, machine types, containers."""

from __future__ import annotations

import pytest
from rljob.recipes import tpu
from rljob.recipes.api import TpuSlice

# value, accelerator, topology, chips, hosts, devices, machine type
CASES = [
    ("v5p-8", "tpu-v5p-slice", "2x2x1", 4, 1, 4, "ct5p-hightpu-4t"),
    ("v5p-16", "tpu-v5p-slice", "2x2x2", 8, 2, 8, "ct5p-hightpu-4t"),
    ("v5p-32", "tpu-v5p-slice", "2x2x4", 16, 4, 16, "ct5p-hightpu-4t"),
    ("v5p-64", "tpu-v5p-slice", "2x4x4", 32, 8, 32, "ct5p-hightpu-4t"),
    ("v5p-128", "tpu-v5p-slice", "4x4x4", 64, 16, 64, "ct5p-hightpu-4t"),
    ("v5p-256", "tpu-v5p-slice", "4x4x8", 128, 32, 128, "ct5p-hightpu-4t"),
    ("v5p-512", "tpu-v5p-slice", "4x8x8", 256, 64, 256, "ct5p-hightpu-4t"),
    ("v5p-1024", "tpu-v5p-slice", "8x8x8", 512, 128, 512, "ct5p-hightpu-4t"),
    ("v5p-2048", "tpu-v5p-slice", "8x8x16", 1024, 256, 1024, "ct5p-hightpu-4t"),
    ("v5p-12288", "tpu-v5p-slice", "16x16x24", 6144, 1536, 6144, "ct5p-hightpu-4t"),
    ("tpu7x-2", "tpu7x", "1x1x1", 1, 1, 2, "tpu7x-standard-1t"),
    ("tpu7x-8", "tpu7x", "2x2x1", 4, 1, 8, "tpu7x-standard-4t"),
    ("tpu7x-16", "tpu7x", "2x2x2", 8, 2, 16, "tpu7x-standard-4t"),
    ("tpu7x-128", "tpu7x", "4x4x4", 64, 16, 128, "tpu7x-standard-4t"),
    ("tpu7x-256", "tpu7x", "4x4x8", 128, 32, 256, "tpu7x-standard-4t"),
    ("tpu7x-512", "tpu7x", "4x8x8", 256, 64, 512, "tpu7x-standard-4t"),
    ("tpu7x-9216", "tpu7x", "12x16x24", 4608, 1152, 9216, "tpu7x-standard-4t"),
    ("tpu7x-4x4x4", "tpu7x", "4x4x4", 64, 16, 128, "tpu7x-standard-4t"),
    (
        TpuSlice(accelerator="tpu-v5p-slice", topology="2x2x4"),
        "tpu-v5p-slice",
        "2x2x4",
        16,
        4,
        16,
        "ct5p-hightpu-4t",
    ),
    (TpuSlice(accelerator="tpu7x", topology="4x4x8"), "tpu7x", "4x4x8", 128, 32, 256, "tpu7x-standard-4t"),
]


@pytest.mark.parametrize(("value", "acc", "topo", "chips", "hosts", "devices", "machine"), CASES)
def test_plan(
    value: str | TpuSlice, acc: str, topo: str, chips: int, hosts: int, devices: int, machine: str
) -> None:
    p = tpu.plan(value)
    assert (p.accelerator, p.topology, p.chips, p.hosts, p.devices, p.machine_type) == (
        acc,
        topo,
        chips,
        hosts,
        devices,
        machine,
    )
    assert p.chips_per_host == (1 if chips == 1 else 4)
    assert p.devices_per_chip == (2 if acc == "tpu7x" else 1)
    assert p.type_name == f"{'tpu7x' if acc == 'tpu7x' else 'v5p'}-{2 * chips}"
    assert (p.containers_per_host, p.chips_per_container) == (1, p.chips_per_host)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("v6e-8", "unknown TPU type 'v6e-8'"),
        ("v5p-7", "must be even"),
        ("v5p-6", "no v5p slice has 3 chips"),
        ("v5p-2", "no v5p slice has 1 chips"),
        ("tpu7x-4x4x2", "did you mean 2x4x4?"),
        ("v5p-4x4x6", "not a v5p slice topology"),
        ("v5p", "unknown TPU type"),
        ("", "unknown TPU type"),
        (TpuSlice(accelerator="tpu-v5p-slice", topology="1x1x1"), "'1x1x1' is not a v5p slice topology"),
        (TpuSlice(accelerator="tpu7x", topology="2x2"), "'2x2' is not a tpu7x slice topology"),
    ],
)
def test_refused(value: str | TpuSlice, message: str) -> None:
    with pytest.raises(tpu.TpuError, match=None) as err:
        tpu.plan(value)
    assert message in str(err.value)


def test_topology_lists() -> None:
    v5p = tpu.topologies("v5p")
    assert v5p[:6] == ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8")
    assert "1x1x1" not in v5p and tpu.topologies("tpu7x")[0] == "1x1x1"
    # every 4i x 4j x 4k (i <= j <= k) up to 140 / 144 cubes
    assert all(tpu.chips_of(t) <= 140 * 64 for t in v5p)
    assert "16x16x36" in tpu.topologies("tpu7x") and "16x16x36" not in v5p  # 144 cubes
    assert "4x4x4" in v5p and "8x4x4" not in v5p


def test_two_containers_on_tpu7x() -> None:
    p = tpu.plan("tpu7x-16", containers_per_host=2)
    assert (p.containers_per_host, p.chips_per_container, p.hosts) == (2, 2, 2)
    assert tpu.default_containers("tpu7x-256", "trainer") == 2
    assert tpu.default_containers("tpu7x-256", "sampler") == 1
    assert tpu.default_containers("tpu7x-2", "trainer") == 1
    assert tpu.default_containers("v5p-8", "trainer") == 1
    with pytest.raises(tpu.TpuError, match="4-chip tpu7x host"):
        tpu.plan("v5p-8", containers_per_host=2)
    with pytest.raises(tpu.TpuError, match="4-chip tpu7x host"):
        tpu.plan("tpu7x-2", containers_per_host=2)
    with pytest.raises(tpu.TpuError, match="1 or 2"):
        tpu.plan("tpu7x-8", containers_per_host=3)


@pytest.mark.parametrize("prefix", ["v5p", "tpu7x"])
def test_topologies_sorted_by_chips(prefix: str) -> None:
    topos = tpu.topologies(prefix)
    chips = [tpu.chips_of(t) for t in topos]
    assert chips == sorted(chips) and len(set(topos)) == len(topos)
    cubes = [t for t in topos if tpu.chips_of(t) >= 64]
    assert cubes[:5] == ["4x4x4", "4x4x8", "4x4x12", "4x4x16", "4x8x8"]
    # every i <= j <= k with i*j*k <= 140 (v5p) or 144 (tpu7x) 4x4x4 cubes, counted by brute force
    assert len(cubes) == {"v5p": 492, "tpu7x": 516}[prefix]


@pytest.mark.parametrize(
    ("value", "hint"),
    [("tpu7x-4x4x2", "2x4x4"), ("v5p-8x4x4", "4x4x8"), ("v5p-4x2x1", None), ("v5p-2x1x2", None)],
)
def test_did_you_mean(value: str, hint: str | None) -> None:
    with pytest.raises(tpu.TpuError) as err:
        tpu.plan(value)
    if hint is None:
        assert "did you mean" not in str(err.value)
    else:
        assert str(err.value).endswith(f"(did you mean {hint}?)")


def test_default_containers_at_the_smallest_split_host() -> None:
    assert tpu.default_containers("tpu7x-8", "trainer") == 2  # 4 chips: the smallest host that splits
    assert tpu.plan("tpu7x-8", tpu.default_containers("tpu7x-8", "trainer")).chips_per_container == 2
