"""The base weights a run trains: spec.model.name's Hugging Face weights, converted into MaxText's layout
by the trainer itself, once, and cached under the storage root.

Both roles start from the same weights (:func:`base_weights`): the sampler serves ``spec.model.name`` at
the run's revision (rljob.sampler.vllm), and the trainer loads the MaxText checkpoint converted from
exactly those files, either ``spec.model.checkpoint`` (a conversion the user made) or, without it,
``StoragePaths.converted``: ``{storage.root}/cache/converted/<name>@<revision>/maxtext-<version>``, which
:func:`ensure_converted` fills on the first start and every later start (a restart, a preemption, another
run under the same root naming the same model, revision and MaxText version) reuses. The run's revision is
``spec.model.revision`` where it is a commit hash; a moving one (a branch, a tag) is resolved to a commit
once per run by the trainer's process 0 (:func:`run_resolver`) and pinned in the run's storage, where
every later start of the trainer and every sampler reads it (rljob.common.revision).

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

import numpy as np
from rljob.common import revision as base_revision
from rljob.recipes import disk
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
    ref: str = ""  # spec.model.revision as written, where ``revision`` is the commit it resolved to

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


REVISION_FIELD = "spec.model.revision"

Resolve = Callable[[str, str], "str | None"]


def hub_commit(model: str, revision: str) -> str | None:
    """The commit ``revision`` (a branch or tag) of ``model`` names on the Hugging Face Hub now
    (``HfApi.model_info``, ``HF_TOKEN`` when set); None where the Hub cannot be reached. A model or
    revision the Hub does not have is refused naming the field."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi(token=os.environ.get("HF_TOKEN") or None).model_info(model, revision=revision)
    except RevisionNotFoundError as e:
        raise WeightsError(f"{REVISION_FIELD}: {model} has no revision {revision!r} on the Hub") from e
    except RepositoryNotFoundError as e:
        raise WeightsError(f"{NAME_FIELD}: {model} is not on the Hub (or not readable with HF_TOKEN)") from e
    except (OSError, httpx.TransportError) as e:  # no route to the Hub, or offline mode
        log.warning("could not resolve %s@%s to a commit: %s", model, revision, e)
        return None
    return str(info.sha) if info.sha else None


def pin(bw: BaseWeights, commit: str | None) -> BaseWeights:
    """``bw`` at ``commit``, the commit its moving revision resolved to (None: unresolved, ``bw`` as it
    is): the cache is keyed on the commit, so a branch that moves between two starts converts the new
    weights into a directory of their own instead of reusing the old ones."""
    if commit is None or commit == bw.revision:
        return bw
    if not base_revision.is_commit(commit):
        raise WeightsError(f"{REVISION_FIELD}: {bw.revision!r} resolved to {commit!r}, not a commit hash")
    directory = bw.directory
    if directory is not None:
        key = f"/{bw.model}@{bw.revision}/"
        head, sep, tail = directory.rpartition(key)
        if not sep:
            raise WeightsError(f"{REVISION_FIELD}: the converted directory {directory} names no {key}")
        directory = f"{head}/{bw.model}@{commit}/{tail}"
    checkpoint = f"{directory}/0/items" if directory is not None else bw.checkpoint
    return BaseWeights(bw.model, commit, bw.maxtext_version, checkpoint, directory, ref=bw.ref or bw.revision)


def run_resolver(run_root: str, resolve: Resolve | None = None) -> Resolve:
    """Process 0's resolver: the commit the run's pin names (rljob.common.revision) where an earlier start
    wrote it, so that a restart trains the weights the run began with; else the answer of ``resolve``
    (default :func:`hub_commit`), written as the run's pin (the ref itself where the Hub could not be
    reached) for every later start and for the samplers, which serve what it names."""

    def pinned(model: str, ref: str) -> str | None:
        got = base_revision.read(run_root, model, ref)
        if got is None:
            commit = (resolve or hub_commit)(model, ref)
            if commit is not None and not base_revision.is_commit(commit):
                return commit  # refused by pin(), naming the field; never written
            got = base_revision.Pinned(model, ref, commit or ref)
            base_revision.write(run_root, got)
        return got.revision if got.revision != ref else None

    return pinned


def resolve_revision(bw: BaseWeights, resolve: Resolve = hub_commit, share: Any = None) -> BaseWeights:
    """``bw`` pinned to the commit its ``spec.model.revision`` names now (a commit hash is kept as it is).
    ``share`` hands process 0's answer to every process (the trainer's: a JAX broadcast), so all of them
    load one directory even if the branch moves while they ask."""
    if base_revision.is_commit(bw.revision):
        return bw
    commit = resolve(bw.model, bw.revision)
    if share is not None:
        commit = share(commit)
    return pin(bw, commit)


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
    if have not in {f"{bw.model}@{bw.revision}", f"{bw.model}@{bw.ref}"}:
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


