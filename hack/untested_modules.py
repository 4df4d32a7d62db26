"""Every rljob module's tests are findable from the module; exit 1 naming each module whose are not.

A module X (a package's non-empty __init__ is named by its folder) is findable when
- a file tests/**/test_X.py or tests/**/test_X_*.py exists, or
- a test file declares it in its module-level `TESTED_MODULES`, a tuple of dotted names, and imports it
  (`import X`, `from X import ...` or `from <package> import <X's last part>`): the convention for a test
  that honestly covers several modules, such as an end-to-end test (docs/architecture.md, "Tests"), or
- it is in `UNTESTABLE` below, with the reason.

A declared name that is not an rljob module, or that its file does not import, and an `UNTESTABLE` entry
that is findable or no module are errors too, so the declarations stay true.

    PYTHONSAFEPATH=1 .venv/bin/python hack/untested_modules.py

tests/unit/test_untested_modules.py runs it, so `make test` fails while a module is unfindable.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Modules no test here can exercise, each with its reason. Keep it short: a module with logic gets a test.
UNTESTABLE: dict[str, str] = {}


def modules(repo: Path = REPO) -> list[tuple[str, str]]:
    """(dotted module name, the name a test file is named after), every rljob module but empty __init__s."""
    setup = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    out = []
    for package, folder in setup["package-dir"].items():
        for path in sorted((repo / folder).rglob("*.py")):
            rel = path.relative_to(repo / folder)
            if path.name == "__init__.py":
                if not path.read_text().strip() or len(rel.parts) == 1:
                    continue
                parts = rel.parts[:-1]
            else:
                parts = (*rel.parts[:-1], path.stem)
            out.append((".".join([package, *parts]), parts[-1]))
    return out


def named_after(file_name: str, stem: str) -> bool:
    """Whether a test file is named after a module: test_X.py or test_X_<more>.py (not test_Xy.py)."""
    return file_name == f"test_{stem}.py" or file_name.startswith(f"test_{stem}_")


def declared(tree: ast.Module) -> list[str] | None:
    """The names of a module-level `TESTED_MODULES = (...)`, or None without one."""
    found: list[str] | None = None
    for node in tree.body:
        expr: ast.expr | None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, expr = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, expr = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "TESTED_MODULES":
            if found is not None:
                raise ValueError("TESTED_MODULES is assigned twice: one tuple of every module the file tests")
            value = ast.literal_eval(expr) if expr is not None else None
            if not isinstance(value, tuple | list) or not all(isinstance(v, str) for v in value):
                raise ValueError("TESTED_MODULES must be a tuple of dotted module names")
            found = list(value)
    return found


def imported(tree: ast.Module) -> set[str]:
    """Every dotted name an import statement of the file names: `import a.b` gives a.b; `from a import b`
    gives a and a.b (b may be a module of package a)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def check(repo: Path = REPO, untestable: dict[str, str] = UNTESTABLE) -> tuple[list[str], list[str]]:
    """(the unfindable modules, the errors in the declarations and the allowlist)."""
    names = dict(modules(repo))
    test_files = sorted((repo / "tests").rglob("test_*.py"))
    by_name = {m for m, stem in names.items() if any(named_after(p.name, stem) for p in test_files)}
    by_declaration: set[str] = set()
    errors = []
    for path in test_files:
        tree = ast.parse(path.read_text(), str(path))
        try:
            listed = declared(tree)
        except ValueError as e:
            errors.append(f"{path.relative_to(repo)}: {e}")
            continue
        imports = imported(tree)
        for name in listed or ():
            if name not in names:
                errors.append(f"{path.relative_to(repo)}: TESTED_MODULES names {name}, not an rljob module")
            elif name not in imports:
                errors.append(
                    f"{path.relative_to(repo)}: TESTED_MODULES names {name}, which it does not import"
                )
            else:
                by_declaration.add(name)
    for name in untestable:
        if name not in names:
            errors.append(f"UNTESTABLE names {name}, not an rljob module")
        elif name in by_name | by_declaration:
            errors.append(f"UNTESTABLE names {name}, which has tests: remove it")
    missing = [m for m in names if m not in by_name | by_declaration | set(untestable)]
    return missing, errors


def main() -> int:
    missing, errors = check()
    for m in missing:
        print(m)
    for e in errors:
        print(e, file=sys.stderr)
    total = len(modules())
    print(
        f"{len(missing)} of {total} modules have no tests/**/test_<module>[_*].py and no test file declaring "
        f"them in TESTED_MODULES ({len(UNTESTABLE)} allowed in UNTESTABLE)",
        file=sys.stderr,
    )
    return 1 if missing or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
