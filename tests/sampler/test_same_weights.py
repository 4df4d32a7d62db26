"""Trainer and sampler start from the same weights, in every catalog recipe, profile and example: the
rendered run config (the ConfigMap's run.json both roles read) gives the trainer a MaxText checkpoint
converted from exactly the Hugging Face model and revision the sampler's `vllm serve` command loads, or,
where spec.sampler.weights declares a quantized checkpoint of that model, the sampler loads that checkpoint
with its quantization method and the parity gate's tolerance is the quantization's
(rljob.recipes.quantization)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fixtures.recipes import catalog_cases, objects
from rljob.recipes import quantization
from rljob.recipes.runconfig import CONFIG_KEY, RunConfig
from rljob.sampler.vllm import build_command
from rljob.trainer.hf_weights import BaseWeights, WeightsError, base_weights, check_source

CASES = catalog_cases()


def _rendered(doc: dict[str, Any]) -> RunConfig:
    cms = [o for o in objects(doc) if o["kind"] == "ConfigMap" and CONFIG_KEY in o.get("data", {})]
    assert len(cms) == 1
    return RunConfig.model_validate(json.loads(cms[0]["data"][CONFIG_KEY]))


def _served(rc: RunConfig) -> tuple[str, str]:
    argv = build_command(rc).argv
    assert argv[:2] == ["vllm", "serve"]
    return argv[2], argv[argv.index("--revision") + 1]


@pytest.mark.parametrize(("name", "doc"), CASES, ids=[c[0] for c in CASES])
def test_both_roles_name_the_same_weights(name: str, doc: dict[str, Any]) -> None:
    rc = _rendered(doc)
    bw = base_weights(rc)
    weights = rc.spec.sampler.weights
    q = quantization.get(weights.quantization)
    assert (bw.model, bw.revision) == (rc.spec.model.name, rc.spec.model.revision)
    assert weights.parity_tolerance == q.parity_tolerance
    argv = build_command(rc).argv
    if q.vllm_method is None:
        assert _served(rc) == (bw.model, bw.revision)
        assert "--quantization" not in argv
    else:  # a declared quantization of the trainer's model, loaded as one
        assert _served(rc) == (weights.name, weights.revision) != (bw.model, bw.revision)
        assert argv[argv.index("--quantization") + 1] == q.vllm_method
        assert weights.parity_tolerance > quantization.BF16_PARITY_NATS
    # No catalog entry names a checkpoint: the trainer converts the served model itself, into a directory
    # keyed by that model, revision and the trainer's MaxText version.
    assert bw.convert and bw.directory is not None
    assert bw.directory.endswith(
        f"/cache/converted/{bw.model}@{bw.revision}/maxtext-{rc.spec.trainer.maxtext_version}"
    )
    assert bw.checkpoint == f"{bw.directory}/0/items"


def test_a_revision_reaches_both_roles() -> None:
    _, doc = CASES[0]
    doc = json.loads(json.dumps(doc))
    doc["spec"].setdefault("model", {})["revision"] = "0123abcd"
    rc = _rendered(doc)
    assert _served(rc)[1] == base_weights(rc).revision == "0123abcd"
    assert "@0123abcd/" in str(base_weights(rc).directory)


@pytest.mark.parametrize(
    ("marker", "refused"),
    [
        (None, False),  # the user's own conversion: the step-0 parity gate checks it
        ({"model": "Qwen/Qwen3-8B", "revision": "main", "maxtext": "0.2.5"}, False),
        ({"model": "Qwen/Qwen3-4B", "revision": "main", "maxtext": "0.2.5"}, True),
        ({"model": "Qwen/Qwen3-8B", "revision": "abc123", "maxtext": "0.2.5"}, True),
    ],
)
def test_a_checkpoint_rljob_converted_from_another_model_is_refused(
    tmp_path: Any, marker: dict[str, str] | None, refused: bool
) -> None:
    directory = tmp_path / "Qwen3-x@main" / "maxtext-0.2.5"
    (directory / "0" / "items").mkdir(parents=True)
    if marker is not None:
        (directory / "rljob-converted.json").write_text(json.dumps(marker))
    bw = BaseWeights("Qwen/Qwen3-8B", "main", "0.2.5", f"{directory}/0/items", None)
    if refused:
        with pytest.raises(WeightsError, match=r"^spec\.model\.checkpoint: .* was converted from Qwen/"):
            check_source(bw)
    else:
        check_source(bw)
