"""The plan at its edges: problem paths of odd manifests, YAML errors, nulls, and resolved values the
main tables (test_plan.py) leave out."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fixtures.recipes import manifest, problems, recipe_manifest, resolve
from rljob.recipes import plan, recipe_catalog
from rljob.recipes.api import RLJob

HEAD = "apiVersion: rljob.dev/v1alpha1\nkind: RLJob\nmetadata: {name: t}\n"


def required(*fields: str) -> list[str]:
    """The plan's lines for required fields the manifest leaves unset: a manifest that does not parse is
    still planned without the values that failed, so these come in the same run."""
    return [f"spec.{f}: required (set it, or name a spec.recipe that does)" for f in fields]


ALL = ("model.name", "trainer.tpu", "sampler.tpu", "storage.root")

# ------------------------------------------------------------------ `path: message` of odd manifests

PARSE: list[tuple[str, str, list[str]]] = [
    (
        "numeric key: quoted, not an index",
        HEAD + "spec: {1: x}\n",
        ['spec["1"]: unknown field', *required(*ALL)],
    ),
    (
        "numeric key deeper",
        HEAD + "spec: {trainer: {1: x}}\n",
        ['spec.trainer["1"]: unknown field', *required(*ALL)],
    ),
    (
        "odd keys quoted, indexes and the tpu union",
        HEAD.replace("{name: t}", "{name: t, labels: {a/b: 1}}")
        + "spec: {trainer: {mesh: {a.b: 1}, tpu: 5}, model: {name: 5}, lora: {targets: [q_proj, 1]}}\n",
        [
            'metadata.labels["a/b"]: Input should be a valid string',
            "spec.model.name: Input should be a valid string",
            "spec.trainer.tpu: Input should be a valid string",
            "spec.trainer.tpu: Input should be an object",
            'spec.trainer.mesh["a.b"]: unknown field',
            "spec.lora.targets[1]: Input should be a valid string",
            # Not repeated for the fields that failed (model.name, trainer.tpu): only the others.
            *required("sampler.tpu", "storage.root"),
        ],
    ),
    (
        "a tpu object with a bad field: only the object's problem",
        HEAD + "spec: {sampler: {tpu: {accelerator: tpu7x, topology: 2x2x2, chips: 8}}}\n",
        ["spec.sampler.tpu.chips: unknown field", *required("model.name", "trainer.tpu", "storage.root")],
    ),
    (
        "odd key at the root",
        HEAD + "spec: {}\nx y: 1\n",
        ['(root)["x y"]: unknown field', *required(*ALL)],
    ),
    (
        "two documents",
        HEAD + "spec: {}\n---\n" + HEAD + "spec: {}\n",
        ["(yaml): expected one RLJob document, found 2"],
    ),
    ("no document", "---\n", ["(yaml): expected one RLJob document, found 0"]),
    ("not a mapping", "- a\n", ["(root): expected a mapping (an RLJob), got list"]),
    (
        "yaml error: line and column",
        "a:\n  - b\n - c\n",
        ["(yaml): line 3, column 2: did not find expected key"],
    ),
    (
        "yaml error at column 3",
        "a: b\n c: d\n",
        ["(yaml): line 2, column 3: mapping values are not allowed in this context"],
    ),
    (
        "yaml reader error: its first line",
        "a: \x00\n",
        ["(yaml): unacceptable character #x0000: control characters are not allowed"],
    ),
]


@pytest.mark.parametrize(("name", "text", "expected"), PARSE, ids=[p[0] for p in PARSE])
def test_parse_problems(name: str, text: str, expected: list[str]) -> None:
    with pytest.raises(plan.PlanError) as err:
        plan.parse_manifest(text)
    assert err.value.problems == expected


# ------------------------------------------------------------------ nulls: no value, as the API server


def _with(spec: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A manifest with `spec` merged in, keeping its nulls (the fixture's manifest() deletes them)."""
    doc = copy.deepcopy(base) if base is not None else manifest({})
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key].update(value)
        else:
            doc["spec"][key] = value
    return doc


NULLS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("algorithm.maxTokens", {"algorithm": {"maxTokens": None}}, {"spec.algorithm.max_tokens": 2048}),
    ("algorithm", {"algorithm": None}, {"spec.algorithm.steps": 100, "spec.packing.token_budget": 3072}),
    ("sampler.replicas", {"sampler": {"replicas": None}}, {"sampler.replicas": 1}),
    ("trainer.slices", {"trainer": {"slices": None}}, {"trainer.slices": 1}),
    ("lora.rank", {"lora": {"rank": None}}, {"sampler.lora_max_rank": 16, "spec.lora.alpha": 32.0}),
    ("packing.padAlign", {"packing": {"padAlign": None}}, {"spec.packing.pad_align": 4096}),
]


