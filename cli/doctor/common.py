"""Helpers the check groups share: the plain-object type, versions, CRD schemas, conditions."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

Obj = Mapping[str, Any]


def parse_version(text: str) -> tuple[int, int, int] | None:
    m = re.search(r"v?(\d+)\.(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


_UNIT = {"trainer": "slice", "sampler": "replica"}


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}{'' if n == 1 else 's'}"


def _fmt_version(v: tuple[int, int, int]) -> str:
    return "v{}.{}.{}".format(*v)


def _schema_has(schema: Obj, path: Sequence[str]) -> bool:
    node: Obj = schema
    for name in path:
        while node.get("type") == "array" and isinstance(node.get("items"), Mapping):
            node = node["items"]
        props = node.get("properties")
        if not isinstance(props, Mapping) or name not in props:
            return False
        node = props[name]
    return True


def _conditions(obj: Obj) -> dict[str, Obj]:
    return {str(c.get("type")): c for c in obj.get("status", {}).get("conditions", []) or []}


def _served_version(crd: Obj, version: str) -> Obj | None:
    for v in crd.get("spec", {}).get("versions", []) or []:
        if v.get("name") == version and v.get("served", False):
            return v  # type: ignore[no-any-return]
    return None
