"""A mutation fuzzer, as a property: the examples and the catalog's recipes, mutated the way a hostile or
careless user would (a value replaced by any JSON or YAML value, huge integers, non-finite floats, odd
strings; keys deleted, added, duplicated; anchors, aliases and tags), never crash the core or the webhook:

- YAML text through `parse_manifest -> resolve -> render` ends in a render or a PlanError whose every line is
  `path: message`; an accepted manifest renders objects Kubernetes would accept (names, label values,
  images, the JobSet schema);
- an API body the CRD's structural schema admits, through the operator's plan path (the admission webhook's
  `make_plan`), ends in objects or a plan error of such lines, never an exception.
"""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rljob.recipes import plan, recipe_catalog, render, schema, syntax
from rljob.recipes.plan import PlanError

TESTED_MODULES = ("rljob.recipes.syntax",)

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(
    r'^(metadata|spec|apiVersion|kind|status|\(root\)|\(yaml\))(\.[A-Za-z0-9_-]+|\[\d+\]|\["(?:[^"\\]|\\.)*"\])*'
    r": \S[^\n]*$"
)


def _bases() -> list[dict[str, Any]]:
    out = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "examples").glob("*.yaml"))]
    for name in recipe_catalog.names():
        recipe = recipe_catalog.load(name)
        spec = recipe.spec.model_dump(mode="json", by_alias=True, exclude_none=True)
        spec.setdefault("storage", {"root": "gs://rljob-fuzz"})
        out.append(
            {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "f"}, "spec": spec}
        )
        for profile in recipe.profiles:
            out.append(
                {
                    "apiVersion": "rljob.dev/v1alpha1",
                    "kind": "RLJob",
                    "metadata": {"name": "p"},
                    "spec": {
                        "recipe": name,
                        "trainer": {"profile": profile},
                        "storage": {"root": "gs://b-f"},
                    },
                }
            )
    return out


BASES = _bases()

ODD_STRINGS = st.sampled_from(
    [
        "",
        " ",
        "a b",
        "../../examples/qwen3-8b-v5p",
        "../catalog/qwen3-8b-v5p",
        "a" * 300,
        "--trust-remote-code",
        "{question.x}",
        "{question[a]}",
        "{question:>999999999}",
        "{{question}}",
        "{question}{question}",
        "x\ny",
        "\x00",
        "é",
        "gs://",
        "gs://b",
        "/abs/path",
        "8",
        "true",
        "null",
        "High_Priority",
        "my queue",
        "Qwen/Qwen3-8B",
        "v5p-8",
        "tpu7x-8",
        "0.2.5",
        "qwen3-8b-v5p",
        "\ud800",
    ]
)
INTS = st.one_of(
    st.integers(-3, 70000),
    st.sampled_from([2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**400, 4 * 10**400]),
)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-5, 0.5, 1.0, 1e308]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, ODD_STRINGS, st.text(max_size=12))
VALUES = st.recursive(
    SCALARS,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.one_of(ODD_STRINGS, st.text(max_size=6)), kids, max_size=4),
    ),
    max_leaves=10,
)


def _paths(node: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [here]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*here, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*here, i))
    return out


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path[:-1]:
        doc = doc[part]
    return doc


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    """A base manifest with 1-4 mutations at random paths."""
    doc: dict[str, Any] = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        path = draw(st.sampled_from(paths))
        parent = _parent(doc, path)
        op = draw(st.sampled_from(["replace", "nudge", "nudge", "delete", "add", "rename"]))
        old = parent[path[-1]]
        if op == "nudge" and type(old) is int:  # a plausible value of the same type
            parent[path[-1]] = draw(
                st.sampled_from([0, 1, 2, 3, 7, 8, 16, 64, 128, 4096, old * 2, old + 1, -1])
            )
        elif op == "nudge" and isinstance(old, str):
            parent[path[-1]] = draw(
                st.sampled_from([old.upper(), old + "x", old[:-1], old + "-2", old + " "])
            )
        elif op == "nudge" and isinstance(old, bool | float):
            parent[path[-1]] = draw(st.sampled_from([True, False, 0.0, 1e-3, 2.5, -1.0]))
        elif op in ("replace", "nudge"):
            parent[path[-1]] = draw(VALUES)
        elif op == "delete":
            parent.pop(path[-1])
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.one_of(ODD_STRINGS, st.sampled_from(["tpu", "maxtext", "queueName", "x"])))] = (
                draw(VALUES)
            )
        elif op == "rename" and isinstance(parent, dict):
            parent[draw(ODD_STRINGS)] = parent.pop(path[-1])
    return doc


