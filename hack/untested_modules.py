"""Source modules with no test file named after them: for each rljob module X (a package's __init__ is
named by its folder), is there a tests/**/test_X*.py? Prints the modules without one and the counts.

    PYTHONSAFEPATH=1 .venv/bin/python hack/untested_modules.py
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def modules() -> list[tuple[str, str]]:
    """(dotted module name, the name a test file is named after), every rljob module but empty __init__s."""
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    out = []
    for package, folder in setup["package-dir"].items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder)
            if path.name == "__init__.py":
                if not path.read_text().strip() or len(rel.parts) == 1:
                    continue
                parts = rel.parts[:-1]
            else:
                parts = (*rel.parts[:-1], path.stem)
            out.append((".".join([package, *parts]), parts[-1]))
    return out


def main() -> int:
    tests = {p.name for p in (REPO / "tests").rglob("test_*.py")}
    missing = [m for m, stem in modules() if not any(t.startswith(f"test_{stem}") for t in tests)]
    for m in missing:
        print(m)
    total = len(modules())
    print(f"{len(missing)} of {total} modules have no tests/**/test_<module>*.py", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
