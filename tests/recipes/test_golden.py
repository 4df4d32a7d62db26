"""Golden renders: every catalog recipe (each profile too) and every example, as `rljob render` prints them.

Regenerate after an intended change, then review the diff:

    UPDATE_GOLDEN=1 .venv/bin/pytest tests/recipes/test_golden.py
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.recipes import objects, recipe_manifest
from rljob.recipes import recipe_catalog, render

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"


def _cases() -> list[tuple[str, dict[str, Any]]]:
    cases = []
    for name in recipe_catalog.names():
        cases.append((f"recipe-{name}", recipe_manifest(name)))
        for profile in recipe_catalog.load(name).profiles:
            cases.append((f"recipe-{name}-{profile}", recipe_manifest(name, profile)))
    for path in sorted((REPO / "examples").glob("*.yaml")):
        cases.append((f"example-{path.stem}", yaml.safe_load(path.read_text(encoding="utf-8"))))
    return cases


CASES = _cases()


@pytest.mark.parametrize(("name", "doc"), CASES, ids=[c[0] for c in CASES])
def test_golden(name: str, doc: dict[str, Any]) -> None:
    got = render.to_yaml(objects(doc))
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(got, encoding="utf-8")
    assert path.exists(), f"no golden {path.name}; run UPDATE_GOLDEN=1 .venv/bin/pytest {Path(__file__).name}"
    assert got == path.read_text(encoding="utf-8"), f"render of {name} changed; see the module docstring"


def test_no_stale_goldens() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.yaml")) == sorted(c[0] for c in CASES)
