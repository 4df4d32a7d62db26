#!/usr/bin/env python3
"""Extract the JobSet v1alpha2 OpenAPI schema from the Go module sigs.k8s.io/jobset into
recipes/data/jobset-<version>-schema.json (descriptions dropped; every other keyword kept, including
the CEL rules in x-kubernetes-validations).

The version is JOBSET_VERSION in hack/versions.env. The CRD is the module's own
config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml, found with `go mod download -json`.

    .venv/bin/python hack/extract_jobset_schema.py             # regenerate (needs go)
    .venv/bin/python hack/extract_jobset_schema.py --check     # exit 1 if the committed file differs
    .venv/bin/python hack/extract_jobset_schema.py --crd FILE  # from a CRD file instead of the module
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "recipes" / "data"
MODULE = "sigs.k8s.io/jobset"
CRD_PATH = "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"


def jobset_version() -> str:
    for line in (ROOT / "hack" / "versions.env").read_text(encoding="utf-8").splitlines():
        if line.startswith("JOBSET_VERSION="):
            return line.split("=", 1)[1].strip()
    raise SystemExit("JOBSET_VERSION not found in hack/versions.env")


def module_crd(version: str) -> Path:
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"{MODULE}@{version}"],
        check=True,
        capture_output=True,
        text=True,
        cwd="/tmp",
    )
    return Path(json.loads(out.stdout)["Dir"]) / CRD_PATH


def _strip(node: Any) -> Any:
    """Drop `description` from every schema node (not from property names)."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "description":
            continue
        if key == "properties":
            out[key] = {name: _strip(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = _strip(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [_strip(v) for v in value]
        else:
            out[key] = value
    return out


def extract(crd_file: Path, version: str) -> dict[str, Any]:
    crd = yaml.safe_load(crd_file.read_text(encoding="utf-8"))
    served = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    if not served:
        raise SystemExit(f"{crd_file}: no v1alpha2 version")
    return {
        "jobset": version,
        "source": f"{MODULE}@{version}/{CRD_PATH}",
        "schema": _strip(served[0]["schema"]["openAPIV3Schema"]),
    }


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--crd", type=Path, help="CRD file (default: from the Go module)")
    args = parser.parse_args()
    version = jobset_version()
    crd = args.crd or module_crd(version)
    text = render(extract(crd, version))
    path = DATA / f"jobset-{version}-schema.json"
    if args.check:
        ok = path.exists() and path.read_text(encoding="utf-8") == text
        print(f"{path}: {'matches' if ok else 'DIFFERS from'} {crd}")
        return 0 if ok else 1
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path} ({len(text)} bytes) from {crd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
