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
    # v5e: one TensorCore per chip, so v5litepod-N has N chips; 2-D topologies; 1-, 4- and 8-chip hosts
    ("v5litepod-1", "tpu-v5-lite-podslice", "1x1", 1, 1, 1, "ct5lp-hightpu-1t"),
    ("v5litepod-4", "tpu-v5-lite-podslice", "2x2", 4, 1, 4, "ct5lp-hightpu-4t"),
    ("v5litepod-8", "tpu-v5-lite-podslice", "2x4", 8, 1, 8, "ct5lp-hightpu-8t"),
    ("v5litepod-16", "tpu-v5-lite-podslice", "4x4", 16, 4, 16, "ct5lp-hightpu-4t"),
    ("v5litepod-32", "tpu-v5-lite-podslice", "4x8", 32, 8, 32, "ct5lp-hightpu-4t"),
    ("v5litepod-256", "tpu-v5-lite-podslice", "16x16", 256, 64, 256, "ct5lp-hightpu-4t"),
    ("v5e-16", "tpu-v5-lite-podslice", "4x4", 16, 4, 16, "ct5lp-hightpu-4t"),  # MaxText's name
    ("v5litepod-8x16", "tpu-v5-lite-podslice", "8x16", 128, 32, 128, "ct5lp-hightpu-4t"),
    (
        TpuSlice(accelerator="tpu-v5-lite-podslice", topology="2x4"),
        "tpu-v5-lite-podslice",
        "2x4",
        8,
        1,
        8,
        "ct5lp-hightpu-8t",
    ),
    ("v6e-1", "tpu-v6e-slice", "1x1", 1, 1, 1, "ct6e-standard-1t"),
    ("v6e-4", "tpu-v6e-slice", "2x2", 4, 1, 4, "ct6e-standard-4t"),
    ("v6e-8", "tpu-v6e-slice", "2x4", 8, 1, 8, "ct6e-standard-8t"),
    ("v6e-16", "tpu-v6e-slice", "4x4", 16, 4, 16, "ct6e-standard-4t"),
    ("v6e-256", "tpu-v6e-slice", "16x16", 256, 64, 256, "ct6e-standard-4t"),
    (
        TpuSlice(accelerator="tpu-v6e-slice", topology="8x16"),
        "tpu-v6e-slice",
        "8x16",
        128,
        32,
        128,
        "ct6e-standard-4t",
    ),
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
    assert p.chips_per_host * p.hosts == chips
    gen = tpu.BY_ACCELERATOR[acc]
    assert p.devices_per_chip == gen.devices_per_chip
    assert p.type_name == f"{gen.prefix}-{gen.tensorcores_per_chip * chips}"
    assert (p.containers_per_host, p.chips_per_container) == (1, p.chips_per_host)


# type name, its xpk form, TensorCores per chip (the N of a name counts TensorCores)
NAMES = [
    ("v5p-8", "v5p-8", 2),
    ("tpu7x-8", "tpu7x-8", 2),
    ("v5litepod-16", "v5litepod-16", 1),
    ("v5e-16", "v5litepod-16", 1),
    ("v6e-8", "v6e-8", 1),
]


@pytest.mark.parametrize(("name", "xpk", "cores"), NAMES)
def test_names_round_trip_through_the_object_form(name: str, xpk: str, cores: int) -> None:
    """A type name and the object form of its labels are the same slice; the object form's plan names it
    as xpk does, and MaxText's name of it counts the same TensorCores."""
    p = tpu.plan(name)
    again = tpu.plan(TpuSlice(accelerator=p.accelerator, topology=p.topology))
    assert again == p and p.type_name == xpk
    assert tpu.plan(f"{xpk.split('-')[0]}-{p.topology}") == p
    gen = tpu.BY_ACCELERATOR[p.accelerator]
    assert gen.tensorcores_per_chip == cores
    assert tpu.maxtext_name(gen, p.chips) == f"{gen.maxtext_prefix}-{p.chips * cores}"


