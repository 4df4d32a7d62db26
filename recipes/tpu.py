"""TPU catalog for GKE: v5p and tpu7x (Ironwood) slices.

Facts (shared/reference/anchors.md §b, from xpk's system characteristics and the GKE docs):
- node labels cloud.google.com/gke-tpu-accelerator (tpu-v5p-slice | tpu7x) and
  cloud.google.com/gke-tpu-topology (AxBxC); pods request google.com/tpu;
- 4 chips per host (tpu7x 1x1x1: one chip on a tpu7x-standard-1t), hosts = chips / 4;
- xpk names count TensorCores, 2 per chip: v5p-8 = 4 chips, tpu7x-256 = 128 chips;
- JAX devices per chip: 1 on v5p (megacore), 2 on tpu7x (one per chiplet);
- topologies: 2x2x1, 2x2x2, 2x2x4, 2x4x4 and every 4i x 4j x 4k (i <= j <= k) up to 140 (v5p) or
  144 (tpu7x) 4x4x4 cubes; tpu7x also 1x1x1;
- tpu7x hosts can run two containers with 2 chips each (one per NUMA node), xpk's default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from rljob.recipes.api import TpuSlice
from rljob.recipes.runconfig import TpuPlan

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
PLACEMENT_POLICY_LABEL = "cloud.google.com/placement-policy-name"
TENSORCORES_PER_CHIP = 2


@dataclass(frozen=True)
class Generation:
    """One TPU generation as GKE and xpk name it."""

    prefix: str  # xpk type-name prefix: v5p, tpu7x
    accelerator: str  # gke-tpu-accelerator label value
    machine_type: str  # 4-chip host
    single_chip_machine_type: str | None  # 1x1x1 host, where one exists
    devices_per_chip: int
    max_cubes: int
    split_containers: bool  # two containers x 2 chips per host is possible
    # Multi-host node pools are created with a GKE workload policy (--placement-policy) instead of
    # --tpu-topology; pods then select it by name (xpk: requires_workload_policy).
    workload_policy: bool = False
    # How vLLM's TPU backend (tpu-inference, the sampler's) lists the generation: "recommended" or
    # "experimental" (https://github.com/vllm-project/tpu-inference, README "Compatible TPU Generations":
    # recommended v7x, v6e, v5e; experimental v3, v4, v5p).
    vllm_tpu_support: str = "recommended"
    # The oldest GKE version whose node pools run the generation, where GKE names one
    # (https://cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood; AI-Hypercomputer/tpu-recipes,
    # microbenchmarks/ironwood/README.md: "1.34.0-gke.2201000, the minimum required version for Ironwood").
    min_gke_version: str | None = None
    # HBM per chip, GiB (2**30 bytes): the "HBM capacity per chip (GiB)" row of the generation table in
    # https://cloud.google.com/tpu/docs/tpu7x ("System architecture": v5p 95, TPU7x 192; the v5p page,
    # https://cloud.google.com/tpu/docs/v5p, gives the same 95). A TPU7x chip is two chiplets, each one JAX
    # device with half the chip's HBM ("Dual-chiplet architecture" on the same page); a v5p chip is one
    # device (megacore). rljob.recipes.fit compares a role's bytes per device with hbm_bytes_per_device.
    hbm_gib_per_chip: int = 0
    # The most scoped VMEM (KiB) libtpu accepts for one compile (--xla_tpu_scoped_vmem_limit_kib,
    # rljob.recipes.libtpu), where known: a TPU7x device's is 67,043,328 bytes = 65472 KiB (libtpu refuses
    # 65536; MaxText's TPU7x recipes and train_compile sweeps, https://github.com/AI-Hypercomputer/maxtext,
    # set 65472).
    max_scoped_vmem_kib: int | None = None


GENERATIONS: dict[str, Generation] = {
    "v5p": Generation(
        "v5p",
        "tpu-v5p-slice",
        "ct5p-hightpu-4t",
        None,
        1,
        140,
        False,
        vllm_tpu_support="experimental",
        hbm_gib_per_chip=95,
    ),
    "tpu7x": Generation(
        "tpu7x",
        "tpu7x",
        "tpu7x-standard-4t",
        "tpu7x-standard-1t",
        2,
        144,
        True,
        True,
        min_gke_version="1.34.0-gke.2201000",
        hbm_gib_per_chip=192,
        max_scoped_vmem_kib=65472,
    ),
}
BY_ACCELERATOR: dict[str, Generation] = {g.accelerator: g for g in GENERATIONS.values()}

_SHORTHAND = re.compile(r"^(?P<prefix>[a-z0-9]+)-(?P<size>[0-9]+|[0-9]+x[0-9]+x[0-9]+)$")


class TpuError(ValueError):
    """A TPU shape that the catalog does not know; the message says why."""


@cache
def topologies(prefix: str) -> tuple[str, ...]:
    """Valid slice topologies of a generation, smallest first."""
    gen = GENERATIONS[prefix]
    out = ["1x1x1"] if gen.single_chip_machine_type else []
    out += ["2x2x1", "2x2x2", "2x2x4", "2x4x4"]
    cubes: list[tuple[int, int, int]] = []
    for i in range(1, gen.max_cubes + 1):
        for j in range(i, gen.max_cubes // i + 1):
            for k in range(j, gen.max_cubes // (i * j) + 1):
                cubes.append((4 * i, 4 * j, 4 * k))
    cubes.sort(key=lambda d: (d[0] * d[1] * d[2], d))
    out += [f"{a}x{b}x{c}" for a, b, c in cubes]
    return tuple(out)


def chips_of(topology: str) -> int:
    a, b, c = (int(x) for x in topology.split("x"))
    return a * b * c


def _squareness(topology: str) -> tuple[int, int]:
    dims = [int(x) for x in topology.split("x")]
    return (max(dims), sum(d * d for d in dims))


@cache
def topology_for_chips(prefix: str, chips: int) -> str | None:
    """The canonical (most cubic) topology with this many chips, as xpk's type names use."""
    candidates = [t for t in topologies(prefix) if chips_of(t) == chips]
    return min(candidates, key=_squareness) if candidates else None