@pytest.mark.parametrize(("name", "spec", "expected"), NULLS, ids=[n[0] for n in NULLS])
def test_null_is_no_value(name: str, spec: dict[str, Any], expected: dict[str, Any]) -> None:
    run = resolve(_with(spec))
    assert {k: _get(run, k) for k in expected} == expected


def test_null_keeps_the_recipe_value_and_removes_a_recipe_maxtext_key() -> None:
    base = recipe_manifest("qwen3.5-397b-a17b-tpu7x")
    recipe = resolve(base)
    run = resolve(_with({"trainer": {"tpu": None, "maxtext": {"num_vocab_tiling": None}}}, base))
    assert run.trainer.tpu == recipe.trainer.tpu
    assert recipe.trainer.maxtext["num_vocab_tiling"] == 16
    assert recipe.trainer.maxtext_sources["num_vocab_tiling"] == "recipe"
    # removed from the MaxText keys (run.json); the recipe's other keys stay
    assert "num_vocab_tiling" not in run.trainer.maxtext
    from_recipe = {k for k, source in run.trainer.maxtext_sources.items() if source == "recipe"}
    assert from_recipe == {k for k, s in recipe.trainer.maxtext_sources.items() if s == "recipe"} - {
        "num_vocab_tiling"
    }


# ------------------------------------------------------------------ a job edited after parsing


def test_merged_spec_is_checked_again() -> None:
    """pydantic does not check assignments: a job edited in code is checked when resolved, its fields
    named after the recipe's problems."""
    job = RLJob.model_validate(manifest({}))
    assert job.spec.trainer is not None
    job.spec.trainer.slices = 0
    with pytest.raises(plan.PlanError) as err:
        plan.resolve(job)
    assert err.value.problems == ["spec.trainer.slices: Input should be greater than or equal to 1"]
    job.spec.recipe = "nope"
    with pytest.raises(plan.PlanError) as err:
        plan.resolve(job)
    assert err.value.problems == [
        f"spec.recipe: unknown recipe 'nope'; known: {', '.join(recipe_catalog.names())}",
        "spec.trainer.slices: Input should be greater than or equal to 1",
    ]


# ------------------------------------------------------------------ resolved values


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


GOOD: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "model name without an organization",
        {"model": {"name": "Qwen3-8B"}},
        {"spec.model.maxtext_model": "qwen3-8b"},
    ),
    (
        "sampler of two hosts: one vLLM server over both, TP = the replica's devices",
        {"sampler": {"tpu": "v5p-16"}},
        {"sampler.tensor_parallel": 8, "sampler.tpu.devices": 8, "sampler.tpu.hosts": 2},
    ),
    (
        "sampler TP below a host, experts over the rest",
        {"model": {"maxtextModel": "gpt-oss-20b"}, "sampler": {"tensorParallel": 2, "expertParallel": 2}},
        {"sampler.tensor_parallel": 2, "sampler.expert_parallel": 2, "sampler.data_parallel": 1},
    ),
    (
        "sampler EP default: TP = devices / EP",
        {"model": {"maxtextModel": "gpt-oss-20b"}, "sampler": {"tpu": "v5p-16", "expertParallel": 4}},
        {"sampler.tensor_parallel": 2, "sampler.expert_parallel": 4},
    ),
    (
        "three two-host slices",
        {"trainer": {"tpu": "v5p-16", "slices": 3}},
        {"trainer.hosts": 6, "trainer.chips": 24, "trainer.devices": 24, "trainer.dcn.data": 3},
    ),
    (
        "pad first with a smaller alignment",
        {"packing": {"padPosition": "start", "padAlign": 2048, "tokenBudget": 8192}},
        {"spec.packing.pad_align": 2048, "trainer.maxtext.max_target_length": 8192},
    ),
]


@pytest.mark.parametrize(("name", "spec", "expected"), GOOD, ids=[g[0] for g in GOOD])
def test_resolves(name: str, spec: dict[str, Any], expected: dict[str, Any]) -> None:
    assert problems(manifest(spec)) == []
    run = resolve(manifest(spec))
    assert {k: _get(run, k) for k in expected} == expected


def test_a_recipe_may_name_its_default_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    real = recipe_catalog.load("qwen3-8b-v5p")
    spec = real.spec.model_copy(deep=True)
    assert spec.trainer is not None
    spec.trainer.profile = "long-context"
    monkeypatch.setattr(recipe_catalog, "load", lambda name: real.model_copy(update={"spec": spec}))
    run = resolve(recipe_manifest("qwen3-8b-v5p"))
    assert run.spec.packing.token_budget == 20480
    assert (run.trainer.maxtext["num_vocab_tiling"], run.trainer.maxtext_sources["num_vocab_tiling"]) == (
        4,
        "profile",
    )


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            # set explicitly: refused, naming what would work (unset, the plan derives it: test below)
            {"packing": {"padPosition": "start", "padAlign": 4096}},  # 4096 above the 3072 budget
            [
                "spec.packing.padAlign: 4096 is not below the token budget 3072: padPosition "
                "start would never move a row; set padAlign to a multiple of segmentAlign 64 below 3072 "
                "(e.g. 2048) or raise spec.packing.tokenBudget above it"
            ],
        ),
    ],
)
def test_refused(spec: dict[str, Any], expected: list[str]) -> None:
    assert problems(manifest(spec)) == expected


