"""Every MaxText key the plan can accept is applied (by the model rljob's trainer builds, or by the trainer
itself, where named) or refused with the reason (rljob.recipes.maxtext_policy)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import catalog_cases, manifest, problems, resolve
from rljob.recipes import maxtext_keys, maxtext_policy
from rljob.recipes.trainer_keys import DERIVED_KEYS

TESTED_MODULES = ("rljob.recipes.trainer_keys",)

REPO = Path(__file__).resolve().parents[2]
KEYSET = maxtext_keys.load(maxtext_keys.DEFAULT_VERSION)
ACCEPTABLE = sorted(k for k in KEYSET.defaults if k not in DERIVED_KEYS)
# The trainer's code that reads each key it honours: the file named first in TRAINER_KEYS' "where" and a
# string of that file that reads the key.
TRAINER_READERS = {
    "opt_type": ("trainer/train_step.py", "scale_by_adam"),
    "adam_b1": ("trainer/main.py", '"adam_b1"'),
    "adam_b2": ("trainer/main.py", '"adam_b2"'),
    "adam_eps": ("trainer/main.py", '"adam_eps"'),
    "adam_eps_root": ("trainer/main.py", '"adam_eps_root"'),
    "adam_weight_decay": ("trainer/main.py", '"adam_weight_decay"'),
    "mu_dtype": ("trainer/main.py", 'dtype("mu_dtype")'),
    "grad_dtype": ("trainer/main.py", 'dtype("grad_dtype")'),
    "gradient_clipping_threshold": ("trainer/main.py", '"gradient_clipping_threshold"'),
    "gradient_accumulation_steps": ("trainer/main.py", '"gradient_accumulation_steps"'),
    "checkpoint_period": ("trainer/main.py", '"checkpoint_period"'),
    "profiler": ("trainer/profiling.py", '"profiler"'),
    "profiler_steps": ("trainer/profiling.py", '"profiler_steps"'),
    "skip_first_n_steps_for_profiler": ("trainer/profiling.py", '"skip_first_n_steps_for_profiler"'),
}


def test_every_acceptable_key_is_honoured_where_named_or_refused_with_a_reason() -> None:
    import maxtext

    root = Path(maxtext.__file__).parent
    kinds: dict[str, int] = {}
    for key in ACCEPTABLE:
        kind, text = maxtext_policy.classify(key, KEYSET)
        kinds[kind] = kinds.get(kind, 0) + 1
        assert kind in ("model", "trainer", "refused"), key
        if kind == "model":  # names the MaxText file that reads it, which exists and names the key
            path = text.split(":")[0].split(" ")[0]
            src = (root / path).read_text(encoding="utf-8")
            assert key in src or path.startswith("configs/"), (key, text)
        elif kind == "trainer":
            reader, needle = TRAINER_READERS[key]
            assert needle in (REPO / reader).read_text(encoding="utf-8"), (key, reader)
        else:
            assert len(text) > 20 and maxtext_policy.problem(key, KEYSET.defaults[key], KEYSET), key
    assert set(TRAINER_READERS) == set(maxtext_policy.TRAINER_KEYS)
    # The split of MaxText 0.2.5's 865 keys (19 derived by rljob).
    assert kinds == {"model": 459, "trainer": 14, "refused": 373}


@pytest.mark.parametrize("key", ACCEPTABLE)
def test_plan_accepts_exactly_the_keys_something_reads(key: str) -> None:
    """A key at its MaxText default: accepted iff the model or the trainer reads it (the plan's check is
    the policy's, so this runs the policy for every key; the plan itself is run by the tests below)."""
    kind, _ = maxtext_policy.classify(key, KEYSET)
    why = maxtext_policy.problem(key, KEYSET.defaults[key], KEYSET)
    assert (why is None) == (kind != "refused"), (key, why)


def test_plan_never_lists_a_key_nothing_reads() -> None:
    """Every recipe, profile and example: each key of the final MaxText dict is derived or read."""
    for name, doc in catalog_cases():
        rc = resolve(doc)
        for key, source in rc.trainer.maxtext_sources.items():
            kind, _ = maxtext_policy.classify(key, KEYSET, set(DERIVED_KEYS))
            assert kind != "refused", (name, key)
            assert (kind == "derived") == (source == "rljob"), (name, key, source)


def test_derived_keys_nothing_reads_are_refused_but_not_listed() -> None:
    """run_name, base_output_directory, load_parameters_path, learning_rate, steps: the trainer reads the
    spec fields themselves, so the plan refuses them in a manifest and leaves them out of the key dict."""
    from rljob.recipes.trainer_keys import NOT_IN_KEYS

    rc = resolve(manifest({"model": {"checkpoint": "gs://ckpt/q/0/items"}}))
    assert NOT_IN_KEYS.isdisjoint(rc.trainer.maxtext) and set(DERIVED_KEYS) > NOT_IN_KEYS
    assert set(DERIVED_KEYS) - NOT_IN_KEYS <= set(rc.trainer.maxtext)
    for key in NOT_IN_KEYS:
        assert key not in KEYSET.model_reads, key
    (line,) = problems(manifest({"trainer": {"maxtext": {"learning_rate": 0.1}}}))
    assert line == (
        "spec.trainer.maxtext.learning_rate: set by rljob from spec.algorithm.learningRate; set that instead"
    )


ISSUE_KEYS: dict[str, Any] = {
    "opt_type": "sgd",
    "adam_b1": 0.5,
    "warmup_steps_fraction": 0.3,
    "gradient_accumulation_steps": 4,
    "checkpoint_period": 7,
    "profiler": "xplane",
}


def test_the_issue_manifest_is_refused_where_nothing_would_apply_it() -> None:
    out = problems(manifest({"trainer": {"maxtext": ISSUE_KEYS}}))
    assert out == [
        "spec.trainer.maxtext.opt_type: 'sgd': rljob's trainer owns the optimizer (AdamW on the LoRA "
        "parameters, adam_* keys): use spec.algorithm.* (opt_type adamw only)",
        "spec.trainer.maxtext.warmup_steps_fraction: nothing rljob runs reads this key: rljob's trainer owns "
        "the learning-rate schedule: set spec.algorithm.warmupSteps and spec.algorithm.learningRateSchedule",
    ]


def test_the_accepted_keys_reach_the_trainer() -> None:
    keys = {k: v for k, v in ISSUE_KEYS.items() if k not in ("opt_type", "warmup_steps_fraction")}
    rc = resolve(manifest({"trainer": {"maxtext": keys}, "algorithm": {"warmupSteps": 3}}))
    assert {k: rc.trainer.maxtext[k] for k in keys} == keys
    assert {k: rc.trainer.maxtext_sources[k] for k in keys} == dict.fromkeys(keys, "manifest")
    assert (rc.spec.algorithm.warmup_steps, rc.spec.algorithm.learning_rate_schedule) == (3, "constant")
    assert rc.storage.profile == "gs://bucket/runs/ns/t/tensorboard/plugins/profile"


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ({"profiler": "nsys"}, ["profiler: 'nsys': rljob's trainer writes JAX profiler (xplane) traces"]),
        ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps: 0: must be an integer >= 1"]),
        ({"checkpoint_period": 2.5}, ["checkpoint_period: 2.5: must be an integer >= 1"]),
        (
            {"skip_first_n_steps_for_profiler": -1},
            ["skip_first_n_steps_for_profiler: -1: must be an integer"],
        ),
        ({"mu_dtype": "int8"}, ["mu_dtype: 'int8': must be one of float32, bfloat16, float16"]),
        ({"adam_b2": "x"}, ["adam_b2: 'x': must be a number >= 0"]),
        (
            {"dataset_path": "gs://b/d"},
            [
                "dataset_path: nothing rljob runs reads this key: rljob's trainer "
                "trains on the samplers' rollouts"
            ],
        ),
        (
            {"enable_checkpointing": True},
            [
                "enable_checkpointing: nothing rljob runs reads this key: rljob's "
                "trainer writes its own step-exact orbax checkpoints"
            ],
        ),
        (
            {"enable_dropout": True},
            [
                "enable_dropout: nothing rljob runs reads this key: rljob's trainer "
                "runs the model without dropout"
            ],
        ),
        (
            {"enable_tensorboard": True},
            [
                "enable_tensorboard: nothing rljob runs reads this key: rljob's "
                "trainer logs its own step metrics"
            ],
        ),
        (
            {"upload_all_profiler_results": True},
            [
                "upload_all_profiler_results: nothing rljob runs reads this "
                "key: rljob's trainer profiles with profiler: xplane"
            ],
        ),
        (
            {"decode_sampling_temperature": 0.7},
            [
                "decode_sampling_temperature: nothing rljob runs reads this "
                "key: the samplers (vLLM) run inference"
            ],
        ),
        (
            {"lr_schedule_type": "wsd"},
            [
                "lr_schedule_type: nothing rljob runs reads this key: rljob's "
                "trainer owns the learning-rate schedule"
            ],
        ),
        # accepted: model keys, trainer keys at good values
        ({"remat_policy": "full", "attention": "dot_product", "scan_layers": False}, []),
        ({"opt_type": "adamw", "profiler": "", "grad_dtype": "bfloat16", "adam_weight_decay": 0.1}, []),
    ],
)
def test_refusals_name_the_key_and_the_reason(keys: dict[str, Any], expected: list[str]) -> None:
    out = problems(manifest({"trainer": {"maxtext": keys}}))
    assert len(out) == len(expected), out
    for line, want in zip(out, expected, strict=True):
        assert line.startswith(f"spec.trainer.maxtext.{want}"), line


