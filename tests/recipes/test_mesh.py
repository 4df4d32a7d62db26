"""Trainer mesh: defaults, inference of one axis, ICI = devices per slice, DCN = slices."""

from __future__ import annotations

import pytest
from rljob.recipes import mesh
from rljob.recipes.api import MeshAxes, MeshSpec

A = ("data", "fsdp", "tensor", "context", "expert")


def m(dcn: dict[str, int] | None = None, **axes: int) -> MeshSpec:
    return MeshSpec(**axes, dcn=MeshAxes(**dcn) if dcn is not None else None)


# mesh, devices per slice, slices, expected ici (data, fsdp, tensor, context, expert), expected dcn
GOOD = [
    (None, 4, 1, (1, 4, 1, 1, 1), (1, 1, 1, 1, 1)),
    (None, 256, 2, (1, 256, 1, 1, 1), (2, 1, 1, 1, 1)),
    (m(fsdp=32, expert=2, context=4), 256, 1, (1, 32, 1, 4, 2), (1, 1, 1, 1, 1)),
    (m(fsdp=32, expert=2, context=8), 512, 1, (1, 32, 1, 8, 2), (1, 1, 1, 1, 1)),
    (m(fsdp=64, expert=1, context=8), 512, 1, (1, 64, 1, 8, 1), (1, 1, 1, 1, 1)),
    (m(tensor=4), 16, 1, (1, 4, 4, 1, 1), (1, 1, 1, 1, 1)),  # fsdp inferred
    (m(tensor=-1, fsdp=2), 16, 1, (1, 2, 8, 1, 1), (1, 1, 1, 1, 1)),
    (m(tensor=-1), 16, 1, (1, 1, 16, 1, 1), (1, 1, 1, 1, 1)),  # another -1: fsdp defaults to 1
    (m(dcn={"fsdp": 2}), 8, 2, (1, 8, 1, 1, 1), (1, 2, 1, 1, 1)),
    (m(dcn={"data": -1, "fsdp": 2}), 8, 4, (1, 8, 1, 1, 1), (2, 2, 1, 1, 1)),
]


@pytest.mark.parametrize(("spec", "devices", "slices", "ici", "dcn"), GOOD)
def test_resolve(
    spec: MeshSpec | None, devices: int, slices: int, ici: tuple[int, ...], dcn: tuple[int, ...]
) -> None:
    out = mesh.resolve(spec, devices, slices)
    assert not isinstance(out, list), out
    got_ici, got_dcn = out
    assert tuple(getattr(got_ici, a) for a in A) == ici
    assert tuple(getattr(got_dcn, a) for a in A) == dcn
    assert got_ici.product() == devices and got_dcn.product() == slices


BAD = [
    (
        m(fsdp=32, expert=2, context=8),
        256,
        1,
        [
            "spec.trainer.mesh: the axes multiply to 512 (fsdp 32 x context 8 x expert 2) but must equal "
            "the 256 "
            "devices of one slice"
        ],
    ),
    (
        m(fsdp=-1, tensor=-1),
        8,
        1,
        ["spec.trainer.mesh: at most one axis may be -1 (inferred), got fsdp, tensor"],
    ),
    (
        m(tensor=3),
        8,
        1,
        [
            "spec.trainer.mesh: the fixed axes multiply to 3, which does not divide the 8 devices of one "
            "slice; "
            "fsdp cannot be inferred"
        ],
    ),
    (m(fsdp=0), 8, 1, ["spec.trainer.mesh.fsdp: must be >= 1 or -1 (inferred), not 0"]),
    (m(expert=-2), 8, 1, ["spec.trainer.mesh.expert: must be >= 1 or -1 (inferred), not -2"]),
    (
        m(dcn={"fsdp": 2}),
        8,
        1,
        [
            "spec.trainer.mesh.dcn: the fixed axes multiply to 2, which does not divide the 1 slices "
            "(spec.trainer.slices); data cannot be inferred"
        ],
    ),
    (
        m(fsdp=4, dcn={"data": 3}),
        8,
        2,
        [
            "spec.trainer.mesh: the axes multiply to 4 (fsdp 4) but must equal the 8 devices of one slice",
            "spec.trainer.mesh.dcn: the axes multiply to 3 (data 3) but must equal the 2 slices "
            "(spec.trainer.slices)",
        ],
    ),
]


@pytest.mark.parametrize(("spec", "devices", "slices", "problems"), BAD)
def test_refused(spec: MeshSpec, devices: int, slices: int, problems: list[str]) -> None:
    assert mesh.resolve(spec, devices, slices) == problems


def test_maxtext_keys() -> None:
    out = mesh.resolve(m(fsdp=32, expert=2, context=4, dcn={"data": 2}), 256, 2)
    assert not isinstance(out, list)
    keys = mesh.maxtext_keys(*out)
    assert keys == {
        "ici_data_parallelism": 1,
        "ici_fsdp_parallelism": 32,
        "ici_tensor_parallelism": 1,
        "ici_context_parallelism": 4,
        "ici_expert_parallelism": 2,
        "dcn_data_parallelism": 2,
        "dcn_fsdp_parallelism": 1,
        "dcn_tensor_parallelism": 1,
        "dcn_context_parallelism": 1,
        "dcn_expert_parallelism": 1,
    }
    assert mesh.total(*out, "data") == 2 and mesh.total(*out, "fsdp") == 32