def test_an_unset_pad_align_the_default_of_which_cannot_work_is_derived() -> None:
    """padPosition start with the default padAlign 4096 at or above the 3072-token budget would never move
    a row: the plan fills the largest segmentAlign x 2^k below it and says so (RunConfig.derived)."""
    run = resolve(
        manifest({"packing": {"padPosition": "start"}, "trainer": {"maxtext": {"weight_dtype": "bfloat16"}}})
    )
    assert run.spec.packing.pad_align == 2048
    assert run.derived == {
        "spec.packing.padAlign": "the default 4096 is not below the token budget 3072, so padPosition start "
        "would never move a row: the largest segmentAlign 64 x 2^k below the budget"
    }


@pytest.mark.parametrize(
    ("keys", "derived"),
    [
        ({}, "bfloat16"),  # MaxText's defaults: bfloat16 activations, float32 weights, scanned layers
        ({"weight_dtype": "float32"}, None),  # set: the job's own value, never replaced
        ({"dtype": "float32"}, None),  # float32 activations: one dtype in the scan's carry
        ({"scan_layers": False}, None),  # no layer scan, no carry
    ],
)
def test_an_unset_weight_dtype_under_bfloat16_scanned_layers_is_derived(
    keys: dict[str, Any], derived: str | None
) -> None:
    """MaxText's default weight_dtype float32 with bfloat16 activations makes the LoRA's output float32 and
    the layer scan's carry change dtype: the trainer's first step fails (rljob drill --compile of
    examples/minimal-no-recipe.yaml). The plan fills bfloat16 and says so."""
    run = resolve(manifest({"trainer": {"maxtext": keys}} if keys else None))
    path = "spec.trainer.maxtext.weight_dtype"
    if derived is None:
        assert path not in (run.derived or {})
        assert run.trainer.maxtext.get("weight_dtype") == keys.get("weight_dtype")
    else:
        assert run.trainer.maxtext["weight_dtype"] == derived
        assert run.trainer.maxtext_sources["weight_dtype"] == "derived"
        assert "changes the layer scan's carry dtype" in (run.derived or {})[path]


@pytest.mark.parametrize("other", ["a-recipe", "z-recipe"])
def test_a_catalog_file_must_name_itself(monkeypatch: pytest.MonkeyPatch, other: str) -> None:
    text = recipe_catalog.source("qwen3-8b-v5p")
    assert text.count("name: qwen3-8b-v5p\n") == 1
    monkeypatch.setattr(
        recipe_catalog, "source", lambda name: text.replace("name: qwen3-8b-v5p", f"name: {other}")
    )
    with pytest.raises(ValueError) as err:
        recipe_catalog.load.__wrapped__("qwen3-8b-v5p")
    assert str(err.value) == f"catalog/qwen3-8b-v5p.yaml names itself '{other}'"


def test_the_runs_uid_is_in_its_storage_path() -> None:
    """An RLJob deleted and created again under the same name (a new uid) never resumes the old run: its
    checkpoints, adapters and rollout cache live under its own uid. Without a uid (`rljob render` of a
    file) the path is {root}/{namespace}/{name}."""
    first = manifest({})
    first["metadata"]["uid"] = "6f0c5d3e-8a4b-4b55-9f1e-2b7d2c9e0a11"
    again = copy.deepcopy(first)
    again["metadata"]["uid"] = "0b2d7c1a-1111-4c3e-8a4b-5f6e7d8c9b0a"
    a, b, plain = resolve(first), resolve(again), resolve(manifest({}))
    assert a.storage.checkpoints == "gs://bucket/runs/ns/t/6f0c5d3e-8a4b-4b55-9f1e-2b7d2c9e0a11/checkpoints"
    assert b.storage.root == "gs://bucket/runs/ns/t/0b2d7c1a-1111-4c3e-8a4b-5f6e7d8c9b0a"
    assert {a.storage.adapters, b.storage.adapters, plain.storage.adapters} == {
        f"{a.storage.root}/adapters",
        f"{b.storage.root}/adapters",
        "gs://bucket/runs/ns/t/adapters",
    }
    # MaxText's own output directory is not set: nothing rljob runs reads it (rljob.recipes.maxtext_policy).
    assert "base_output_directory" not in a.trainer.maxtext and "run_name" not in a.trainer.maxtext
    # The uid becomes a path component: only the API server's form is accepted.
    bad = copy.deepcopy(first)
    bad["metadata"]["uid"] = "../other-run"
    assert problems(bad) == ['metadata.uid: "../other-run" must be an object uid as the API server writes it']
