"""The TPU generations rljob runs on: one row each, every per-generation fact in one place.

Everything that differs by generation is read from :data:`GENERATIONS`: the type names the plan accepts
(rljob.recipes.tpu), the node labels pods select (rljob.recipes.placement), the CRD's and the API's field
descriptions (rljob.recipes.api, hack/gen_crd.py), the fit check's HBM per device (rljob.recipes.fit), the
compile stage's chip figures (rljob.trainer.compilecheck) and MaxText's name of the slice it compiles for,
``rljob doctor``'s node-pool commands (rljob.cli.doctor.nodepools), ``rljob plan``'s word on vLLM's TPU
support and the trainer's check at start of the devices it runs on (rljob.trainer.devices). Adding a
generation is one row here, its tests and the generated files.

This module imports nothing of rljob: the API models (rljob.recipes.api) read it to name the accelerator
labels they accept.

Sources, per field (public pages):

- ``prefix``, ``tensorcores_per_chip``, ``accelerator``, the machine types and the topologies: xpk's system
  characteristics (https://github.com/AI-Hypercomputer/xpk, src/xpk/core/system_characteristics.py: the
  type name is ``{prefix}-{TensorCores}``; ``v5litepod`` / ``tpu-v5-lite-podslice``, ``v6e`` /
  ``tpu-v6e-slice``, ``v5p`` / ``tpu-v5p-slice``, ``tpu7x`` / ``tpu7x``) and Google's generation pages
  (https://cloud.google.com/tpu/docs/v5e, https://cloud.google.com/tpu/docs/v6e: "Supported configurations",
  2-D slices 1x1 ... 16x16 on 1-, 4- and 8-chip VMs, the 2x4 slice one 8-chip VM;
  https://cloud.google.com/tpu/docs/v5p, https://cloud.google.com/tpu/docs/tpu7x: 3-D slices on 4-chip VMs);
  GKE's node labels and machine types: https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus;
- ``maxtext_prefix``: MaxText's ``accelerator_to_spec_map`` (maxtext/utils/accelerator_to_spec_map.py in
  https://github.com/AI-Hypercomputer/maxtext) names slices ``{maxtext_prefix}-{TensorCores}``: ``v5e-16``,
  ``v6e-8``, ``v5p-8``, ``tpu7x-8``;
- ``device_kinds``: JAX's names of the generation's devices, ``chip_version_from_device_kind`` in
  jax/_src/tpu_info.py (https://github.com/jax-ml/jax): "TPU v5 lite" or "TPU v5e", "TPU v6 lite" or
  "TPU v6e", "TPU v5" or "TPU v5p", "TPU7x";
- ``hbm_gib_per_chip``, ``peak_bf16_tflops``, ``hbm_gb_per_s``, ``ici_gbps_per_chip``: the generation's page
  (``spec_source``);
- ``hbm_limit_bytes_per_chip``: measured, not published: what libtpu's allocator lets one process hold on a
  chip (JAX's ``memory_stats()['bytes_limit']``), read on a chip of the generation (hack/tpu/README.md;
  tests/tpu/test_memory_stats_chip.py asserts it); libtpu keeps the rest. Where it is 0 (not measured yet),
  :func:`hbm_limit_bytes` holds back :data:`UNMEASURED_HBM_RESERVE` of the published HBM instead;
- ``vllm_tpu_support``: vLLM's TPU backend, https://github.com/vllm-project/tpu-inference, README
  "Compatible TPU Generations": recommended v7x, v6e, v5e; experimental v3, v4, v5p;
- ``vllm_quantization_name``: how the same backend's quantization table names the generation ("v5", "v6",
  "v7": docs/includes/quantization.md, column "Supported Hardware Acceleration"), which
  rljob.recipes.quantization reads to say which quantized checkpoints a sampler of the generation serves.
"""

from __future__ import annotations

from dataclasses import dataclass

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
PLACEMENT_POLICY_LABEL = "cloud.google.com/placement-policy-name"