def convert(hf_dir: Path, out_dir: str, cfg: Any, *, label: str, report: Report, scratch: Path) -> int:
    """Convert the Hugging Face model in ``hf_dir`` into a MaxText checkpoint at ``out_dir`` (step 0,
    item ``items``) for the MaxText config ``cfg`` (its model_name picks MaxText's mapping, its scan_layers
    the layout), MaxText's conversion used as a library; returns the number of HF tensors read. ``report``
    gets a line such as ``converting Qwen/Qwen3-8B: 120/399 tensors, 41 s`` as tensors are read.

    Host memory is bounded by one Hugging Face tensor (and what MaxText's hook makes of it), not the
    model: each MaxText leaf is a file-backed array under ``scratch`` (local disk: the model once, in
    the checkpoint's dtype), filled one Hugging Face tensor at a time (:func:`_fill_leaf`), and orbax
    writes those files with at most ``SAVE_CONCURRENT_GB`` in flight (:func:`_save`)."""
    import jax
    from maxtext.checkpoint_conversion import to_maxtext
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING
    from maxtext.checkpoint_conversion.utils.utils import validate_and_filter_param_map_keys
    from transformers import AutoConfig

    model_key = str(cfg.model_name)
    if model_key not in PARAM_MAPPING or model_key not in HOOK_FNS:
        raise WeightsError(
            f"spec.model.maxtextModel: MaxText {model_key!r} has no checkpoint conversion "
            f"(maxtext.checkpoint_conversion.utils.param_mapping); set {CHECKPOINT_FIELD}"
        )
    hf_config = AutoConfig.from_pretrained(str(hf_dir)).to_dict()
    abstract, treedef = to_maxtext.get_maxtext_model_info(cfg)
    param_map = _with_variable_collections(
        PARAM_MAPPING[model_key](hf_config, cfg, cfg.scan_layers), abstract
    )
    hooks = HOOK_FNS[model_key](hf_config, cfg, cfg.scan_layers, saving_to_hf=False)
    save_dtype = disk.converted_dtype(cfg.weight_dtype)
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

    scratch.mkdir(parents=True, exist_ok=True)
    leaves: list[Any] = [None] * len(abstract)
    try:
        for mt_key in validate_and_filter_param_map_keys(param_map.keys(), abstract.keys()):
            idx, shape = to_maxtext._get_maxtext_indices_and_shapes(mt_key, abstract)
            idxs = list(idx) if isinstance(mt_key, tuple) else [idx]
            shapes = list(shape) if isinstance(mt_key, tuple) else [shape]
            outs = [_scratch_array(scratch, i, s, save_dtype) for i, s in zip(idxs, shapes, strict=True)]
            _fill_leaf(param_map[mt_key], getter, hooks.get(mt_key), shape, cfg, mt_key, outs, label)
            for i, out in zip(idxs, outs, strict=True):
                out.flush()
                leaves[i] = out.view(np.ndarray)  # file-backed: the page cache holds it, not the heap
    except ValueError as e:  # a hook's reshape: the files are not this model's
        if isinstance(e, WeightsError):
            raise
        first = str(e).splitlines()[0]
        raise WeightsError(f"{NAME_FIELD}: {label}: does not match the model: {first}") from e
    missing = [k for k, (i, _) in abstract.items() if leaves[i] is None]
    if missing:
        raise WeightsError(f"{NAME_FIELD}: {label}: MaxText's mapping leaves {missing[:3]} unset")
    _save(out_dir, jax.tree_util.tree_unflatten(treedef, leaves), cfg)
    report(f"converted {label}: {len(read)}/{total} tensors, {time.monotonic() - start:.0f} s")
    return len(read)


# Orbax's bytes in flight while writing the converted leaves (MaxText's default, 96, would let it hold
# that many GB of copies of the file-backed leaves at once).
SAVE_CONCURRENT_GB = 1


def _scratch_array(scratch: Path, index: int, shape: tuple[int, ...], dtype: str) -> Any:
    """A zeroed array of ``shape`` backed by the file ``scratch/leaf-<index>`` (written on flush)."""
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    return np.memmap(scratch / f"leaf-{index}", dtype=dt, mode="w+", shape=tuple(shape))


def _with_variable_collections(param_map: dict[Any, Any], abstract: dict[str, Any]) -> dict[Any, Any]:
    """MaxText's mapping, plus its own entry for each leaf the model keeps in a variable collection of
    its own rather than ``params`` (DeepSeek-V3's routed gate bias is a ``MoEBiasVar``: MaxText 0.2.5
    layers/moe.py; its DeepSeek mapping still names it ``params-...-gate-bias``, as MaxText's DeepSeek-V4
    mapping re-keys the same way: ``prefix.replace('params-', 'MoEBiasVar-')``)."""
    out = dict(param_map)
    for key in abstract:
        collection, _, rest = key.partition("-")
        if collection != "params" and key not in out and f"params-{rest}" in param_map:
            out[key] = param_map[f"params-{rest}"]
    return out


