"""The frozen base weights from a converted MaxText checkpoint (``spec.model.checkpoint``).

A converted checkpoint is what MaxText's conversion (``maxtext.checkpoint_conversion.to_maxtext``) writes:
an orbax checkpoint manager directory with step ``0`` whose item ``items`` holds a Linen TrainState, the
weights under ``params/params/...`` in the Linen parameter tree (``decoder/layers/...``,
``token_embedder/embedding``), which is also the NNX Transformer's parameter tree. The RLJob names the
item directory, e.g. ``gs://bucket/qwen3-8b/0/items`` (the step directory ``.../0`` is accepted too).

Loading goes through MaxText's own params-only path, ``maxtext.common.checkpointing.load_params_from_path``
(what ``load_parameters_path`` does in MaxText's trainers): it compares the stored tree and shapes with the
model's before reading, restores into the target's shardings, casts to the model's dtypes (a bf16
checkpoint into a float32 model is fine) and refuses a missing weight. The target is the weight state
of the abstract NNX model: its ``nnx.Param`` variables and the routing bias MaxText keeps in a variable
collection of its own (``MoEBiasVar``, DeepSeek-V3's; rljob.trainer.model.base_weight_variables), as
ShapeDtypeStructs with MaxText's logical-axis ``NamedSharding`` on the config's mesh
(rljob.trainer.model.build_model), so every process reads only its shards and no random initialization
is ever computed. It runs before qwix adds the LoRA parameters.

Every problem with the checkpoint (no such path, not a MaxText checkpoint, a tree or shape that does not
match the model) raises :class:`CheckpointError`, a ValueError whose one-line message starts with
``spec.model.checkpoint:``; the entrypoints turn it into exit 2. Storage errors other than a missing
path (permissions, network) propagate unchanged: a restart may fix them.

Storage: gs:// through orbax (tensorstore for arrays, etils.epath/gcsfs for the directory layout) or a
local path; the GCS emulator works for both (``TENSORSTORE_GCS_HTTP_URL``, ``STORAGE_EMULATOR_HOST``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")

import jax
import numpy as np

__all__ = [
    "CHECKPOINT_FIELD",
    "CheckpointError",
    "check_checkpoint_path",
    "logical_shardings",
    "restore_base_params",
    "save_converted_checkpoint",
]

CHECKPOINT_FIELD = "spec.model.checkpoint"
_MAX_PROBLEMS = 4


class CheckpointError(ValueError):
    """The base checkpoint cannot be used: the message names the field (``spec.model.checkpoint: ...``)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{CHECKPOINT_FIELD}: {path}: {reason}")
        self.path = path
        self.reason = reason


def _root(path: str) -> str:
    """The checkpoint step directory of ``path`` (``.../0/items`` -> ``.../0``), as MaxText normalizes it."""
    p = str(path).rstrip("/")
    return p[: -len("/items")] if p.endswith("/items") else p


def check_checkpoint_path(path: str) -> None:
    """Refuse, before any model is built, a path with nothing there or no checkpoint step layout."""
    from etils import epath  # type: ignore[import-untyped]

    if not str(path).strip():
        raise CheckpointError(str(path), "empty path")
    root = epath.Path(_root(path))
    if not root.exists():
        raise CheckpointError(
            path, "nothing at this path (expected a converted MaxText checkpoint, .../0/items)"
        )
    if (root / "items").exists() or (root / "_METADATA").exists():
        return
    hint = ""
    if (root / "0" / "items").exists():
        hint = f"; the converted checkpoint's step is {str(root).rstrip('/')}/0/items"
    raise CheckpointError(path, f"not a MaxText checkpoint step (no items/ or _METADATA there){hint}")