@dataclass(frozen=True)
class Generation:
    """One TPU generation as GKE, xpk, MaxText and Google's pages name and describe it."""

    prefix: str  # xpk's (and Google's) type-name prefix: v5litepod-16, v6e-8, v5p-8, tpu7x-8
    maxtext_prefix: str  # MaxText's: v5e-16, v6e-8, v5p-8, tpu7x-8; also accepted as a type name
    accelerator: str  # node label cloud.google.com/gke-tpu-accelerator
    tensorcores_per_chip: int  # the N of a type name counts TensorCores
    devices_per_chip: (
        int  # JAX devices per chip (v5p: one megacore device of two cores; TPU7x: one a chiplet)
    )
    # GCE machine type of a host by its chips: a slice of that many chips is one host of that type; a larger
    # slice is hosts of `multi_host_chips` chips each.
    machine_types: tuple[tuple[int, str], ...]
    multi_host_chips: int
    # What JAX names a device of the generation (``jax.Device.device_kind``): the trainer refuses to start
    # on a device of another generation (rljob.trainer.devices); the chip tier and the bench read a chip's
    # figures by it.
    device_kinds: tuple[str, ...]
    # Slice topologies: 2-D generations list theirs (`topologies_2d`); 3-D ones are 2x2x1, 2x2x2, 2x2x4,
    # 2x4x4 and every 4i x 4j x 4k (i <= j <= k) up to `max_cubes` 4x4x4 cubes (and 1x1x1 where a 1-chip
    # machine type exists).
    topologies_2d: tuple[str, ...] = ()
    max_cubes: int = 0
    hbm_gib_per_chip: int = 0  # HBM per chip, GiB (2**30 bytes)
    hbm_limit_bytes_per_chip: int = 0  # of it, what one process may allocate (measured; 0: not yet)
    peak_bf16_tflops: float = 0.0  # peak bf16 compute per chip
    hbm_gb_per_s: float = 0.0  # HBM bandwidth per chip, GB/s (1e9 bytes)
    spec_source: str = ""  # the public page of the three figures above
    # Inter-chip interconnect (ICI) bandwidth per chip, Gbps, as the same page states it ("Interchip
    # Interconnect BW"); 0: not stated there. The collectives term of bench/train_step_compiled.py's roofline.
    ici_gbps_per_chip: float = 0.0
    # How vLLM's TPU backend (tpu-inference, the sampler's) lists the generation: "recommended" or
    # "experimental".
    vllm_tpu_support: str = "recommended"
    # The generation's name in vLLM's TPU backend's quantization table ("v5", "v6", "v7"); "": not listed
    # there (its samplers serve bfloat16 weights only).
    vllm_quantization_name: str = ""
    split_containers: bool = False  # a 4-chip host may run two containers of 2 chips (one per NUMA node)
    # Multi-host node pools are created with a GKE workload policy (--placement-policy) instead of
    # --tpu-topology; pods then select it by name (xpk: requires_placement_policy).
    workload_policy: bool = False
    # The oldest GKE version whose node pools run the generation, where GKE names one.
    min_gke_version: str | None = None
    # The most scoped VMEM (KiB) libtpu accepts for one compile (--xla_tpu_scoped_vmem_limit_kib,
    # rljob.recipes.libtpu), where known.
    max_scoped_vmem_kib: int | None = None

    @property
    def dims(self) -> int:
        """Dimensions of the generation's topologies: 2 (AxB) or 3 (AxBxC)."""
        return 2 if self.topologies_2d else 3

    @property
    def names(self) -> tuple[str, ...]:
        """The type-name prefixes the plan accepts: xpk's first, then MaxText's where it differs."""
        return tuple(dict.fromkeys((self.prefix, self.maxtext_prefix)))


# The share of a generation's published HBM the compile stage holds back for libtpu where its allocator's
# limit has not been measured: more than the 1.6% a v5e's keeps (16,909,336,064 of 16 GiB), so that an
# unmeasured generation refuses a program near its HBM rather than accept one that cannot be allocated.
UNMEASURED_HBM_RESERVE = 0.03


def hbm_limit_bytes(gen: Generation) -> int:
    """What one process may allocate on a chip of ``gen``: the measured limit, else the published HBM less
    :data:`UNMEASURED_HBM_RESERVE`."""
    nominal = gen.hbm_gib_per_chip * 2**30
    return gen.hbm_limit_bytes_per_chip or int(nominal * (1 - UNMEASURED_HBM_RESERVE))


