"""The local disk of each host's caches: what a trainer or sampler host downloads and keeps, in bytes.

The caches of common/caches.py (the sampler's model download, each role's compilation cache) live in
rljob's emptyDir volume ``CACHE_VOLUME`` at ``LOCAL_CACHE_DEFAULT`` (rljob.recipes.runconfig), not in the
container's writable layer. Its ``sizeLimit`` and the containers' ``ephemeral-storage`` requests are the
size computed here, per host (one pod), so the scheduler places a pod only on a node whose boot disk (or
local SSD) can hold it and the kubelet does not evict it for what it was always going to write
(https://kubernetes.io/docs/concepts/configuration/manage-resources-containers/#local-ephemeral-storage).

What a host holds:

- sampler: the whole model's weights in the checkpoint's dtype (bf16, the dtype the catalog's samplers
  serve: ``rljob.recipes.fit.SAMPLER_WEIGHT_BYTES``), on every host of a replica. vLLM's TPU backend
  downloads every ``*.safetensors`` file of the model to ``--download-dir`` on each host whatever its
  shard (tpu-inference ``get_model_weights_files`` in tpu_inference/models/jax/utils/weight_utils.py,
  ``download_model_weights_from_hf`` in file_utils.py), and rljob restores the whole ``hf`` cache on
  each host (rljob.sampler.main). Plus tpu-inference's XLA compilation cache;
- trainer: JAX's compilation cache; and, where the manifest names no spec.model.checkpoint, the scratch
  space of the trainer's own conversion of spec.model.name (rljob.trainer.hf_weights.ensure_converted),
  which holds both at once until the conversion ends: the downloaded Hugging Face files (counted in bf16,
  an upper bound where the Hub's files are quantized) and the converted MaxText leaves, file-backed, in
  the checkpoint's dtype (:func:`converted_dtype`) before orbax writes them to storage. Only host 0
  converts, but a role's hosts share one pod template, so every trainer host is sized for it. Otherwise
  the trainer stages no checkpoint locally: orbax reads the converted checkpoint and the run's
  checkpoints from storage itself.

Headroom: ``HEADROOM`` over the counted bytes (the weights are counted from the shapes without norms,
biases and the checkpoint's small files; a restored file is written beside its final name before the
rename), then rounded up to whole GiB per TPU container of the pod (its requests add up to the emptyDir's
``sizeLimit``). The compilation caches are a stated allowance, not a measurement.
A template's own ``resources.requests.ephemeral-storage`` wins (docs/pod-overrides.md): the emptyDir's
``sizeLimit`` is then that request times the pod's TPU containers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from rljob.recipes import fit, k8s_rules, maxtext_keys
from rljob.recipes.api import PodTemplate
from rljob.recipes.runconfig import LOCAL_CACHE_DEFAULT, CacheDisk, TpuPlan

GIB: Final = 2**30
HEADROOM: Final = 0.10
"""Fraction added to the counted bytes (see the module docstring)."""
COMPILE_CACHE_BYTES: Final = 16 * GIB
"""Allowance per host for a role's compilation cache (JAX's persistent cache for the trainer,
tpu-inference's VLLM_XLA_CACHE_PATH for the sampler): serialized executables of a few programs (the
trainer's step and log-prob head; the sampler's prefill and decode buckets), each a fraction of this."""
EPHEMERAL: Final = "ephemeral-storage"


def _params(model: str, keys: Mapping[str, Any], version: str) -> int:
    s = fit.shapes(model, keys, version)
    return 0 if s is None else fit.params(s).total


def weight_bytes(model: str, keys: Mapping[str, Any], version: str = maxtext_keys.DEFAULT_VERSION) -> int:
    """The model's weights in the checkpoint's dtype (bf16); 0 for a model whose shapes are unknown (the
    plan refuses its name)."""
    return _params(model, keys, version) * fit.SAMPLER_WEIGHT_BYTES


def converted_dtype(weight_dtype: Any) -> str:
    """The dtype of the leaves the trainer's conversion writes (rljob.trainer.hf_weights.convert) for
    MaxText's effective ``weight_dtype`` (None: MaxText's default, float32): float32 for float32, else
    bfloat16."""
    return "float32" if str(weight_dtype or "float32") == "float32" else "bfloat16"


def conversion_bytes(model: str, keys: Mapping[str, Any], version: str) -> dict[str, int]:
    """The trainer's conversion scratch on its cache disk (see the module docstring), by what it holds."""
    n = _params(model, keys, version)
    if n == 0:  # shapes unknown: the plan refuses the model or the version
        return {"conversion_download": 0, "conversion_leaves": 0}
    weight_dtype = maxtext_keys.effective(keys, maxtext_keys.load(version), model)("weight_dtype")
    leaf = 4 if converted_dtype(weight_dtype) == "float32" else 2
    return {"conversion_download": n * fit.SAMPLER_WEIGHT_BYTES, "conversion_leaves": n * leaf}


