"""Validate rendered JobSets against JobSet's own CRD schema (v1alpha2 OpenAPI v3).

The schema is recipes/data/jobset-<version>-schema.json, extracted by hack/extract_jobset_schema.py
from the Go module sigs.k8s.io/jobset at JOBSET_VERSION (hack/versions.env). OpenAPI v3 schema
keywords are checked with jsonschema-rs's Draft 7 validator (a compiled validator: it imports and runs
in milliseconds, which keeps `rljob render` fast; x-kubernetes-* extensions and the CEL rules in
x-kubernetes-validations are not evaluated here, the API server does that).

The API server prunes fields a structural schema does not declare, silently. A renderer that emits
such a field has a bug (a typo, a field of another version), so here every object schema with
`properties` is closed (additionalProperties: false) unless it preserves unknown fields.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

JOBSET_VERSION = "v0.12.0"


@cache
def schema_document() -> dict[str, Any]:
    res = resources.files("rljob.recipes").joinpath("data", f"jobset-{JOBSET_VERSION}-schema.json")
    doc: dict[str, Any] = json.loads(res.read_text(encoding="utf-8"))
    return doc


def _closed(node: Any) -> Any:
    if isinstance(node, list):
        return [_closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {
        k: (_closed(v) if k != "properties" else {n: _closed(s) for n, s in v.items()})
        for k, v in node.items()
    }
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def _validator() -> Any:
    import jsonschema_rs  # lazy: keeps `rljob --help` fast

    return jsonschema_rs.Draft7Validator(_closed(schema_document()["schema"]))


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(root)"


def validate_jobset(obj: dict[str, Any]) -> list[str]:
    """Schema violations of a JobSet object, as `path: message` lines (empty when valid)."""
    errors = sorted(_validator().iter_errors(obj), key=lambda e: [str(p) for p in e.instance_path])
    return [f"{_path(e.instance_path)}: {e.message}" for e in errors]


def _pod_spec() -> dict[str, Any]:
    """The Kubernetes PodSpec schema inside JobSet's (replicatedJobs[].template.spec.template.spec)."""
    props = schema_document()["schema"]["properties"]
    job = props["spec"]["properties"]["replicatedJobs"]["items"]["properties"]["template"]
    spec: dict[str, Any] = job["properties"]["spec"]["properties"]["template"]["properties"]["spec"]
    return spec


@cache
def volume_sources() -> frozenset[str]:
    """The volume source fields of the Kubernetes Volume schema (hostPath, secret, csi, ...)."""
    return frozenset(_pod_spec()["properties"]["volumes"]["items"]["properties"]) - {"name"}


_POD_PARTS = {
    "valueFrom": ("containers", "env", "valueFrom"),
    "envFrom": ("containers", "envFrom"),
    "volumes": ("volumes",),
    "affinity": ("affinity",),
}


@cache
def _part_validator(part: str) -> Any:
    import jsonschema_rs

    node = _pod_spec()
    for i, name in enumerate(_POD_PARTS[part]):
        node = node["properties"][name]
        if node.get("type") == "array" and (i < len(_POD_PARTS[part]) - 1 or part != "affinity"):
            node = node["items"]
    return jsonschema_rs.Draft7Validator(_closed(node))


def validate_pod_part(part: str, value: Any, where: str) -> list[str]:
    """Violations of one free-form part of a pod override (valueFrom, an envFrom item, a volume, affinity)
    against the Kubernetes schema JobSet's CRD embeds, as `where.path: message` lines."""
    import jsonschema_rs
    from rljob.recipes.syntax import key_path

    errors = sorted(_part_validator(part).iter_errors(value), key=lambda e: [str(p) for p in e.instance_path])
    out = []
    for e in errors:
        path = where
        for part in e.instance_path:  # odd keys quoted, so that the line stays `path: message`
            path = f"{path}[{part}]" if isinstance(part, int) else key_path(path, str(part))
        unexpected = getattr(e.kind, "unexpected", None)
        if isinstance(e.kind, jsonschema_rs.ValidationErrorKind.AdditionalProperties) and unexpected:
            out += [f"{key_path(path, str(name))}: unknown field" for name in unexpected]  # one line each
        else:
            out.append(f"{path}: {e.message}")
    return out