def _single_stack_axis(mt_key: Any, target: Any, count: int, cfg: Any) -> int:
    """The axis a flat list of ``count`` Hugging Face tensors stacks on: MaxText's own choice
    (``to_maxtext._build_single_axis_stacked_tensor``: the scan axis for scanned layers, 0 for
    variable collections and for MoE leaves it takes to be stacked over experts), unless the target
    leaf is not ``count`` long there and is at the other one. MaxText 0.2.5 takes every ``MoeBlock``
    leaf without ``scanned_blocks`` for an expert stack; Mixtral's and DeepSeek's scanned router
    kernels are layer stacks, (emb, layers, experts), whose axis is the scan axis."""
    scan_axis = int(cfg.param_scan_axis)
    axis = 0
    if cfg.scan_layers:
        key = str(mt_key)
        var_collection = "MoEBiasVar" in key or "Tid2EidVar" in key
        unscanned_moe = "MoeBlock" in key and "scanned_blocks" not in key
        if not (var_collection or unscanned_moe):
            axis = scan_axis if len(target) > scan_axis else 0
    if isinstance(mt_key, str) and len(target) > axis and target[axis] != count:
        for other in (scan_axis, 0):
            if len(target) > other and target[other] == count:
                return other
    return axis


def _fill_leaf(
    source: Any, getter: Any, hook: Any, target: Any, cfg: Any, mt_key: Any, outs: list[Any], label: str
) -> None:
    """Write the MaxText leaf (or, for a composite key, each of its parts: the hook's last axis) of
    ``source`` into ``outs`` one Hugging Face tensor at a time, with MaxText's hooks and its stacking
    (``to_maxtext._get_hf_loading_function``'s four forms: one key, a list stacked on one axis, nested
    lists stacked on several): the same array MaxText's loader builds whole."""
    from maxtext.checkpoint_conversion.utils.tensor_handling import (
        apply_hook_fns,
        nesting_depth,
        slice_shape,
        stacked_axes,
    )

    def load(keys: Any, shape: Any) -> Any:
        if keys is None:
            return apply_hook_fns(None, shape, hook)
        raw = tuple(getter(k) for k in keys) if isinstance(keys, (list, tuple)) else getter(keys)
        return apply_hook_fns(raw, shape, hook)

    def put(index: tuple[Any, ...], piece: Any) -> None:
        piece = np.asarray(piece)
        for i, out in enumerate(outs):
            part = piece[..., i] if len(outs) > 1 else piece
            if out[index].shape != part.shape:
                raise WeightsError(
                    f"{NAME_FIELD}: {label}: does not match the model: {mt_key} wants "
                    f"{out[index].shape} per slice, the Hugging Face files give {part.shape}"
                )
            out[index] = part

    depth = nesting_depth(source)
    if depth == 0:
        put((...,), load(source, target))
        return
    if depth == 1:
        axis = _single_stack_axis(mt_key, target, len(source), cfg)
        shape = tuple(d for j, d in enumerate(target) if j != axis)
        for j, keys in enumerate(source):
            put((slice(None),) * axis + (j,), load(keys, shape))
        return
    axes = stacked_axes(mt_key, cfg, depth)
    shape = slice_shape(target, axes)

    def walk(keys: Any, at: tuple[int, ...]) -> None:
        if len(at) == depth:
            index: list[Any] = [slice(None)] * (max(axes) + 1)
            for axis, j in zip(axes, at, strict=True):
                index[axis] = j
            put(tuple(index), load(keys, shape))
            return
        for j, sub in enumerate(keys):
            walk(sub, (*at, j))

    walk(source, ())


def _save(out_dir: str, tree: Any, cfg: Any) -> None:
    """Orbax's save of ``tree`` as MaxText's ``save_weights_to_checkpoint`` makes it with one device (a
    TrainState at step 0 whose params are the tree), with at most ``SAVE_CONCURRENT_GB`` in flight."""
    from flax.training import train_state
    from maxtext.common import checkpointing

    manager = checkpointing.create_orbax_checkpoint_manager(
        out_dir,
        True,
        False,
        1,
        use_ocdbt=bool(cfg.checkpoint_storage_use_ocdbt),
        use_zarr3=bool(cfg.checkpoint_storage_use_zarr3),
        enable_continuous_checkpointing=True,
        checkpoint_storage_concurrent_gb=SAVE_CONCURRENT_GB,
    )
    if manager is None:
        raise RuntimeError("MaxText created no orbax checkpoint manager")
    params = tree if isinstance(tree, dict) and "params" in tree else {"params": tree}
    state = train_state.TrainState(step=0, apply_fn=None, params=params, tx=None, opt_state={})  # type: ignore[arg-type]
    checkpointing.save_checkpoint(manager, 0, state, config=cfg)
    checkpointing.wait_until_finished(manager)


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
    work = local_dir / "hf-convert" / bw.model.replace("/", "--") / bw.revision
    dest = work / "hf"
    hf_dir = fetch(bw.model, bw.revision, dest)
    try:
        tensors = convert(hf_dir, directory, cfg, label=label, report=report, scratch=work / "leaves")
    finally:
        shutil.rmtree(work / "leaves", ignore_errors=True)
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
    "hub_commit",
    "pin",
    "read_marker",
    "resolve_revision",
    "run_resolver",
]