GENERATIONS: dict[str, Generation] = {
    "v5p": Generation(
        prefix="v5p",
        maxtext_prefix="v5p",
        accelerator="tpu-v5p-slice",
        tensorcores_per_chip=2,
        devices_per_chip=1,
        machine_types=((4, "ct5p-hightpu-4t"),),
        multi_host_chips=4,
        device_kinds=("TPU v5", "TPU v5p"),
        max_cubes=140,
        # "Peak compute per chip (bf16) 459 TFLOPs; HBM2e capacity and bandwidth 95GB, 2765 GBps"; 95 GiB in
        # the TPU7x page's comparison table ("HBM capacity per chip (GiB)").
        hbm_gib_per_chip=95,
        peak_bf16_tflops=459,
        hbm_gb_per_s=2765,
        ici_gbps_per_chip=4800,  # "Interchip Interconnect BW 4,800 Gbps"
        spec_source="https://cloud.google.com/tpu/docs/v5p",
        vllm_quantization_name="v5",
        vllm_tpu_support="experimental",
    ),
    "tpu7x": Generation(
        prefix="tpu7x",
        maxtext_prefix="tpu7x",
        accelerator="tpu7x",
        tensorcores_per_chip=2,
        # A TPU7x chip is two chiplets, each one JAX device with half the chip's HBM ("Dual-chiplet
        # architecture").
        devices_per_chip=2,
        machine_types=((1, "tpu7x-standard-1t"), (4, "tpu7x-standard-4t")),
        multi_host_chips=4,
        device_kinds=("TPU7x",),
        max_cubes=144,
        # Per chip: 2307 TFLOPs BF16, 192 GiB HBM, 7380 GBps HBM bandwidth.
        hbm_gib_per_chip=192,
        peak_bf16_tflops=2307,
        hbm_gb_per_s=7380,
        spec_source="https://cloud.google.com/tpu/docs/tpu7x",
        vllm_quantization_name="v7",
        split_containers=True,
        workload_policy=True,
        # https://cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood; AI-Hypercomputer/tpu-recipes,
        # microbenchmarks/ironwood/README.md: "1.34.0-gke.2201000, the minimum required version for Ironwood".
        min_gke_version="1.34.0-gke.2201000",
        # 67,043,328 bytes = 65472 KiB (libtpu refuses 65536; MaxText's TPU7x recipes and train_compile
        # sweeps, https://github.com/AI-Hypercomputer/maxtext, set 65472).
        max_scoped_vmem_kib=65472,
    ),
    "v5litepod": Generation(
        prefix="v5litepod",
        maxtext_prefix="v5e",
        accelerator="tpu-v5-lite-podslice",
        tensorcores_per_chip=1,
        devices_per_chip=1,
        machine_types=((1, "ct5lp-hightpu-1t"), (4, "ct5lp-hightpu-4t"), (8, "ct5lp-hightpu-8t")),
        multi_host_chips=4,
        device_kinds=("TPU v5 lite", "TPU v5e"),  # the first, on a v5litepod-1 chip (hack/tpu/figures)
        topologies_2d=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
        # "Peak compute per chip (bf16) 197 TFLOPs", "HBM capacity per chip 16 GiB", "HBM bandwidth per chip
        # 819 GBps".
        hbm_gib_per_chip=16,
        # bytes_limit on a v5litepod-1 chip (jax 0.12.0.1, libtpu 0.0.50.1; 2026-12-07, every run): 258 MiB
        # short of the 16 GiB.
        hbm_limit_bytes_per_chip=16_909_336_064,
        peak_bf16_tflops=197,
        hbm_gb_per_s=819,
        ici_gbps_per_chip=1600,  # "Interchip Interconnect BW 1,600 Gbps"
        spec_source="https://cloud.google.com/tpu/docs/v5e",
        vllm_quantization_name="v5",
    ),
    "v6e": Generation(
        prefix="v6e",
        maxtext_prefix="v6e",
        accelerator="tpu-v6e-slice",
        tensorcores_per_chip=1,
        devices_per_chip=1,
        machine_types=((1, "ct6e-standard-1t"), (4, "ct6e-standard-4t"), (8, "ct6e-standard-8t")),
        multi_host_chips=4,
        device_kinds=("TPU v6 lite", "TPU v6e"),
        topologies_2d=("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
        # "Peak compute per chip (bf16) 918 TFLOPs", "HBM capacity per chip 32 GB" (32 GiB in the TPU7x page's
        # comparison table), "HBM bandwidth per chip 1640 GBps".
        hbm_gib_per_chip=32,
        peak_bf16_tflops=918,
        hbm_gb_per_s=1640,
        ici_gbps_per_chip=3584,  # "Interchip Interconnect BW 3,584 Gbps"
        spec_source="https://cloud.google.com/tpu/docs/v6e",
        vllm_quantization_name="v6",
    ),
}
BY_ACCELERATOR: dict[str, Generation] = {g.accelerator: g for g in GENERATIONS.values()}
BY_NAME: dict[str, Generation] = {n: g for g in GENERATIONS.values() for n in g.names}
BY_DEVICE_KIND: dict[str, Generation] = {k: g for g in GENERATIONS.values() for k in g.device_kinds}
