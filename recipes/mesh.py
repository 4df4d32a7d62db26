"""Trainer mesh: resolve the ICI (within a slice) and DCN (across slices) axes.

MaxText's rules (max_utils.fill_unspecified_mesh_axes): at most one axis per mesh is -1 (inferred as
target / product of the others, an integer >= 1); the product of the ICI axes equals the devices of
one slice and the product of the DCN axes the number of slices. Defaults as MaxText's: unspecified
ICI fsdp and DCN data are inferred (-1) unless another axis of that mesh is; every other unspecified
axis is 1.
"""

from __future__ import annotations

import math

from rljob.recipes.api import MeshAxes, MeshSpec
from rljob.recipes.runconfig import MESH_AXES, MeshPlan

INFER = -1


def _resolve(
    axes: MeshAxes | None, target: int, infer_default: str, path: str, what: str
) -> tuple[MeshPlan | None, list[str]]:
    given: dict[str, int | None] = {a: (getattr(axes, a) if axes else None) for a in MESH_AXES}
    problems: list[str] = []
    for axis, v in given.items():
        if v is not None and v != INFER and v < 1:
            problems.append(f"{path}.{axis}: must be >= 1 or -1 (inferred), not {v}")
    inferred = [a for a, v in given.items() if v == INFER]
    if len(inferred) > 1:
        problems.append(f"{path}: at most one axis may be -1 (inferred), got {', '.join(inferred)}")
    if problems:
        return None, problems
    values = {a: (v if v is not None else 1) for a, v in given.items()}
    if not inferred and given[infer_default] is None:
        values[infer_default] = INFER
        inferred = [infer_default]
    fixed = 1
    for v in values.values():
        if v != INFER:
            fixed *= v
    if inferred:
        axis = inferred[0]
        if target % fixed:
            return None, [
                f"{path}: the fixed axes multiply to {fixed}, which does not divide the {target} {what}; "
                f"{axis} cannot be inferred"
            ]
        values[axis] = target // fixed
    elif fixed != target:
        shape = " x ".join(f"{a} {values[a]}" for a in MESH_AXES if values[a] != 1) or "all 1"
        return None, [f"{path}: the axes multiply to {fixed} ({shape}) but must equal the {target} {what}"]
    return MeshPlan(**values), []


def resolve(
    mesh: MeshSpec | None, devices_per_slice: int, slices: int
) -> tuple[MeshPlan, MeshPlan] | list[str]:
    """(ici, dcn) meshes, or the problems found (`spec.trainer.mesh...: message`)."""
    ici, p1 = _resolve(mesh, devices_per_slice, "fsdp", "spec.trainer.mesh", "devices of one slice")
    dcn, p2 = _resolve(
        mesh.dcn if mesh else None, slices, "data", "spec.trainer.mesh.dcn", "slices (spec.trainer.slices)"
    )
    if ici is None or dcn is None:
        return p1 + p2
    return ici, dcn


def total(ici: MeshPlan, dcn: MeshPlan, axis: str) -> int:
    """Parallelism of one axis over the whole job."""
    return int(getattr(ici, axis)) * int(getattr(dcn, axis))


def batch_axes(custom_mesh_and_rule: str | None) -> tuple[str, ...]:
    """The mesh axes over which MaxText splits a micro-batch's rows: its activation_batch_attn rule
    (maxtext/configs/base.yml: data, fsdp, fsdp_transpose, expert; the custom_mesh_and_rule files keep
    data and fsdp, and all but ep-as-cp keep expert). Splash attention's shard_map needs the rows to split
    evenly over them."""
    return ("data", "fsdp") if custom_mesh_and_rule == "ep-as-cp" else ("data", "fsdp", "expert")


def batch_shards(ici: MeshPlan, dcn: MeshPlan, custom_mesh_and_rule: str | None) -> int:
    """Shards of a micro-batch's rows (see batch_axes)."""
    return math.prod(total(ici, dcn, a) for a in batch_axes(custom_mesh_and_rule))


def maxtext_keys(ici: MeshPlan, dcn: MeshPlan) -> dict[str, int]:
    """The MaxText ici_*/dcn_* keys of a resolved mesh."""
    out: dict[str, int] = {}
    for axis in MESH_AXES:
        out[f"ici_{axis}_parallelism"] = int(getattr(ici, axis))
    for axis in MESH_AXES:
        out[f"dcn_{axis}_parallelism"] = int(getattr(dcn, axis))
    return out