def test_a_recipe_key_nothing_reads_is_refused_naming_the_recipe() -> None:
    from fixtures.recipes import recipe_manifest

    doc = recipe_manifest("qwen3-8b-v5p")
    doc["spec"]["trainer"] = {"maxtext": {"eval_interval": 5}}
    (line,) = problems(doc)
    assert re.match(r"spec\.trainer\.maxtext\.eval_interval: nothing rljob runs reads this key: ", line)


def test_service_mode_refuses_the_trainer_keys_the_service_does_not_read() -> None:
    """spec.service: the Tinker service takes AdamParams from each optim_step and checkpoints every
    checkpointEvery steps; it reads gradient_accumulation_steps (its accumulate calls) only."""
    service = {"service": {"api": "tinker", "apiKeySecret": "keys"}, "sampler": {"maxLoras": 8}}
    keys = {"adam_b1": 0.5, "checkpoint_period": 3, "profiler": "xplane", "gradient_accumulation_steps": 2}
    out = problems(manifest({**service, "trainer": {"maxtext": keys}, "algorithm": {"warmupSteps": 2}}))
    assert out == [
        "spec.algorithm.warmupSteps: the Tinker service (spec.service) takes the optimizer from each "
        "optim_step's AdamParams (its learning_rate: the client's schedule)",
        "spec.trainer.maxtext.adam_b1: nothing rljob runs reads this key in service mode: the Tinker service "
        "(spec.service) takes the optimizer from each optim_step's AdamParams",
        "spec.trainer.maxtext.checkpoint_period: nothing rljob runs reads this key in service mode: the "
        "Tinker service checkpoints every spec.service.checkpointEvery optim steps",
        "spec.trainer.maxtext.profiler: nothing rljob runs reads this key in service mode: the Tinker "
        "service writes no profiler traces",
    ]
    rc = resolve(manifest({**service, "trainer": {"maxtext": {"gradient_accumulation_steps": 2}}}))
    assert rc.trainer.maxtext["gradient_accumulation_steps"] == 2
    assert set(maxtext_policy.SERVICE_UNREAD) < set(maxtext_policy.TRAINER_KEYS)


def test_service_mode_leaves_out_a_recipes_loop_keys() -> None:
    """The recipe's grad_dtype / mu_dtype (loop mode's) are neither refused nor listed in service mode."""
    from fixtures.recipes import recipe_manifest

    doc = recipe_manifest("qwen3-8b-v5p")
    doc["spec"].update(service={"api": "tinker", "apiKeySecret": "keys"}, sampler={"maxLoras": 8})
    rc = resolve(doc)
    assert {"grad_dtype", "mu_dtype"}.isdisjoint(rc.trainer.maxtext)
    assert resolve(recipe_manifest("qwen3-8b-v5p")).trainer.maxtext["grad_dtype"] == "float32"