def _one_line(err: BaseException) -> str:
    """MaxText's mismatch report (a header, one ``  - 'path': why`` line per weight, advice) on one line."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    problems = [ln[2:] for ln in lines if ln.startswith("- ")]
    if not problems:
        return " ".join(lines)
    shown = "; ".join(problems[:_MAX_PROBLEMS])
    more = f"; and {len(problems) - _MAX_PROBLEMS} more" if len(problems) > _MAX_PROBLEMS else ""
    return f"does not match the model: {shown}{more}"


def logical_shardings(state: Any, cfg: Any, mesh: Any = None) -> Any:
    """MaxText's NamedSharding for every variable of ``state`` (an nnx.State, concrete or abstract): the
    variable's logical axis names through the logical axis rules of ``cfg`` onto ``mesh`` (default: the
    config's mesh), the scan axis included; a variable without names is replicated. Same tree as
    ``state``, NamedSharding values."""
    import flax.linen as nn
    from maxtext.utils import maxtext_utils, sharding

    mesh = maxtext_utils.get_mesh_from_config(cfg) if mesh is None else mesh
    with nn.logical_axis_rules(cfg.logical_axis_rules):
        return sharding.nnx_construct_named_sharding(state, mesh)


def _target(params: Any, cfg: Any) -> Any:
    """ShapeDtypeStructs of ``params`` (an nnx.State of weight variables) with MaxText's NamedSharding per
    variable (:func:`logical_shardings`)."""
    shardings = logical_shardings(params, cfg)
    return jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),  # type: ignore[no-untyped-call]
        params,
        shardings,
    )


def restore_base_params(path: str, params: Any, cfg: Any) -> Any:
    """The checkpoint's weights as an nnx.State shaped, typed and sharded like ``params`` (an nnx.State
    of the model's weight variables, concrete or abstract: rljob.trainer.model.base_weight_variables);
    CheckpointError if they do not fit."""
    return _restore(path, _target(params, cfg), cfg)


def _restore(path: str, target: Any, cfg: Any) -> Any:
    from maxtext.common import checkpointing

    try:
        restored = checkpointing.load_params_from_path(
            path,
            target,
            int(cfg.checkpoint_storage_concurrent_gb),
            use_ocdbt=bool(cfg.checkpoint_storage_use_ocdbt),
            use_zarr3=bool(cfg.checkpoint_storage_use_zarr3),
        )
    except FileNotFoundError as e:
        raise CheckpointError(path, f"not found ({_one_line(e)})") from e
    except ValueError as e:  # MaxText's tree/shape check, orbax's layout and shape errors
        raise CheckpointError(path, _one_line(e)) from e
    # load_params_from_path reports a missing weight itself; check the restored leaves once more so a
    # partial restore (an unmaterialized leaf) can never reach the model silently.
    want = jax.tree_util.tree_flatten_with_path(target.to_pure_dict())[0]
    have = dict(jax.tree_util.tree_flatten_with_path(restored.to_pure_dict())[0])
    for key, spec in want:
        got = have.get(key)
        if not isinstance(got, jax.Array) or got.shape != spec.shape:
            name = "/".join(str(getattr(k, "key", k)) for k in key)
            raise CheckpointError(path, f"does not match the model: '{name}' was not restored")
    return restored


def save_converted_checkpoint(directory: str, params: Mapping[str, Any], cfg: Any) -> str:
    """Write ``params`` (the NNX Transformer's nnx.Param values as a nested dict, e.g. from
    ``nnx.state(model, nnx.Param).to_pure_dict()``) as MaxText's checkpoint conversion does, and return
    the path to load (``{directory}/0/items``).

    Same steps as ``to_maxtext.py``: the Linen model's abstract parameter tree
    (``maxtext_utils.get_abstract_param``) filled leaf by leaf (KeyError if ``params`` lacks one, or
    holds one the Linen tree does not), then ``save_weights_to_checkpoint`` (step 0, item ``items``,
    ``params/params/...``, ocdbt/zarr3 as in ``cfg``). One simulated device (the conversion script's
    default of 16 only changes how arrays are split into files)."""
    import flax.linen as nn
    from maxtext.checkpoint_conversion.utils.utils import (
        param_key_parts_from_path,
        save_weights_to_checkpoint,
    )
    from maxtext.models import models
    from maxtext.utils import maxtext_utils

    mesh = maxtext_utils.get_mesh_from_config(cfg)
    linen = models.transformer_as_linen(cfg, mesh, quant=None, model_mode="train")
    abstract = maxtext_utils.get_abstract_param(linen, cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
    leaves: list[np.ndarray] = []
    used: set[tuple[str, ...]] = set()
    for key_path, _ in flat:
        parts = tuple(param_key_parts_from_path(key_path))
        if parts[0] != "params":
            raise KeyError(f"unexpected Linen collection {parts[0]!r}")
        node: Any = params
        for part in parts[1:]:
            node = node[part]
        leaves.append(np.asarray(node))
        used.add(parts[1:])
    given = {
        tuple(str(getattr(k, "key", k)) for k in kp)
        for kp, _ in jax.tree_util.tree_flatten_with_path(dict(params))[0]
    }
    if given - used:
        raise KeyError(f"parameters the Linen model does not have: {sorted(given - used)[:3]}")
    weights = jax.tree_util.tree_unflatten(treedef, leaves)
    out = directory.rstrip("/")
    save_weights_to_checkpoint(
        out,
        weights,
        1,
        bool(cfg.checkpoint_storage_use_ocdbt),
        bool(cfg.checkpoint_storage_use_zarr3),
        config=cfg,
    )
    return f"{out}/0/items"
