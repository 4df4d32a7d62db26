"""Every RLJob field path that the code's messages or the docs name exists in the RLJob schema.

A refusal is `spec.path: message` (docs/architecture.md, "Where a change goes"), and messages name other
fields to set (`raise spec.packing.tokenBudget`): a path that is not a field sends the reader looking for
nothing. The schema is the generated CRD (crds/rljob.dev_rljobs.yaml, from recipes/api.py by
hack/gen_crd.py). Checked:

- every string literal of the seven packages, docstrings aside: a path that starts with `spec.` or with a
  top-level spec field (`algorithm.clipLow`, as messages that drop `spec.` write it); in docstrings only
  `spec.` paths (`storage.adapters` there is the run config's StoragePaths, not a spec field);
- README.md, docs/*.md and the hack READMEs: every `spec.` path.

Each check is a function from text to the paths it does not find, so the broken messages at the end
(those the code once raised) prove it catches what it is for.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("recipes", "common", "cli", "operator", "trainer", "sampler", "local")
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "hack" / "README.md")
DOCS += (REPO / "hack" / "tpu" / "README.md",)
# A path's last part that makes it a file name (`sampler.log`), not a field.
FILE_SUFFIXES = frozenset({"log", "py", "json", "jsonl", "yaml", "txt", "md", "safetensors"})


@cache
def spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load((REPO / "crds" / "rljob.dev_rljobs.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def _top() -> str:
    return "|".join(sorted(spec_schema()["properties"], key=len, reverse=True))


_SEGMENTS = r"(?:\.[A-Za-z_][A-Za-z0-9_]*|\[[^\]\s]*\])+"
# Not after a word, a dot, a slash or a dash: `rljob.trainer.loop`, `trainer/model.py`.
_BEFORE = r"(?<![\w./\-])"


def _pattern(prefix_optional: bool) -> re.Pattern[str]:
    prefix = r"(?:spec\.)?" if prefix_optional else r"spec\."
    return re.compile(rf"{_BEFORE}{prefix}((?:{_top()}){_SEGMENTS})")


def exists(path: str) -> bool:
    """Whether `path` (below spec, camelCase, `[i]` for an item or a map key) is a field of the schema."""
    node: dict[str, Any] | None = spec_schema()
    for key, index in re.findall(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[([^\]]*)\]", "." + path):
        if node is None:
            return False
        if node.get("x-kubernetes-preserve-unknown-fields"):
            return True  # a free-form map: spec.trainer.maxtext.<key>
        extra = node.get("additionalProperties")
        child = node.get("items") if index else node.get("properties", {}).get(key)
        node = child or (extra if isinstance(extra, dict) else None)
    return node is not None


def unknown_paths(text: str, prefix_optional: bool = False) -> list[str]:
    out = []
    for m in _pattern(prefix_optional).finditer(text):
        path = m.group(1)
        if path.rsplit(".", 1)[-1] not in FILE_SUFFIXES and not exists(path):
            out.append(m.group(0))
    return out


def _strings(tree: ast.AST) -> Iterator[tuple[int, str, bool]]:
    """(line, text, is a docstring) of every string constant, f-strings' literal parts included."""
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value, id(node) in docstrings


def code_problems(source: str, where: str) -> list[str]:
    out = []
    for line, text, doc in _strings(ast.parse(source)):
        out += [f"{where}:{line}: {p}" for p in unknown_paths(text, prefix_optional=not doc)]
    return out


def test_the_pattern_finds_paths() -> None:
    # The checks below find no problem; this says they looked at something.
    found = [
        m.group(1)
        for f in PACKAGES
        for p in sorted((REPO / f).rglob("*.py"))
        for _, text, doc in _strings(ast.parse(p.read_text()))
        for m in _pattern(not doc).finditer(text)
    ]
    assert len(set(found)) > 80
    assert {"algorithm.clipLow", "packing.tokenBudget", "trainer.preflight.memory"} <= set(found)


@pytest.mark.parametrize("package", PACKAGES)
def test_code_names_only_fields_that_exist(package: str) -> None:
    problems = []
    for p in sorted((REPO / package).rglob("*.py")):
        problems += code_problems(p.read_text(), str(p.relative_to(REPO)))
    assert problems == []


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_docs_name_only_fields_that_exist(doc: Path) -> None:
    problems = [
        f"{doc.relative_to(REPO)}:{i}: {p}"
        for i, line in enumerate(doc.read_text().splitlines(), 1)
        for p in unknown_paths(line)
    ]
    assert problems == []


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        # Messages the code once raised (trainer/losses.py, trainer/packing.py).
        ('raise ValueError("algorithm.clip: bounds must be >= 0")', "algorithm.clip"),
        ('raise E(f"packing.budget: must be a positive integer, got {b!r}")', "packing.budget"),
        ('raise E(f"packing.maxSegments: must be a positive integer, got {n!r}")', "packing.maxSegments"),
        ('x = "set spec.trainer.preflight.memroy to 16Gi"', "spec.trainer.preflight.memroy"),
        ('x = "spec.trainer.template.spec.hostNetwork: refused"', "spec.trainer.template.spec.hostNetwork"),
        ('x = "spec.sampler.weights[0]: not a list"', "spec.sampler.weights[0]"),
        ('"""A docstring naming spec.lora.dropout."""', "spec.lora.dropout"),
    ],
)
def test_a_wrong_path_is_caught(source: str, problem: str) -> None:
    assert code_problems(source, "m.py") == [f"m.py:1: {problem}"]


@pytest.mark.parametrize(
    "source",
    [
        'x = "spec.trainer.maxtext.remat_policy: a free-form MaxText key"',
        'x = "spec.trainer.template.spec.env[0].name"',
        'x = "spec.failurePolicy.maxSamplerRestarts"',
        'x = f"spec.sampler.{field}: {value}"',
        'x = "logs in sampler.log and service.log"',
        'x = "rljob.trainer.loop and trainer/model.py"',
        '"""storage.adapters of the run config (a docstring: only spec. paths count)."""',
    ],
)
def test_what_is_not_a_wrong_path(source: str) -> None:
    assert code_problems(source, "m.py") == []


def test_docs_are_checked_too() -> None:
    assert unknown_paths("set `spec.algorithm.clip` to 0.2") == ["spec.algorithm.clip"]
    assert unknown_paths("Kueue's Workload `spec.active` and a template's `spec.env`") == []
