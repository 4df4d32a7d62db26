"""spec.packing for the model's decoder: a decoder with gated delta net layers (MaxText decoder blocks
qwen3_5 and qwen3_next) trains one rollout per row with the padding at the end, and the plan says so
(maxSegmentsPerRow 1, padPosition end) or refuses the manifest naming the field; any other decoder keeps
the packing as written."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.recipes import manifest, problems, recipe_manifest, resolve
from rljob.recipes import recipe_catalog

QWEN35 = "qwen3.5-397b-a17b-tpu7x"
WHY = (
    "the qwen3_5 decoder of qwen3.5-397b-a17b has gated delta net layers, whose state runs along the whole "
    "row, so it trains one rollout per row with the padding at the end"
)
# A Qwen3.5 / Qwen3-Next model without a recipe on the minimal manifest's v5p-8s: the sampler splits the
# 2 KV heads over tensor parallelism 2 and the experts over expert parallelism 2.
GDN_SAMPLER = {"tensorParallel": 2, "expertParallel": 2}


def _recipe(profile: str | None = None, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = recipe_manifest(QWEN35, profile, name="q")
    for key, value in (spec or {}).items():
        doc["spec"].setdefault(key, {}).update(value)
    return doc


# (name, manifest, (padPosition, maxSegmentsPerRow) resolved)
RESOLVED: list[tuple[str, dict[str, Any], tuple[str, int | None]]] = [
    *[
        (f"recipe {QWEN35} {p or 'default'}", _recipe(p), ("end", 1))
        for p in [None, *recipe_catalog.load(QWEN35).profiles]
    ],
    (
        "qwen3.5 without a recipe: the plan fills one per row",
        manifest(
            {
                "model": {"maxtextModel": "qwen3.5-397b-a17b"},
                # slices that hold it (rljob.recipes.fit): float32 weights on 32 chips, bf16 on 16
                "trainer": {"tpu": "v5p-64"},
                "sampler": {"tpu": "v5p-32", "tensorParallel": 2, "expertParallel": 8},
            }
        ),
        ("end", 1),
    ),
    (
        "another qwen3.5 without a recipe: the plan fills one per row",
        manifest({"model": {"maxtextModel": "qwen3.5-35b-a3b"}, "sampler": GDN_SAMPLER}),
        ("end", 1),
    ),
    (
        "qwen3.5 asking for what it trains anyway",
        _recipe(spec={"packing": {"padPosition": "end", "maxSegmentsPerRow": 1}}),
        ("end", 1),
    ),
    ("dense: as many as fit, by default", manifest({}), ("end", None)),
    (
        "dense: balanced and packed stay as written",
        manifest({"packing": {"padPosition": "balanced", "padAlign": 2048, "maxSegmentsPerRow": 3}}),
        ("balanced", 3),
    ),
    (
        "dense recipe: unaffected",
        recipe_manifest("qwen3-8b-v5p", name="q"),
        ("end", None),
    ),
]


@pytest.mark.parametrize(("name", "doc", "expected"), RESOLVED, ids=[r[0] for r in RESOLVED])
def test_resolved_rows(name: str, doc: dict[str, Any], expected: tuple[str, int | None]) -> None:
    pack = resolve(doc).spec.packing
    assert (pack.pad_position, pack.max_segments_per_row) == expected


REFUSED: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "qwen3.5 recipe with balanced padding",
        _recipe(spec={"packing": {"padPosition": "balanced"}}),
        [f"spec.packing.padPosition: balanced; {WHY} (set end, or remove it)"],
    ),
    (
        "qwen3.5 recipe with packed rows and leading padding, both at once",
        _recipe(spec={"packing": {"padPosition": "start", "maxSegmentsPerRow": 4}}),
        [
            f"spec.packing.padPosition: start; {WHY} (set end, or remove it)",
            f"spec.packing.maxSegmentsPerRow: 4; {WHY} (set 1, or remove it)",
        ],
    ),
    (
        "qwen3-next without a recipe, packed rows",
        manifest(
            {
                "model": {"maxtextModel": "qwen3-next-80b-a3b"},
                "sampler": GDN_SAMPLER,
                "packing": {"maxSegmentsPerRow": 2},
            }
        ),
        [
            "spec.packing.maxSegmentsPerRow: 2; the qwen3_next decoder of qwen3-next-80b-a3b has gated delta "
            "net layers, whose state runs along the whole row, so it trains one rollout per row with the "
            "padding at the end (set 1, or remove it)",
            "spec.model.maxtextModel: decoder block 'qwen3_next': the PEFT export of the qwen3_next block "
            "(gated delta net blocks) is not written and tested yet; the trainer exports LoRA adapters of "
            "the decoder blocks deepseek, gemma3, gemma4, gpt_oss, llama2, mixtral, qwen3, qwen3_5, "
            "qwen3_moe only",
        ],
    ),
    (
        "a dense model made a gated delta net one by its decoder_block key",
        manifest(
            {
                "trainer": {"maxtext": {"decoder_block": "qwen3_5", "override_model_config": True}},
                "packing": {"padPosition": "start", "tokenBudget": 8192, "padAlign": 2048},
            }
        ),
        [
            "spec.packing.padPosition: start; the qwen3_5 decoder of qwen3-8b has gated delta net "
            "layers, whose state runs along the whole row, so it trains one rollout per row with the "
            "padding at the end (set end, or remove it)"
        ],
    ),
]


@pytest.mark.parametrize(("name", "doc", "expected"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_rows(name: str, doc: dict[str, Any], expected: list[str]) -> None:
    assert problems(doc) == expected


def test_max_segments_per_row_is_positive() -> None:
    assert problems(manifest({"packing": {"maxSegmentsPerRow": 0}})) == [
        "spec.packing.maxSegmentsPerRow: Input should be greater than or equal to 1"
    ]
