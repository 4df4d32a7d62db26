"""Every module's tests are findable from the module (hack/untested_modules.py, docs/architecture.md,
"Tests"): the repo passes, and a tree that breaks each rule is caught."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "untested_modules.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("untested_modules", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_module_of_the_repo_is_findable() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("0 of "), proc.stderr


def _tree(tmp_path: Path, tests: dict[str, str]) -> Path:
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"rljob.pkg" = "pkg"\n')
    (tmp_path / "pkg").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "pkg" / f"{name}.py").write_text("X = 1\n")
    for rel, text in tests.items():
        (tmp_path / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / rel).write_text(text)
    return tmp_path


DECLARES_B = 'from rljob.pkg import b\nTESTED_MODULES = ("rljob.pkg.b",)\n'
IMPORTS_B_IN_A_FUNCTION = (
    "def f():\n    import rljob.pkg.b\nTESTED_MODULES: tuple[str, ...] = ('rljob.pkg.b',)\n"
)


@pytest.mark.parametrize(
    ("tests", "untestable", "missing", "errors"),
    [
        # by name, by declaration, by the allowlist: nothing missing
        ({"x/test_a_more.py": "", "x/test_e2e.py": DECLARES_B}, {"rljob.pkg.c": "why"}, [], []),
        # without a test c is missing
        ({"x/test_a.py": "", "x/test_e2e.py": DECLARES_B}, {}, ["rljob.pkg.c"], []),
        # a file not named test_* does not count, nor a test named after another module's prefix
        ({"x/a_test.py": "", "x/test_ab.py": DECLARES_B}, {}, ["rljob.pkg.a", "rljob.pkg.c"], []),
        # a declaration of a module the file does not import is refused, and does not count
        (
            {"x/test_a.py": "", "x/test_c.py": 'TESTED_MODULES = ("rljob.pkg.b",)\n'},
            {},
            ["rljob.pkg.b"],
            ["tests/x/test_c.py: TESTED_MODULES names rljob.pkg.b, which it does not import"],
        ),
        # `import rljob.pkg.b` counts as well as `from rljob.pkg import b`, inside a function too
        (
            {
                "x/test_a.py": IMPORTS_B_IN_A_FUNCTION,
                "x/test_c.py": "",
            },
            {},
            [],
            [],
        ),
        # a name that is no module, and a malformed declaration
        (
            {"x/test_a.py": 'import rljob.pkg.z\nTESTED_MODULES = ("rljob.pkg.z",)\n', "x/test_c.py": ""},
            {},
            ["rljob.pkg.b"],
            ["tests/x/test_a.py: TESTED_MODULES names rljob.pkg.z, not an rljob module"],
        ),
        (
            {"x/test_a.py": "TESTED_MODULES = 'rljob.pkg.b'\n", "x/test_b.py": "", "x/test_c.py": ""},
            {},
            [],
            ["tests/x/test_a.py: TESTED_MODULES must be a tuple of dotted module names"],
        ),
        (
            {"x/test_a.py": DECLARES_B + 'TESTED_MODULES = ("rljob.pkg.c",)\n', "x/test_c.py": ""},
            {},
            ["rljob.pkg.b"],
            ["tests/x/test_a.py: TESTED_MODULES is assigned twice: one tuple of every module the file tests"],
        ),
        # a stale allowlist entry: the module has tests, or is no module
        (
            {"x/test_a.py": "", "x/test_b.py": "", "x/test_c.py": ""},
            {"rljob.pkg.c": "why", "rljob.pkg.gone": "why"},
            [],
            [
                "UNTESTABLE names rljob.pkg.c, which has tests: remove it",
                "UNTESTABLE names rljob.pkg.gone, not an rljob module",
            ],
        ),
    ],
)
def test_check(
    tmp_path: Path, tests: dict[str, str], untestable: dict[str, str], missing: list[str], errors: list[str]
) -> None:
    got = _tool().check(_tree(tmp_path, tests), untestable)
    assert got == (missing, errors)


def test_every_untestable_entry_says_why() -> None:
    assert all(reason.strip() for reason in _tool().UNTESTABLE.values())
