"""The base weights a run trains: spec.model.name's Hugging Face weights, converted into MaxText's layout
by the trainer itself, once, and cached under the storage root.

Both roles start from the same weights (:func:`base_weights`): the sampler serves ``spec.model.name`` at
``spec.model.revision`` (rljob.sampler.vllm), and the trainer loads the MaxText checkpoint converted from
exactly those files, either ``spec.model.checkpoint`` (a conversion the user made) or, without it,
``StoragePaths.converted``: ``{storage.root}/cache/converted/<name>@<revision>/maxtext-<version>``, which
:func:`ensure_converted` fills on the first start and every later start (a restart, a preemption, another
run under the same root naming the same model, revision and MaxText version) reuses.

The conversion is MaxText's own (``maxtext.checkpoint_conversion.to_maxtext``), used as a library: its
per-family ``PARAM_MAPPING`` and ``HOOK_FNS`` (built from the model's own ``config.json``), its
``LazyHFLoader`` (safetensors memory-mapped and read tensor by tensor, no torch needed) and its
``save_weights_to_checkpoint``. Host memory: the model once, in the checkpoint's dtype (MaxText 0.2.5's
save materializes every leaf before orbax writes: its ``LazyTensor`` leaves are not taken by orbax's v1
save with one device, and with several ``shard_jax_weights`` makes each a JAX array first), not the
Hugging Face files besides (they are memory-mapped).

Process 0 converts; the other processes of the trainer wait for the completion marker
(``rljob-converted.json``, written last, naming the source and the MaxText version). MaxText's conversion
is a one-process program whose hooks transform whole tensors (stacking layers, reordering heads), so a
save shared by every host would need each host to build its shards of every leaf; one writer keeps
MaxText's code path as it is, and the conversion happens once per model, not once per run. A directory
without the marker is a conversion a preempted start left behind: it is deleted and converted again.

Where the Hugging Face files come from: the Hub (``huggingface_hub.snapshot_download`` of
``*.safetensors`` and ``*.json`` at the revision, with ``HF_TOKEN`` when the pod has it, as vLLM's own
download on the sampler), into the pod's local cache disk; the download is deleted once converted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.recipes.runconfig import RunConfig

log = logging.getLogger("rljob.trainer.hf_weights")

MARKER = "rljob-converted.json"
CHECKPOINT_FIELD = "spec.model.checkpoint"
NAME_FIELD = "spec.model.name"
WAIT_POLL_S = 10.0


class WeightsError(ValueError):
    """The base weights cannot be had: the one-line message names the field (exit 2)."""


@dataclass(frozen=True)
class BaseWeights:
    """What the trainer loads and where it comes from (the sampler serves ``model`` at ``revision``)."""

    model: str
    revision: str
    maxtext_version: str
    checkpoint: str  # the MaxText checkpoint's items directory the trainer loads
    directory: str | None  # the cached conversion's directory; None: spec.model.checkpoint

    @property
    def convert(self) -> bool:
        return self.directory is not None

    def source(self) -> dict[str, str]:
        return {"model": self.model, "revision": self.revision, "maxtext": self.maxtext_version}


def base_weights(rc: RunConfig) -> BaseWeights:
    """The run's base weights (contract 2's spec.model and StoragePaths.converted)."""
    m = rc.spec.model
    version = rc.spec.trainer.maxtext_version
    if m.checkpoint:
        return BaseWeights(m.name, m.revision, version, m.checkpoint, None)
    directory = rc.storage.converted
    if not directory:
        raise WeightsError(f"{CHECKPOINT_FIELD}: unset, and the run config names no converted directory")
    return BaseWeights(m.name, m.revision, version, f"{directory}/0/items", directory)


def read_marker(directory: str) -> dict[str, Any] | None:
    """The completion marker of a conversion directory; None where there is none (never converted, or
    a conversion that did not finish)."""
    from rljob.common.storage import open_store

    raw = open_store(directory).read(MARKER)
    if raw is None:
        return None
    try:
        return dict(json.loads(raw))
    except ValueError:
        return None


def check_source(bw: BaseWeights) -> None:
    """Refuse (exit 2) a ``spec.model.checkpoint`` that rljob converted from another model or revision
    than the one the sampler serves (its marker says which); one without a marker is the user's own
    conversion, which the step-0 parity gate checks."""
    if bw.convert:
        return
    root = bw.checkpoint.rstrip("/")
    root = root[: -len("/items")] if root.endswith("/items") else root
    parent = root.rsplit("/", 1)[0]
    marker = read_marker(parent)
    if marker is None:
        return
    have = f"{marker.get('model')}@{marker.get('revision')}"
    if have != f"{bw.model}@{bw.revision}":
        raise WeightsError(
            f"{CHECKPOINT_FIELD}: {bw.checkpoint} was converted from {have}, but the sampler serves "
            f"{bw.model}@{bw.revision} (spec.model.name, spec.model.revision)"
        )


Report = Callable[[str], None]


@dataclass
class Conversion:
    """What :func:`ensure_converted` did: ``hit`` (a complete conversion was there), ``tensors`` read."""

    checkpoint: str
    hit: bool
    tensors: int = 0
    seconds: float = 0.0


def download(model: str, revision: str, dest: Path) -> Path:
    """``model``'s config and safetensors at ``revision`` from the Hugging Face Hub into ``dest``
    (``HF_TOKEN`` from the environment when set)."""
    from huggingface_hub import snapshot_download

    path = snapshot_download(
        repo_id=model,
        revision=revision,
        allow_patterns=["*.json", "*.safetensors"],
        local_dir=str(dest),
        token=os.environ.get("HF_TOKEN") or None,
    )
    return Path(path)


def convert(hf_dir: Path, out_dir: str, cfg: Any, *, label: str, report: Report) -> int:
    """Convert the Hugging Face model in ``hf_dir`` into a MaxText checkpoint at ``out_dir`` (step 0,
    item ``items``) for the MaxText config ``cfg`` (its model_name picks MaxText's mapping, its scan_layers
    the layout), MaxText's conversion used as a library; returns the number of HF tensors read. ``report``
    gets a line such as ``converting Qwen/Qwen3-8B: 120/399 tensors, 41 s`` as tensors are read."""
    import jax
    import numpy as np
    from maxtext.checkpoint_conversion import to_maxtext
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING
    from maxtext.checkpoint_conversion.utils.utils import (
        save_weights_to_checkpoint,
        validate_and_filter_param_map_keys,
    )
    from transformers import AutoConfig

    model_key = str(cfg.model_name)
    if model_key not in PARAM_MAPPING or model_key not in HOOK_FNS:
        raise WeightsError(
            f"spec.model.maxtextModel: MaxText {model_key!r} has no checkpoint conversion "
            f"(maxtext.checkpoint_conversion.utils.param_mapping); set {CHECKPOINT_FIELD}"
        )
    hf_config = AutoConfig.from_pretrained(str(hf_dir)).to_dict()
    param_map = PARAM_MAPPING[model_key](hf_config, cfg, cfg.scan_layers)
    hooks = HOOK_FNS[model_key](hf_config, cfg, cfg.scan_layers, saving_to_hf=False)
    abstract, treedef = to_maxtext.get_maxtext_model_info(cfg)
    save_dtype = str(cfg.weight_dtype) if str(cfg.weight_dtype) == "float32" else "bfloat16"
    loader = to_maxtext.LazyHFLoader(str(hf_dir), None, save_dtype=save_dtype)
    total = len(loader.shard_map) if None not in loader.shard_map else _count_tensors(hf_dir)
    start = time.monotonic()
    read: set[str] = set()  # distinct HF tensors read (a composite MaxText leaf reads some twice)
    last = [0.0]

    def getter(key: str) -> Any:
        try:
            out = loader.get_tensor(key)
        except ValueError as e:
            raise WeightsError(f"{NAME_FIELD}: {label}: {e}") from e
        read.add(key)
        now = time.monotonic()
        if now - last[0] >= 5.0 or len(read) == total:
            last[0] = now
            report(f"converting {label}: {len(read)}/{total} tensors, {now - start:.0f} s")
        return out

    weights: list[Any] = [None] * len(abstract)
    for mt_key in validate_and_filter_param_map_keys(param_map.keys(), abstract.keys()):
        idx, shape = to_maxtext._get_maxtext_indices_and_shapes(mt_key, abstract)
        load_fn = to_maxtext._get_hf_loading_function(
            param_map[mt_key], getter, hooks.get(mt_key), shape, cfg, mt_key
        )
        to_maxtext._get_maxtext_weight(load_fn, idx, shape, mt_key, weights, save_dtype, True)
    missing = [k for k, (i, _) in abstract.items() if weights[i] is None]
    if missing:
        raise WeightsError(f"{NAME_FIELD}: {label}: MaxText's mapping leaves {missing[:3]} unset")
    # Materialized leaf by leaf (each HF tensor read once, each MaxText leaf built by MaxText's hooks):
    # orbax's v1 save, which MaxText 0.2.5's save_weights_to_checkpoint calls, takes no LazyTensor leaf
    # with one device, and with several it makes every leaf a JAX array first (shard_jax_weights) anyway.
    weights = [np.asarray(w) for w in weights]
    tree = jax.tree_util.tree_unflatten(treedef, weights)
    try:
        save_weights_to_checkpoint(
            out_dir,
            tree,
            1,
            bool(cfg.checkpoint_storage_use_ocdbt),
            bool(cfg.checkpoint_storage_use_zarr3),
            config=cfg,
        )
    except ValueError as e:  # LazyTensor's shape check: the files are not this model's
        first = str(e).splitlines()[0]
        raise WeightsError(f"{NAME_FIELD}: {label}: does not match the model: {first}") from e
    report(f"converted {label}: {len(read)}/{total} tensors, {time.monotonic() - start:.0f} s")
    return len(read)


def _count_tensors(hf_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as h:  # type: ignore[no-untyped-call]
            n += len(list(h.keys()))
    return n


def ensure_converted(
    bw: BaseWeights,
    cfg: Any,
    *,
    process_index: int,
    local_dir: Path,
    report: Report,
    fetch: Callable[[str, str, Path], Path] = download,
    wait_timeout_s: float = 6 * 3600.0,
) -> Conversion:
    """The converted checkpoint of ``bw`` (only when ``bw.convert``): reused when its marker is there and
    names the same source; else converted by process 0 (a partial directory deleted first) while the others
    wait for the marker."""
    from rljob.common.storage import open_store

    assert bw.directory is not None
    directory = bw.directory
    marker = read_marker(directory)
    if marker == bw.source():
        report(f"base weights: {bw.model}@{bw.revision} converted before, at {directory}")
        return Conversion(bw.checkpoint, hit=True)
    store = open_store(directory)
    start = time.monotonic()
    if process_index != 0:
        while read_marker(directory) != bw.source():
            if time.monotonic() - start > wait_timeout_s:
                raise TimeoutError(f"process 0 did not convert {bw.model} into {directory} in time")
            time.sleep(WAIT_POLL_S)
        return Conversion(bw.checkpoint, hit=True, seconds=time.monotonic() - start)
    stale = store.list("")
    if stale:
        report(f"base weights: removing a conversion that did not finish ({len(stale)} objects)")
        for key in stale:
            store.delete(key)
    label = f"{bw.model}@{bw.revision}"
    report(f"downloading {label}")
    dest = local_dir / "hf-convert" / bw.model.replace("/", "--") / bw.revision
    hf_dir = fetch(bw.model, bw.revision, dest)
    try:
        tensors = convert(hf_dir, directory, cfg, label=label, report=report)
    finally:
        if hf_dir.is_relative_to(local_dir):
            shutil.rmtree(dest, ignore_errors=True)
    store.write(MARKER, json.dumps(bw.source(), sort_keys=True).encode())
    return Conversion(bw.checkpoint, hit=False, tensors=tensors, seconds=time.monotonic() - start)


__all__ = [
    "MARKER",
    "BaseWeights",
    "Conversion",
    "WeightsError",
    "base_weights",
    "check_source",
    "convert",
    "download",
    "ensure_converted",
    "read_marker",
]