def parse(value: str | TpuSlice) -> tuple[Generation, str]:
    """Shorthand (`v5p-16`, `tpu7x-256`, `tpu7x-4x4x4`) or object form -> (generation, topology)."""
    if isinstance(value, TpuSlice):
        gen = BY_ACCELERATOR[value.accelerator]
        topo = value.topology
    else:
        m = _SHORTHAND.match(value.strip())
        if not m or m["prefix"] not in GENERATIONS:
            raise TpuError(
                f"unknown TPU type {value!r}; expected v5p-N or tpu7x-N (N = TensorCores = 2 x chips), "
                "or {accelerator, topology}"
            )
        gen = GENERATIONS[m["prefix"]]
        size = m["size"]
        if "x" in size:
            topo = size
        else:
            cores = int(size)
            if cores % TENSORCORES_PER_CHIP:
                raise TpuError(f"{value!r}: N counts TensorCores (2 per chip) and must be even")
            found = topology_for_chips(gen.prefix, cores // TENSORCORES_PER_CHIP)
            if found is None:
                raise TpuError(
                    f"{value!r}: no {gen.prefix} slice has {cores // TENSORCORES_PER_CHIP} chips; "
                    f"valid sizes start {', '.join(type_names(gen.prefix)[:8])}, ..."
                )
            topo = found
    if topo not in topologies(gen.prefix):
        dims = sorted(int(x) for x in topo.split("x")) if re.fullmatch(r"\d+x\d+x\d+", topo) else None
        hint = ""
        if dims is not None and f"{dims[0]}x{dims[1]}x{dims[2]}" in topologies(gen.prefix):
            hint = f" (did you mean {dims[0]}x{dims[1]}x{dims[2]}?)"
        raise TpuError(f"topology {topo!r} is not a {gen.prefix} slice topology{hint}")
    return gen, topo


def hbm_bytes_per_device(accelerator: str) -> int:
    """HBM of one JAX device of a generation (by its gke-tpu-accelerator label value), in bytes."""
    gen = BY_ACCELERATOR[accelerator]
    return gen.hbm_gib_per_chip * 2**30 // gen.devices_per_chip


def type_names(prefix: str) -> list[str]:
    return [f"{prefix}-{chips_of(t) * TENSORCORES_PER_CHIP}" for t in topologies(prefix)]


def plan(value: str | TpuSlice, containers_per_host: int | None = None) -> TpuPlan:
    """Resolve a TPU shape into a TpuPlan. `containers_per_host` None means one container per host."""
    gen, topo = parse(value)
    chips = chips_of(topo)
    chips_per_host = 1 if chips == 1 else 4
    hosts = chips // chips_per_host
    containers = containers_per_host or 1
    if containers not in (1, 2):
        raise TpuError(f"containersPerHost must be 1 or 2, not {containers}")
    if containers == 2 and not (gen.split_containers and chips_per_host == 4):
        raise TpuError(f"two containers per host need a 4-chip tpu7x host, not {gen.prefix} {topo}")
    machine = gen.single_chip_machine_type if chips_per_host == 1 else gen.machine_type
    assert machine is not None
    policy = placement_policy_name(gen, chips, topo) if gen.workload_policy and hosts > 1 else None
    return TpuPlan(
        accelerator=gen.accelerator,
        topology=topo,
        type_name=f"{gen.prefix}-{chips * TENSORCORES_PER_CHIP}",
        machine_type=machine,
        chips=chips,
        hosts=hosts,
        chips_per_host=chips_per_host,
        devices_per_chip=gen.devices_per_chip,
        devices=chips * gen.devices_per_chip,
        containers_per_host=containers,
        chips_per_container=chips_per_host // containers,
        placement_policy=policy,
    )


def placement_policy_name(gen: Generation, chips: int, topology: str) -> str:
    """The workload policy of a multi-host slice's node pool, named as xpk and docs/gke.md name it:
    `tpu7x-<TensorCores>-<topology>-placement-policy`."""
    return f"{gen.prefix}-{chips * TENSORCORES_PER_CHIP}-{topology}-placement-policy"


def default_containers(value: str | TpuSlice, role: str) -> int:
    """xpk's default: tpu7x trainers split each 4-chip host into two containers; everything else one."""
    gen, topo = parse(value)
    return 2 if role == "trainer" and gen.split_containers and chips_of(topo) >= 4 else 1
