"""TPU slices for GKE: type names and topologies -> the plan of one slice, from the generation table.

Every per-generation fact (labels, machine types, TensorCores and JAX devices per chip, topologies, HBM,
peak FLOP/s, bandwidth, vLLM's support) is a row of :data:`rljob.recipes.generations.GENERATIONS`; this
module only applies them:

- a type name is ``{prefix}-{N}`` with N the slice's TensorCores, as xpk and Google's docs name slices
  (``v5litepod-16`` = 16 chips of one TensorCore, ``v5p-16`` = 8 chips of two), or ``{prefix}-{topology}``
  (``tpu7x-4x4x4``, ``v6e-4x4``); MaxText's prefix is accepted too (``v5e-16``); the object form
  ``{accelerator, topology}`` takes GKE's node label values (cloud.google.com/gke-tpu-accelerator,
  cloud.google.com/gke-tpu-topology);
- a slice of as many chips as one machine type holds is one host of that type; a larger one is hosts of
  ``multi_host_chips`` chips (4 on every generation here: v5e 4x4 is 4 ct5lp-hightpu-4t hosts, 2x4 one
  ct5lp-hightpu-8t);
- pods request google.com/tpu (a host's chips, or a container's share of a split host).
"""

from __future__ import annotations

import re
from functools import cache

from rljob.recipes.api import TpuSlice
from rljob.recipes.generations import (
    ACCELERATOR_LABEL,
    BY_ACCELERATOR,
    BY_NAME,
    GENERATIONS,
    PLACEMENT_POLICY_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
    Generation,
)
from rljob.recipes.runconfig import TpuPlan

__all__ = [
    "ACCELERATOR_LABEL",
    "BY_ACCELERATOR",
    "BY_NAME",
    "GENERATIONS",
    "PLACEMENT_POLICY_LABEL",
    "TOPOLOGY_LABEL",
    "TPU_RESOURCE",
    "Generation",
    "TpuError",
    "chips_of",
    "chips_per_host",
    "default_containers",
    "hbm_bytes_per_device",
    "machine_type",
    "maxtext_name",
    "maxtext_type",
    "parse",
    "placement_policy_name",
    "plan",
    "scaled_slice",
    "topologies",
    "topology_for_chips",
    "type_name",
    "type_names",
]

_SHORTHAND = re.compile(r"^(?P<prefix>[a-z0-9]+)-(?P<size>[0-9]+|[0-9]+x[0-9]+(?:x[0-9]+)?)$")


class TpuError(ValueError):
    """A TPU shape that the catalog does not know; the message says why."""


def _examples() -> str:
    return ", ".join(f"{g.prefix}-N" for g in GENERATIONS.values())


@cache
def topologies(prefix: str) -> tuple[str, ...]:
    """Valid slice topologies of a generation, smallest first."""
    gen = GENERATIONS[prefix]
    if gen.topologies_2d:
        return tuple(sorted(gen.topologies_2d, key=lambda t: (chips_of(t), t)))
    out = ["1x1x1"] if 1 in dict(gen.machine_types) else []
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
    chips = 1
    for x in topology.split("x"):
        chips *= int(x)
    return chips


def _squareness(topology: str) -> tuple[int, int]:
    dims = [int(x) for x in topology.split("x")]
    return (max(dims), sum(d * d for d in dims))


@cache
def topology_for_chips(prefix: str, chips: int) -> str | None:
    """The canonical (most cubic) topology with this many chips, as xpk's type names use."""
    candidates = [t for t in topologies(prefix) if chips_of(t) == chips]
    return min(candidates, key=_squareness) if candidates else None


def chips_per_host(gen: Generation, chips: int) -> int:
    """Chips of one host of a slice: the whole slice where one machine type holds it, else the
    generation's multi-host host."""
    return chips if chips in dict(gen.machine_types) else gen.multi_host_chips


def machine_type(gen: Generation, chips: int) -> str:
    """The GCE machine type of one host of a slice of ``chips`` chips."""
    return dict(gen.machine_types)[chips_per_host(gen, chips)]


def type_name(gen: Generation, chips: int) -> str:
    """xpk's name of a slice: ``{prefix}-{TensorCores}``."""
    return f"{gen.prefix}-{chips * gen.tensorcores_per_chip}"


def maxtext_name(gen: Generation, chips: int) -> str:
    """MaxText's name of a slice (its accelerator_to_spec_map): ``{maxtext_prefix}-{TensorCores}``."""
    return f"{gen.maxtext_prefix}-{chips * gen.tensorcores_per_chip}"


def maxtext_type(p: TpuPlan) -> str:
    """MaxText's name of a planned slice (its compile target, ``compile_topology``)."""
    return maxtext_name(BY_ACCELERATOR[p.accelerator], p.chips)


def _topology_problem(gen: Generation, topo: str) -> str:
    dims = sorted(int(x) for x in topo.split("x"))
    if len(dims) != gen.dims:
        shape = "AxB" if gen.dims == 2 else "AxBxC"
        return (
            f"topology {topo!r} is not a {gen.prefix} slice topology: {gen.prefix} slices are "
            f"{gen.dims}-D ({shape}), e.g. {topologies(gen.prefix)[1]}"
        )
    canonical = "x".join(str(d) for d in dims)
    hint = f" (did you mean {canonical}?)" if canonical in topologies(gen.prefix) else ""
    return f"topology {topo!r} is not a {gen.prefix} slice topology{hint}"


