"""The committed CRD is exactly what hack/gen_crd.py generates from rljob.recipes.api.

Regenerate: .venv/bin/python hack/gen_crd.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "rljob.dev_rljobs.yaml"
CHART_CRD = REPO / "charts" / "rljob" / "crds" / "rljob.dev_rljobs.yaml"


def generated() -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "gen_crd.py"), "--stdout"],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONSAFEPATH": "1"},
    )
    return proc.stdout


def _schema_props() -> frozenset[str]:
    from kubernetes.client import V1JSONSchemaProps

    return frozenset(V1JSONSchemaProps.attribute_map.values())


SCHEMA_PROPS = _schema_props()


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, sub in (node.get("properties") or {}).items():
        out += walk(sub, f"{path}.{name}")
    if "items" in node:
        out += walk(node["items"], f"{path}[]")
    return out


def test_committed_crd_is_generated() -> None:
    text = generated()
    assert CRD.read_text() == text, "stale: run .venv/bin/python hack/gen_crd.py"
    assert CHART_CRD.read_text() == text, "stale chart copy: run .venv/bin/python hack/gen_crd.py"


def test_crd_shape() -> None:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["names"]["shortNames"] == ["rlj"]
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Phase", "Step", "Reward", "Restarts", "Age", "URL"]
    root = version["schema"]["openAPIV3Schema"]
    for section in ("spec", "status"):
        for path, node in walk(root["properties"][section], section):
            if not path.endswith("[]"):
                assert node.get("description"), f"{path} has no description"
            assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), (
                f"{path} is not structural"
            )
            assert "default" not in node, f"{path}: a CRD default would override the recipe's value"
            assert "anyOf" not in node and "$ref" not in node, path
            # Only fields of the API's JSONSchemaProps (e.g. no `const`, which a one-value Literal gives):
            # the API server and its clients refuse the CRD otherwise.
            assert set(node) <= SCHEMA_PROPS, (path, set(node) - SCHEMA_PROPS)


def test_crd_immutability_rules_cover_every_spec_field_but_suspend_and_queue() -> None:
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = " ".join(r["rule"] for r in spec["x-kubernetes-validations"])
    for field in spec["properties"]:
        mentioned = f"self.{field} == oldSelf.{field}" in rules
        assert mentioned == (field not in ("suspend", "queueName")), field
    conditions = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"][
        "properties"
    ]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == [
        "type"
    ]
