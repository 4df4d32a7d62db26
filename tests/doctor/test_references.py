"""`rljob doctor --for FILE`: the objects a manifest's pod overrides name (Secrets, ConfigMaps, the
ServiceAccount, PVCs, CSI drivers) must exist before its pods can start. Pure functions, no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from rljob.cli.doctor.findings import Status
from rljob.cli.doctor.needs import Reference, check_references, needs_from_manifest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen3-8b-v5p-spot-gcsfuse.yaml"


def test_the_gke_example_names_its_secret_and_the_fuse_driver() -> None:
    needs = needs_from_manifest(EXAMPLE)
    assert needs.references == (
        Reference("Secret", "hf-token", "spec.trainer.template.spec.env[0].valueFrom", "token"),
        Reference("CSIDriver", "gcsfuse.csi.storage.gke.io", "spec.trainer.template.spec.volumes[0]"),
        Reference("Secret", "hf-token", "spec.sampler.template.spec.env[0].valueFrom", "token"),
    )


def test_every_kind_of_reference(tmp_path: Path) -> None:
    text = (
        EXAMPLE.read_text()
        .replace(
            '        nodeSelector:\n          cloud.google.com/gke-spot: "true"\n        tolerations:',
            "        envFrom:\n          - configMapRef: {name: knobs, optional: true}\n"
            "        serviceAccountName: rl-wi\n"
            '        nodeSelector:\n          cloud.google.com/gke-spot: "true"\n        tolerations:',
            1,
        )
        .replace(
            "          - name: prompts\n            csi:",
            "          - name: ckpt\n            persistentVolumeClaim: {claimName: local-ssd}\n"
            "          - name: prompts\n            csi:",
            1,
        )
    )
    path = tmp_path / "m.yaml"
    path.write_text(text)
    kinds = [(r.kind, r.name, r.optional) for r in needs_from_manifest(path).references]
    assert kinds == [
        ("Secret", "hf-token", False),
        ("ConfigMap", "knobs", True),
        ("PersistentVolumeClaim", "local-ssd", False),
        ("CSIDriver", "gcsfuse.csi.storage.gke.io", False),
        ("ServiceAccount", "rl-wi", False),
        ("Secret", "hf-token", False),
    ]


SECRET = Reference("Secret", "hf-token", "spec.trainer.template.spec.env[0].valueFrom", "token")
OPTIONAL = Reference("ConfigMap", "knobs", "spec.trainer.template.spec.envFrom[0]", None, True)
DRIVER = Reference("CSIDriver", "gcsfuse.csi.storage.gke.io", "spec.trainer.template.spec.volumes[0]")


@pytest.mark.parametrize(
    ("ref", "found", "status", "needle"),
    [
        (SECRET, {"data": {"token": "aGY="}}, Status.OK, "exists"),
        (SECRET, None, Status.PROBLEM, "not found in namespace rl"),
        (SECRET, {"data": {"other": "x"}}, Status.PROBLEM, "has no key token"),
        (SECRET, False, Status.WARNING, "cannot read"),
        (OPTIONAL, None, Status.OK, "optional"),
        (DRIVER, None, Status.PROBLEM, "not found on the cluster"),
        (DRIVER, {"metadata": {"name": "gcsfuse.csi.storage.gke.io"}}, Status.OK, "exists"),
    ],
)
def test_check_references(ref: Reference, found: object, status: Status, needle: str) -> None:
    (finding,) = check_references([ref], {(ref.kind, ref.name): found}, "rl")  # type: ignore[dict-item]
    assert finding.status == status and needle in finding.message, finding
    assert ref.field in finding.message
    if status == Status.PROBLEM:
        assert finding.fix
    if ref is SECRET and status == Status.PROBLEM:
        assert finding.fix == "kubectl -n rl create secret generic hf-token --from-literal=token=..."
