"""Hostile and careless manifests: each refused with every problem at once, one `path: message` line each,
exit 2 from the CLI and a refusal (never an exception) from the webhook's plan path, with bounded memory.

The reproducers are appended to examples/minimal-no-recipe.yaml, as the fuzzer that found them did; the
same reproducers go through the admission webhook's path (rljob.operator.plans.make_plan on the API
body)."""

from __future__ import annotations

import copy
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import yaml
from rljob.cli.main import main
from rljob.recipes import manifest, plan, render
from rljob.recipes.plan import PlanError

TESTED_MODULES = ("rljob.recipes.manifest",)

REPO = Path(__file__).resolve().parents[2]
BASE_TEXT = (REPO / "examples" / "minimal-no-recipe.yaml").read_text()
BASE: dict[str, Any] = yaml.safe_load(BASE_TEXT)


def with_spec(**spec: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key].update(value)
        else:
            doc["spec"][key] = value
    return doc


def problems_of_text(text: str) -> list[str]:
    try:
        render.render(plan.parse_manifest(text))
    except PlanError as e:
        return e.problems
    return []


def problems_of_body(body: dict[str, Any]) -> list[str]:
    """What the admission webhook answers for an API body (the operator's plan path)."""
    from rljob.operator.plans import make_plan

    result = make_plan(
        {**body, "metadata": {**body["metadata"], "uid": "u-1", "generation": 1}}, render.render
    )
    return result.error.splitlines() if result.error else []


# (id, spec overrides as an API body would carry them, the problem lines)
REPRODUCERS: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "recipe path traversal",
        {"recipe": "../../examples/qwen3-8b-v5p"},
        [
            "spec.recipe: \"../../examples/qwen3-8b-v5p\" must hold only lowercase letters, digits, '-' and "
            "'.', and start and end with a letter or digit"
        ],
    ),
    (
        "recipe into the catalog by path",
        {"recipe": "../catalog/qwen3-8b-v5p"},
        [
            "spec.recipe: \"../catalog/qwen3-8b-v5p\" must hold only lowercase letters, digits, '-' and '.', "
            "and start and end with a letter or digit"
        ],
    ),
    (
        "300-character recipe",
        {"recipe": "a" * 300},
        ["spec.recipe: String should have at most 63 characters"],
    ),
    (
        "300-character maxtextVersion",
        {"trainer": {"maxtextVersion": "1" * 300}},
        ["spec.trainer.maxtextVersion: String should have at most 32 characters"],
    ),
    (
        "maxtextVersion as a path",
        {"trainer": {"maxtextVersion": "0.2.5/../../x"}},
        ['spec.trainer.maxtextVersion: "0.2.5/../../x" must be a version such as 0.2.5'],
    ),
    *[
        (
            f"promptTemplate {template}",
            {"dataset": {"promptTemplate": template}},
            [
                "spec.dataset.promptTemplate: must be a format string whose only field is {question}, "
                f"without a format spec or conversion (found {template!r}; write {{{{ and }}}} for literal "
                "braces)"
            ],
        )
        for template in ("{question.x}", "{question[a]}", "{question:>999999999}", "{question!r}")
    ],
    (
        "maxPromptTokens 10**400",
        {"algorithm": {"maxPromptTokens": 10**400}},
        ["spec.algorithm.maxPromptTokens: refused: an integer out of range (int64)"],
    ),
    (
        "microBatchSize 4*10**400",
        {"trainer": {"microBatchSize": 4 * 10**400}},
        ["spec.trainer.microBatchSize: refused: an integer out of range (int64)"],
    ),
    (
        "queueName with a space",
        {"queueName": "my queue"},
        [
            "spec.queueName: \"my queue\" must hold only lowercase letters, digits, '-' and '.', and start "
            "and end with a letter or digit"
        ],
    ),
    (
        "priorityClassName with capitals",
        {"priorityClassName": "High_Priority"},
        [
            'spec.priorityClassName: "High_Priority" must be a DNS-1123 subdomain: lowercase letters, '
            "digits, '-' and '.', each dot-separated part starting and ending with a letter or digit"
        ],
    ),
    *[
        (
            f"{role} image {image!r}",
            {role: {"image": image}},
            [
                f"spec.{role}.image: {image!r} must be a container image reference, "
                "[registry[:port]/]path[:tag][@digest], path in lowercase, without spaces".replace("'", '"')
            ],
        )
        for role, image in (("sampler", ""), ("trainer", "gcr.io/x y:1"), ("trainer", "Repo/Upper:1"))
    ],
    (
        "model.name as a vllm flag",
        {"model": {"name": "--trust-remote-code"}},
        [
            'spec.model.name: "--trust-remote-code" must be a Hugging Face model id, org/name or name '
            "(letters, digits, '.', '_', '-'; starting and ending with a letter or digit)"
        ],
    ),
    *[
        (
            f"storage.root {root}",
            {"storage": {"root": root}},
            ["spec.storage.root: the PREFIX of gs://BUCKET/PREFIX may hold no empty, '.' or '..' segment"],
        )
        # orbax's paths collapse `//` and `/./`, google-cloud-storage's do not: two places for one run.
        for root in ("gs://b-1//runs", "gs://b-1/./runs", "gs://b-1/runs/../other")
    ],
    (
        '"8" for an integer',
        {"algorithm": {"steps": "8"}},
        ["spec.algorithm.steps: Input should be a valid integer"],
    ),
    (
        "true for an integer",
        {"algorithm": {"steps": True}},
        ["spec.algorithm.steps: Input should be a valid integer"],
    ),
    ("8 for a string", {"queueName": 8}, ["spec.queueName: Input should be a valid string"]),
    (
        "20,000 unknown MaxText keys",
        {"trainer": {"maxtext": {f"k{i}": i for i in range(20_000)}}},
        ["(root): more than 10000 values; an RLJob holds far fewer"],
    ),
    (
        "2,000 unknown MaxText keys",
        {"trainer": {"maxtext": {f"k{i}": i for i in range(2000)}}},
        ["spec.trainer.maxtext: Dictionary should have at most 1024 items after validation, not more"],
    ),
]