@pytest.mark.parametrize("gen", list(tpu.GENERATIONS.values()), ids=list(tpu.GENERATIONS))
def test_every_slice_of_every_generation_round_trips(gen: tpu.Generation) -> None:
    for name, topo in zip(tpu.type_names(gen.prefix), tpu.topologies(gen.prefix), strict=True):
        p = tpu.plan(name)
        assert p.topology == tpu.topology_for_chips(gen.prefix, p.chips)
        assert tpu.plan(TpuSlice(accelerator=gen.accelerator, topology=topo)).chips == p.chips
        assert len(topo.split("x")) == gen.dims
        assert p.machine_type in dict(gen.machine_types).values()
        assert p.hosts * p.chips_per_host == p.chips and p.devices == p.chips * gen.devices_per_chip


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("v4-8", "unknown TPU type 'v4-8'"),
        ("v5p-7", "must be a multiple of 2"),
        ("v5p-6", "no v5p slice has 3 chips"),
        ("v5p-2", "no v5p slice has 1 chips"),
        ("tpu7x-4x4x2", "did you mean 2x4x4?"),
        ("v5p-4x4x6", "not a v5p slice topology"),
        ("v5p", "unknown TPU type"),
        ("", "unknown TPU type"),
        (TpuSlice(accelerator="tpu-v5p-slice", topology="1x1x1"), "'1x1x1' is not a v5p slice topology"),
        (TpuSlice(accelerator="tpu7x", topology="2x2"), "tpu7x slices are 3-D (AxBxC)"),
        ("v5litepod-12", "no v5litepod slice has 12 chips"),
        ("v5litepod-2", "no v5litepod slice has 2 chips"),
        ("v5litepod-2x2x1", "'2x2x1' is not a v5litepod slice topology: v5litepod slices are 2-D (AxB)"),
        (TpuSlice(accelerator="tpu-v5-lite-podslice", topology="2x2x2"), "v5litepod slices are 2-D (AxB)"),
        (TpuSlice(accelerator="tpu-v5-lite-podslice", topology="4x2"), "(did you mean 2x4?)"),
        (TpuSlice(accelerator="tpu-v5-lite-podslice", topology="2x8"), "'2x8' is not a v5litepod slice"),
        ("v5p-2x4", "v5p slices are 3-D (AxBxC)"),
        ("v6e-2", "no v6e slice has 2 chips"),
        ("v6e-4x4x4", "v6e slices are 2-D (AxB)"),
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
    with pytest.raises(tpu.TpuError, match="4-chip tpu7x host"):
        tpu.plan("v5litepod-16", containers_per_host=2)
    assert tpu.default_containers("v5litepod-16", "trainer") == 1
    with pytest.raises(tpu.TpuError, match="1 or 2"):
        tpu.plan("tpu7x-8", containers_per_host=3)


@pytest.mark.parametrize("prefix", ["v5p", "tpu7x"])
def test_3d_topologies_sorted_by_chips(prefix: str) -> None:
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


@pytest.mark.parametrize(
    ("prefix", "topologies"),
    [
        ("v5litepod", ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
        ("v6e", ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")),
    ],
)
def test_2d_topologies(prefix: str, topologies: tuple[str, ...]) -> None:
    assert tpu.topologies(prefix) == topologies
    assert tpu.type_names(prefix) == [f"{prefix}-{tpu.chips_of(t)}" for t in topologies]


# accelerator, HBM GiB / peak bf16 TFLOP/s / HBM GB/s per chip, HBM bytes per JAX device
FIGURES = [
    ("tpu-v5p-slice", 95, 459, 2765, 95 * 2**30),
    ("tpu7x", 192, 2307, 7380, 96 * 2**30),
    ("tpu-v5-lite-podslice", 16, 197, 819, 16 * 2**30),
    ("tpu-v6e-slice", 32, 918, 1640, 32 * 2**30),
]


@pytest.mark.parametrize(("acc", "hbm", "tflops", "bandwidth", "per_device"), FIGURES)
def test_chip_figures(acc: str, hbm: int, tflops: float, bandwidth: float, per_device: int) -> None:
    gen = tpu.BY_ACCELERATOR[acc]
    assert (gen.hbm_gib_per_chip, gen.peak_bf16_tflops, gen.hbm_gb_per_s) == (hbm, tflops, bandwidth)
    assert tpu.hbm_bytes_per_device(acc) == per_device
    assert gen.spec_source.startswith("https://cloud.google.com/tpu/docs/")


def test_every_generation_is_in_the_tables_above() -> None:
    """A generation added to the table is added to these tests too."""
    assert {a for a, *_ in FIGURES} == set(tpu.BY_ACCELERATOR)
    assert {tpu.BY_NAME[n.split("-")[0]].prefix for n, *_ in NAMES} == set(tpu.GENERATIONS)


# full slice, most hosts, the slice a scaled rehearsal runs
SCALED = [
    ("v5p-8", 2, "v5p-8"),
    ("v5p-16", 2, "v5p-16"),
    ("v5p-64", 2, "v5p-16"),
    ("tpu7x-128", 2, "tpu7x-16"),
    ("tpu7x-2", 2, "tpu7x-2"),
    ("v5litepod-8", 2, "v5litepod-8"),
    ("v5litepod-1", 2, "v5litepod-1"),
    ("v5litepod-64", 2, "v5litepod-16"),  # v5e's smallest multi-host slice has 4 hosts
    ("v5litepod-64", 8, "v5litepod-32"),
    ("v6e-8", 2, "v6e-8"),
    ("v6e-256", 2, "v6e-16"),
]


@pytest.mark.parametrize(("full", "most", "scaled"), SCALED)
def test_scaled_slice(full: str, most: int, scaled: str) -> None:
    assert tpu.scaled_slice(tpu.plan(full), most).type_name == scaled
