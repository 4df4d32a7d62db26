"""Golden renders: every catalog recipe (each profile too) and every example, as `rljob render` prints them.

Regenerate after an intended change, then review the diff:

    UPDATE_GOLDEN=1 .venv/bin/pytest tests/recipes/test_golden.py
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import catalog_cases, objects
from rljob.recipes import render

GOLDEN = Path(__file__).parent / "golden"


CASES = catalog_cases()


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