def parse(value: str | TpuSlice) -> tuple[Generation, str]:
    """Type name (`v5p-16`, `v5litepod-16`, `v5e-16`, `tpu7x-4x4x4`, `v6e-4x4`) or object form ->
    (generation, topology)."""
    if isinstance(value, TpuSlice):
        gen = BY_ACCELERATOR[value.accelerator]
        topo = value.topology
    else:
        m = _SHORTHAND.match(value.strip())
        if not m or m["prefix"] not in BY_NAME:
            raise TpuError(
                f"unknown TPU type {value!r}; expected {_examples()} (N = TensorCores: "
                + ", ".join(f"{g.tensorcores_per_chip} per {g.prefix} chip" for g in GENERATIONS.values())
                + "), or {accelerator, topology}"
            )
        gen = BY_NAME[m["prefix"]]
        size = m["size"]
        if "x" in size:
            topo = size
        else:
            cores, per_chip = int(size), gen.tensorcores_per_chip
            if cores % per_chip:
                raise TpuError(
                    f"{value!r}: N counts TensorCores ({per_chip} per {gen.prefix} chip) and must be a "
                    f"multiple of {per_chip}"
                )
            found = topology_for_chips(gen.prefix, cores // per_chip)
            if found is None:
                raise TpuError(
                    f"{value!r}: no {gen.prefix} slice has {cores // per_chip} chips; "
                    f"valid sizes start {', '.join(type_names(gen.prefix)[:8])}, ..."
                )
            topo = found
    if topo not in topologies(gen.prefix):
        raise TpuError(_topology_problem(gen, topo))
    return gen, topo


def hbm_bytes_per_device(accelerator: str) -> int:
    """HBM of one JAX device of a generation (by its gke-tpu-accelerator label value), in bytes."""
    gen = BY_ACCELERATOR[accelerator]
    return gen.hbm_gib_per_chip * 2**30 // gen.devices_per_chip


def type_names(prefix: str) -> list[str]:
    gen = GENERATIONS[prefix]
    return [type_name(gen, chips_of(t)) for t in topologies(prefix)]


def plan(value: str | TpuSlice, containers_per_host: int | None = None) -> TpuPlan:
    """Resolve a TPU shape into a TpuPlan. `containers_per_host` None means one container per host."""
    gen, topo = parse(value)
    chips = chips_of(topo)
    per_host = chips_per_host(gen, chips)
    hosts = chips // per_host
    containers = containers_per_host or 1
    if containers not in (1, 2):
        raise TpuError(f"containersPerHost must be 1 or 2, not {containers}")
    if containers == 2 and not (gen.split_containers and per_host == 4):
        split = " or ".join(g.prefix for g in GENERATIONS.values() if g.split_containers)
        raise TpuError(f"two containers per host need a 4-chip {split} host, not {gen.prefix} {topo}")
    policy = placement_policy_name(gen, chips, topo) if gen.workload_policy and hosts > 1 else None
    return TpuPlan(
        accelerator=gen.accelerator,
        topology=topo,
        type_name=type_name(gen, chips),
        machine_type=machine_type(gen, chips),
        chips=chips,
        hosts=hosts,
        chips_per_host=per_host,
        devices_per_chip=gen.devices_per_chip,
        devices=chips * gen.devices_per_chip,
        containers_per_host=containers,
        chips_per_container=per_host // containers,
        placement_policy=policy,
    )


def scaled_slice(full: TpuPlan, max_hosts: int) -> TpuPlan:
    """The slice of ``full``'s generation that a rehearsal of at most ``max_hosts`` hosts runs (``rljob
    drill``'s scaled run): ``full`` itself where it has no more hosts; else the multi-host slice with the
    most hosts up to ``max_hosts``, or the generation's smallest multi-host slice where none is that small
    (v5e's and v6e's smallest is 4x4, four 4-chip hosts: their 2x4 is one 8-chip host)."""
    if full.hosts <= max_hosts:
        return full
    gen = BY_ACCELERATOR[full.accelerator]
    multi = [
        (chips_of(t) // chips_per_host(gen, chips_of(t)), t)
        for t in topologies(gen.prefix)
        if chips_of(t) > chips_per_host(gen, chips_of(t))
    ]
    fitting = [m for m in multi if m[0] <= max_hosts]
    _, topo = max(fitting) if fitting else min(multi)
    return plan(type_name(gen, chips_of(topo)), full.containers_per_host)


def placement_policy_name(gen: Generation, chips: int, topology: str) -> str:
    """The workload policy of a multi-host slice's node pool, named as xpk and docs/gke.md name it:
    `tpu7x-<TensorCores>-<topology>-placement-policy`."""
    return f"{type_name(gen, chips)}-{topology}-placement-policy"


def default_containers(value: str | TpuSlice, role: str) -> int:
    """xpk's default: trainers on a generation whose 4-chip hosts split (tpu7x) run two containers per
    host; everything else one."""
    gen, topo = parse(value)
    return 2 if role == "trainer" and gen.split_containers and chips_of(topo) >= 4 else 1
