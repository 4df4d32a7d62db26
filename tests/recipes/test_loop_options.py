"""spec.algorithm's loop options and spec.evaluation in the plan: resolved values, derived ones, every
refusal at once naming its field, and `rljob plan`'s lines."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.recipes import manifest, problems, resolve
from rljob.cli.main import explain


def test_defaults_resolve_to_todays_loop() -> None:
    rc = resolve(manifest())
    alg, ev = rc.spec.algorithm, rc.spec.evaluation
    assert (alg.clip_low, alg.clip_high, alg.importance_ratio, alg.loss_normalization) == (
        0.2,
        0.2,
        "token",
        "token",
    )
    assert (alg.overlong_buffer, alg.overlong_penalty) == (0, 1.0)
    assert alg.sampling.model_dump() == {"temperature": 1.0, "topP": 1.0, "topK": 0, "stop": ()}
    assert ev.model_dump() == {"every": 10, "passK": 1, "majK": 0, "samples": 1, "temperature": 0.0}


@pytest.mark.parametrize(
    ("evaluation", "samples", "temperature"),
    [
        ({"passK": 8}, 8, 1.0),
        ({"passK": 4, "majK": 16}, 16, 1.0),
        ({"passK": 2, "samples": 10, "temperature": 0.6}, 10, 0.6),
        ({"every": 0}, 1, 0.0),
    ],
)
def test_evaluation_samples_and_temperature_derive_from_k(
    evaluation: dict[str, Any], samples: int, temperature: float
) -> None:
    ev = resolve(manifest({"evaluation": evaluation})).spec.evaluation
    assert (ev.samples, ev.temperature) == (samples, temperature)


def test_every_problem_at_once_each_naming_its_field() -> None:
    doc = manifest(
        {
            "algorithm": {
                "clipHigh": 0.28,
                "maxTokens": 512,
                "overlongBuffer": 600,
                "sampling": {"topK": 1},
            },
            "evaluation": {"passK": 8, "samples": 4, "temperature": 0},
        }
    )
    got = problems(doc)
    assert [p.split(":")[0] for p in got] == [
        "spec.algorithm.clipHigh",
        "spec.algorithm.overlongBuffer",
        "spec.algorithm.sampling.topK",
        "spec.evaluation.samples",
        "spec.evaluation.temperature",
    ], got


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"algorithm": {"overlongPenalty": 0.5}}, "spec.algorithm.overlongPenalty"),
        ({"algorithm": {"sampling": {"temperature": 0}}}, "spec.algorithm.sampling.temperature"),
        ({"algorithm": {"sampling": {"topP": 1.5}}}, "spec.algorithm.sampling.topP"),
        ({"algorithm": {"sampling": {"minP": 0.1}}}, "spec.algorithm.sampling.minP"),  # TPU: not applied
        ({"algorithm": {"importanceRatio": "segment"}}, "spec.algorithm.importanceRatio"),
        ({"algorithm": {"sampling": {"stop": [""]}}}, "spec.algorithm.sampling.stop[0]"),
        ({"evaluation": {"passK": 0}}, "spec.evaluation.passK"),
        ({"lora": {"initFrom": "runs/old/adapters/v3"}}, "spec.lora.initFrom"),
        ({"lora": {"initFrom": "s3://b/adapters/v3"}}, "spec.lora.initFrom"),
    ],
)
def test_refused(spec: dict[str, Any], field: str) -> None:
    got = problems(manifest(spec))
    assert len(got) == 1 and got[0].startswith(field + ":"), got


def test_service_mode_refuses_the_loops_options() -> None:
    doc = manifest(
        {
            "service": {"api": "tinker", "apiKeySecret": "tk-keys"},
            "algorithm": {"lossNormalization": "sequence", "sampling": {"topP": 0.9}},
            "evaluation": {"every": 5},
        }
    )
    got = [p.split(":")[0] for p in problems(doc)]
    assert got == ["spec.algorithm.lossNormalization", "spec.algorithm.sampling", "spec.evaluation"]


def test_plan_shows_the_options() -> None:
    rc = resolve(
        manifest(
            {
                "algorithm": {
                    "loss": "ppo",
                    "clipHigh": 0.28,
                    "importanceRatio": "sequence",
                    "lossNormalization": "sequence",
                    "maxTokens": 1000,
                    "overlongBuffer": 200,
                    "sampling": {"temperature": 0.7, "topP": 0.95, "topK": 50, "stop": ["</answer>"]},
                },
                "evaluation": {"every": 5, "passK": 4, "majK": 8},
                "lora": {"initFrom": "gs://bucket/runs/ns/old/u1/adapters/v40"},
            }
        )
    )
    text = explain(rc)
    assert (
        "  loss: sequence-level ratio clipped to [0.8, 1.28], sequence-level normalization, advantages mean, "
        "overlong shaping: -1 x (length - 800) / 200 past 800 tokens\n" in text
    )
    assert "  sampling: temperature 0.7, top-p 0.95, top-k 50, stop ['</answer>'], max tokens 1000\n" in text
    assert (
        "  evaluation: every 5 steps on the 64 held-out prompts, 8 sample(s) each (temperature 1): " in text
    )
    assert "pass@4, maj@8\n" in text
    warm = "  warm start: LoRA from gs://bucket/runs/ns/old/u1/adapters/v40 (published as adapter v0)\n"
    assert warm in text