@pytest.mark.parametrize(("name", "spec", "expected"), REPRODUCERS, ids=[r[0] for r in REPRODUCERS])
def test_reproducers_are_refused_naming_the_field(
    name: str, spec: dict[str, Any], expected: list[str]
) -> None:
    doc = with_spec(**spec)
    assert problems_of_body(doc) == expected  # the webhook's path: 422 with these lines, never a 500
    if "10**400" in name:
        return  # PyYAML's dumper cannot write ints past Python's 4300-digit limit (YAML_ONLY has one)
    text = yaml.safe_dump(doc)
    if len(text) > manifest.MAX_TEXT_BYTES:  # a file: refused on its size before it is parsed
        assert problems_of_text(text) == [f"(yaml): {len(text)} bytes; a manifest is at most 262144 bytes"]
    else:
        assert problems_of_text(text) == expected


# YAML-only reproducers: appended as text to the example (the fuzzer's way), with what they must say.
YAML_ONLY: list[tuple[str, str, list[str]]] = [
    (
        "!!binary in a MaxText value",
        "  trainer: {tpu: v5p-8, maxtext: {remat_policy: !!binary /w==}}\n",
        [
            "(yaml): line 16, column 3: duplicate key 'trainer' (first on line 10)",
            "spec.trainer.maxtext.remat_policy: refused: YAML tag tag:yaml.org,2002:binary (a manifest holds "
            "JSON values only)",
        ],
    ),
    ("alpha .inf", "  lora: {alpha: .inf}\n", ["spec.lora.alpha: refused: inf is not a finite number"]),
    ("alpha .nan", "  lora: {alpha: .nan}\n", ["spec.lora.alpha: refused: nan is not a finite number"]),
    (
        "a duplicate key",
        "  suspend: true\n  suspend: false\n",
        ["(yaml): line 17, column 3: duplicate key 'suspend' (first on line 16)"],
    ),
    (
        "an integer with 5000 digits",
        "  algorithm: {steps: " + "9" * 5000 + "}\n",
        ["spec.algorithm.steps: refused: an integer out of range (int64)"],
    ),
    (
        "!!set",
        "  queueName: !!set {a, b}\n",
        ["spec.queueName: refused: YAML tag tag:yaml.org,2002:set (a manifest holds JSON values only)"],
    ),
    (
        "an unknown tag",
        "  queueName: !shell ls\n",
        ["spec.queueName: refused: YAML tag !shell (a manifest holds JSON values only)"],
    ),
]


@pytest.mark.parametrize(("name", "tail", "expected"), YAML_ONLY, ids=[y[0] for y in YAML_ONLY])
def test_yaml_reproducers(name: str, tail: str, expected: list[str]) -> None:
    assert problems_of_text(BASE_TEXT + tail) == expected


def test_timestamps_stay_strings_as_kubectl_decodes_them() -> None:
    job = plan.parse_manifest(BASE_TEXT + "  queueName: 2026-01-01\n")
    assert job.spec.queue_name == "2026-01-01"


