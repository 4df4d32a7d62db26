"""Kubernetes' own rules on a pod-template value (rljob.recipes.k8s_rules) agree with apimachinery's on the
edge cases."""

from __future__ import annotations

import pytest
from rljob.recipes import k8s_rules


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("a", True),
        ("example.com/a_b.c", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("a key", False),
        ("/a", False),
        ("A.com/x", False),
        ("a/b/c", False),
        ("-a", False),
        ("", False),
    ],
)
def test_qualified_name(value: str, ok: bool) -> None:
    assert (k8s_rules.qualified_name(value) is None) is ok


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("k", True),
        ("a.b-c_D", True),
        (".x", True),
        ("..x", False),
        ("..", False),
        ("a/b", False),
        ("k" * 254, False),
    ],
)
def test_config_key(value: str, ok: bool) -> None:
    assert (k8s_rules.config_key(value) is None) is ok


@pytest.mark.parametrize(
    ("value", "ok"),
    [("a/b", True), ("a..b", True), ("..", False), ("a/../b", False), ("/abs", False), ("a/..", False)],
)
def test_descending_path(value: str, ok: bool) -> None:
    assert (k8s_rules.descending_path(value) is None) is ok