YAML_TAILS = st.sampled_from(
    [
        *[""] * 10,
        "  suspend: true\n  suspend: false\n",
        "  queueName: !!binary /w==\n",
        "  queueName: !!set {a, b}\n",
        "  queueName: 2026-01-01\n",
        "  queueName: !custom x\n",
        "  lora: {alpha: .inf}\n",
        "  algorithm: &a {steps: 8}\n  packing: *a\n",
        "  x: &b [1, 2, 3, 4, 5, 6, 7, 8]\n  y: [*b, *b, *b, *b, *b, *b, *b, *b]\n",
        "  trainer: {maxtext: {a: " + "[" * 40 + "]" * 40 + "}}\n",
    ]
)


@cache
def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _k8s_acceptable(objs: list[dict[str, Any]]) -> None:
    """What the API server would check of the rendered objects: names, label values, images, the JobSet
    schema, the ConfigMap size."""
    for obj in objs:
        meta = obj["metadata"]
        assert _rx(syntax.DNS1123_SUBDOMAIN).fullmatch(meta["name"]) and len(meta["name"]) <= 63, meta
        for value in (meta.get("labels") or {}).values():
            assert _rx(syntax.LABEL_VALUE).fullmatch(value) and len(value) <= 63, value
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    (js,) = [o for o in objs if o["kind"] == "JobSet"]
    assert len(cm["data"]["run.json"].encode()) <= render.CONFIGMAP_MAX_BYTES
    assert schema.validate_jobset(js) == []
    for rj in js["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        if pod.get("priorityClassName"):
            assert _rx(syntax.DNS1123_SUBDOMAIN).fullmatch(pod["priorityClassName"])
        for c in pod["containers"]:
            assert _rx(syntax.IMAGE).fullmatch(c["image"]), c["image"]
    run = json.loads(cm["data"]["run.json"])
    model = run["spec"]["model"]["name"]
    assert not model.startswith("-") and _rx(syntax.HF_MODEL_ID).fullmatch(model), model


def _check_lines(problems: list[str]) -> None:
    assert problems and all(LINE.match(p) for p in problems), problems
    assert len(problems) <= plan.MAX_PROBLEMS


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(doc=mutated(), tail=YAML_TAILS)
def test_mutated_manifests_never_crash_parse_resolve_render(doc: dict[str, Any], tail: str) -> None:
    try:
        text = yaml.safe_dump(doc, allow_unicode=True) + tail
    except (ValueError, yaml.YAMLError):
        return  # a value PyYAML cannot write (an int past 4300 digits, a lone surrogate)
    try:
        objs = render.render(plan.parse_manifest(text))
    except PlanError as e:
        event("refused")
        _check_lines(e.problems)
        return
    event("rendered")
    _k8s_acceptable(objs)


@cache
def _crd_validator() -> Any:
    import jsonschema_rs

    crd = yaml.safe_load((REPO / "crds" / "rljob.dev_rljobs.yaml").read_text())
    version = crd["spec"]["versions"][0]
    # OpenAPI 3.0 schemas write exclusiveMinimum/Maximum as booleans, as JSON Schema draft 4 does.
    return jsonschema_rs.Draft4Validator(version["schema"]["openAPIV3Schema"])


def _admitted(body: dict[str, Any]) -> bool:
    """Whether the API server's structural schema would admit the body (CEL rules aside): JSON only, the
    schema's types, patterns and bounds."""
    try:  # what the API server sends is UTF-8 JSON: no NaN, no lone surrogates, string keys
        data = json.loads(json.dumps(body, allow_nan=False, ensure_ascii=False).encode("utf-8"))
    except (ValueError, TypeError):
        return False
    if not isinstance(data.get("metadata"), dict) or not isinstance(data["metadata"].get("name"), str):
        return False
    return bool(_crd_validator().is_valid({k: v for k, v in data.items() if k != "metadata"}))


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(doc=mutated())
def test_crd_admitted_bodies_never_crash_the_operators_plan(doc: dict[str, Any]) -> None:
    from rljob.operator.plans import make_plan

    if not _admitted(doc):
        event("not admitted by the CRD schema")
        return
    body = {**doc, "metadata": {**doc["metadata"], "namespace": "ns", "uid": "0d4c-1", "generation": 1}}
    result = make_plan(body, render.render)
    if result.error is not None:
        event("admitted, refused by the plan")
        assert not result.error.startswith("spec: rljob failed to plan"), result.error  # no internal error
        _check_lines(result.error.splitlines())
    else:
        event("admitted, rendered")
        _k8s_acceptable(list(result.objects))