def test_four_independent_mistakes_in_one_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A bad queueName (parse), a string for an integer (parse), a LoRA rank vLLM cannot serve and a
    tensor parallelism that does not divide the slice nor the model's KV heads (plan): every line, the
    layout to set among them, exit 2, no traceback."""
    doc = with_spec(
        queueName="my queue",
        algorithm={"steps": "8"},
        lora={"rank": 7},
        sampler={"tensorParallel": 3},
    )
    path = tmp_path / "four.yaml"
    path.write_text(yaml.safe_dump(doc))
    code = main(["validate", "-f", str(path)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "spec.algorithm.steps: Input should be a valid integer",
        "spec.queueName: \"my queue\" must hold only lowercase letters, digits, '-' and '.', and start and "
        "end with a letter or digit",
        "spec.lora.rank: 7 is not a vLLM LoRA rank (1, 8, 16, 32, 64, 128, 256, 320, 512)",
        "spec.sampler.tensorParallel: 3 x dataParallel 1 x expertParallel 1 = 3 is not the 4 devices of a "
        "v5p-8 sampler replica",
        "spec.sampler.tensorParallel: 3 does not divide the 32 attention heads of qwen3-4b (vLLM refuses a "
        "tensor-parallel size that does not divide them)",
        "spec.sampler.tensorParallel: 3 does not divide the 8 KV heads of qwen3-4b",
        "spec.sampler.tensorParallel: a v5p-8 replica of qwen3-4b can be laid out as tensorParallel 4 x "
        "expertParallel 1",
    ]
    assert problems_of_body(doc) == err.splitlines()


def test_a_field_that_fails_is_not_reported_twice() -> None:
    """trainer.tpu set to a bad value: its own lines, not also `required` from the plan of the rest (which
    stops there: nothing else can be planned without the trainer's TPUs)."""
    problems = problems_of_body(with_spec(trainer={"tpu": 5}, lora={"rank": 7}))
    assert problems == [
        "spec.trainer.tpu: Input should be a valid string",
        "spec.trainer.tpu: Input should be an object",
    ]


# ------------------------------------------------------------------ bounded work: refused before it grows


def _alias_bomb(depth: int) -> str:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, depth + 1):
        refs = ", ".join([f"*a{i - 1}"] * 9)
        lines.append(f"a{i}: &a{i} [{refs}]")
    body = "\n".join("  " + x for x in lines)
    return BASE_TEXT.replace("  storage:", f"  trainer:\n    maxtext:\n      bomb:\n  {body}\n  storage:", 1)


BOUNDED: list[tuple[str, str, str]] = [
    ("alias bomb, depth 7 (285 MB expanded)", _alias_bomb(7), "more than 10000 values (aliases expanded)"),
    ("alias bomb, depth 12", _alias_bomb(12), "more than 10000 values (aliases expanded)"),
    ("nesting 40 deep", "a: " + "[" * 40 + "]" * 40 + "\n", "nested deeper than 32 levels"),
    # libyaml's parser stops first (at 1000 levels); the pure-Python parser's is a state machine too.
    ("nesting 100,000 deep", "a: " + "[" * 100_000 + "]" * 100_000 + "\n", "nesting depth"),
    ("a 1 MiB manifest", BASE_TEXT + "# " + "x" * (1 << 20) + "\n", "a manifest is at most 262144 bytes"),
    (
        "format spec of a billion",
        BASE_TEXT + "  dataset: {promptTemplate: '{question:>999999999}'}\n",
        "spec.dataset.promptTemplate: must be a format string",
    ),
    (
        "a 60 KiB string aliased 5000 times",
        BASE_TEXT.replace(
            "  storage:",
            "  trainer:\n    maxtext:\n      s: &s '"
            + "y" * 60_000
            + "'\n      l: ["
            + ", ".join(["*s"] * 5000)
            + "]\n  storage:",
            1,
        ),
        "more than 262144 bytes as JSON",
    ),
]


@pytest.mark.parametrize(("name", "text", "expected"), BOUNDED, ids=[b[0] for b in BOUNDED])
def test_refused_before_the_work_grows(name: str, text: str, expected: str) -> None:
    tracemalloc.start()
    try:
        problems = problems_of_text(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert any(expected in p for p in problems), problems
    # The input itself is at most ~1 MiB here; nothing the parse does may grow past a few times that.
    assert peak < 24 * 1024 * 1024, f"{name}: {peak / 2**20:.1f} MiB"


def test_deep_api_body_is_refused_by_the_walk() -> None:
    deep: Any = 1
    for _ in range(500):
        deep = [deep]
    with pytest.raises(PlanError) as err:
        plan.parse_object(with_spec(trainer={"maxtext": {"remat_policy": deep}}))
    assert err.value.problems == [
        "spec.trainer.maxtext.remat_policy" + "[0]" * 29 + ": nested deeper than 32 levels"
    ]


def test_a_run_configmap_over_a_mebibyte_is_a_plan_error() -> None:
    """Kubernetes refuses a ConfigMap over 1 MiB: the render says so as a problem instead of creating a run
    that could never start. (The input bounds keep every admitted manifest far below it: the largest run.json
    bench/webhook_worst_case.py renders is reported there.)"""
    run = plan.resolve(plan.parse_object(BASE))
    dataset = run.spec.dataset.model_copy(update={"prompt_template": "{question}" + "z" * (1 << 20)})
    huge = run.model_copy(update={"spec": run.spec.model_copy(update={"dataset": dataset})})
    assert len(render.configmap(run)["data"]["run.json"]) < 1 << 20
    with pytest.raises(PlanError) as err:
        render.configmap(huge)
    (line,) = err.value.problems
    assert line.startswith("spec: the run config is 10") and "over the 1048576 bytes of a ConfigMap" in line


def test_a_storage_root_with_a_trailing_slash_is_one_prefix() -> None:
    for root in ("gs://b-1/runs/", "gs://b-1/runs//", "gs://b-1/", "gs://b-1/a..b/.c"):
        run = plan.resolve(plan.parse_object(with_spec(storage={"root": root})))
        assert run.storage.root == f"{root.rstrip('/')}/default/qwen3-4b-min", root