def parts(
    role: str, model: str, keys: Mapping[str, Any], version: str, converts: bool = False
) -> dict[str, int]:
    """Bytes per host of a role's caches, by what they hold; ``converts``: the trainer converts
    spec.model.name itself (no spec.model.checkpoint)."""
    out = {"compilation_cache": COMPILE_CACHE_BYTES}
    if role == "sampler":
        out = {"model_weights": weight_bytes(model, keys, version), **out}
    elif converts:
        out = {**conversion_bytes(model, keys, version), **out}
    return out


def sized(counted: int) -> int:
    """The counted bytes with HEADROOM, rounded up to whole GiB."""
    return math.ceil(counted * (1 + HEADROOM) / GIB) * GIB


def _gi(n: int) -> str:
    return f"{math.ceil(n / GIB)}Gi"


def _user_request(template: PodTemplate | None) -> str | None:
    """The template's ephemeral-storage request (a limit alone sets it, as rljob.recipes.overrides.resources
    merges them), or None."""
    res = template and template.spec and template.spec.resources
    if not res:
        return None
    value = (res.requests or {}).get(EPHEMERAL) or (res.limits or {}).get(EPHEMERAL)
    return None if value is None else str(value)


def plan(
    role: str,
    model: str,
    keys: Mapping[str, Any],
    version: str,
    tpu: TpuPlan,
    template: PodTemplate | None,
    converts: bool = False,
) -> CacheDisk:
    """The cache disk of one host of a role: rljob's size, the emptyDir's sizeLimit and each TPU
    container's ephemeral-storage request (the template's request, where it sets one); ``converts`` as
    in :func:`parts`."""
    counted = parts(role, model, keys, version, converts)
    n = tpu.containers_per_host
    size = math.ceil(sized(sum(counted.values())) / (n * GIB)) * n * GIB  # whole GiB per container
    user = _user_request(template)
    if user is None:
        request, limit = _gi(math.ceil(size / n)), _gi(size)
    else:
        request = user
        total = math.ceil((k8s_rules.quantity(user) or 0) * n)  # not a quantity: the template check says so
        limit = user if n == 1 else _gi(total) if total % GIB == 0 else str(total)
    return CacheDisk(
        path=LOCAL_CACHE_DEFAULT,
        parts=counted,
        bytes=size,
        size_limit=limit,
        request=request,
        source="rljob" if user is None else "template",
    )


# ------------------------------------------------------------------------------ the node's boot disk
# A GKE node's pods share the ephemeral storage of its boot disk (100 GB unless the node pool's
# --disk-size says otherwise, https://cloud.google.com/sdk/gcloud/reference/container/node-pools/create).
# GKE keeps part of it back (https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes,
# "Local ephemeral storage reservation"): the eviction threshold, 10% of the file system, and a system
# reservation of min(50% of the disk, 6 GiB + 35% of the disk, 100 GiB). The file system holds
# FS_FRACTION of the disk: the page's example node, a 100 GB boot disk, has 98831908Ki of capacity and
# 47060071478 bytes allocatable, which these figures give to within 0.1%.
DEFAULT_BOOT_DISK_GB: Final = 100
FS_FRACTION: Final = 0.9425
IMAGES_BYTES: Final = 20 * GIB
"""Room for the container images on the same disk (the trainer's JAX and MaxText, the sampler's vLLM and
torch): a stated allowance."""


def allocatable_bytes(disk_gb: int) -> int:
    """Ephemeral storage a GKE node with a boot disk of ``disk_gb`` (GiB, as Compute Engine sizes disks)
    leaves to its pods."""
    fs = disk_gb * FS_FRACTION
    system = min(0.5 * disk_gb, 6 + 0.35 * disk_gb, 100)
    return int((0.9 * fs - system) * GIB)


def boot_disk_gb(request_bytes: int) -> int:
    """The smallest boot disk, in steps of 10 GB and at least GKE's default, whose allocatable ephemeral
    storage holds one pod's cache request and the images."""
    need, gb = request_bytes + IMAGES_BYTES, DEFAULT_BOOT_DISK_GB
    while allocatable_bytes(gb) < need:
        gb += 10
    return gb


def pod_bytes(disk: CacheDisk) -> int:
    """What one pod asks of its node's ephemeral storage: the cache emptyDir's sizeLimit."""
    return int(k8s_rules.quantity(disk.size_limit) or 0)


def summary(role: str, disk: CacheDisk) -> str:
    """A line for `rljob plan`."""
    counted = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.1f} GiB" for k, v in disk.parts.items())
    line = (
        f"{role} cache disk: {disk.bytes / GIB:.0f} GiB per host at {disk.path} ({counted}, "
        f"+{HEADROOM:.0%}); emptyDir sizeLimit {disk.size_limit}, ephemeral-storage request {disk.request} "
        "per TPU container"
    )
    line += " (the template's)" if disk.source == "template" else ""
    return line + f"; node pool boot disk >= {boot_disk_gb(pod_bytes(disk))} GB (--disk-size, docs/gke.md)"


__all__ = [
    "COMPILE_CACHE_BYTES",
    "DEFAULT_BOOT_DISK_GB",
    "HEADROOM",
    "allocatable_bytes",
    "boot_disk_gb",
    "conversion_bytes",
    "converted_dtype",
    "parts",
    "plan",
    "pod_bytes",
    "sized",
    "summary",
    "weight_bytes",
]
