"""A cluster test's time limit covers its own body, not the local cluster's start.

The first test that asks for the session's `cluster` fixture builds the control plane from its Go modules
when hack/bin/ has none (hack/build.sh: the Kubernetes binaries 577 s on a 2-core machine with a cold Go
cache, 863 s by the Makefile's figures) and starts it. pytest-timeout counts a fixture's setup in the
test's limit unless the mark says ``func_only=True``; and pytest caches a session fixture's error, so one
timed-out start failed every cluster test of the session (a clean clone with a cold Go cache,
2026-12-07: 55 errors, each "Timeout (>600.0s)"). The start is bounded by the fixtures' own limits
(tests/fixtures/cluster.py's UP_TIMEOUT_S). Every module that marks tests `cluster` and sets a timeout
says ``func_only=True``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _timeout_marks(tree: ast.Module) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "timeout"
        and ast.unparse(node.func.value) == "pytest.mark"
    ]


def _func_only(call: ast.Call) -> bool:
    return any(
        k.arg == "func_only" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    )


def test_every_cluster_tests_timeout_leaves_the_clusters_start_out() -> None:
    modules = [p for p in sorted(TESTS.rglob("test_*.py")) if "pytest.mark.cluster" in p.read_text()]
    assert len(modules) >= 7, modules  # the cluster tests are found (else this passes vacuously)
    limited = 0
    for path in modules:
        for call in _timeout_marks(ast.parse(path.read_text())):
            limited += 1
            assert _func_only(call), f"{path.relative_to(TESTS)}: {ast.unparse(call)} without func_only=True"
    assert limited >= 7, limited


def test_a_mark_without_func_only_is_caught() -> None:
    bad = ast.parse("import pytest\npytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]\n")
    good = ast.parse("import pytest\npytestmark = [pytest.mark.timeout(600, func_only=True)]\n")
    assert [_func_only(c) for c in _timeout_marks(bad)] == [False]
    assert [_func_only(c) for c in _timeout_marks(good)] == [True]
