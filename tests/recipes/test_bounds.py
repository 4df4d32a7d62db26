"""Field bounds of the RLJob API and of run.json: a value at the bound is accepted, one past it is refused
with the field named (the CRD's minimum/maximum come from the same pydantic fields)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from fixtures.recipes import MINIMAL, manifest, problems, resolve
from pydantic import ValidationError
from rljob.recipes.api import RLJobSpec, RLJobStatus
from rljob.recipes.runconfig import MESH_AXES, RunConfig

SHORT = {"algorithm": {"maxPromptTokens": 64, "maxTokens": 64}}  # seq 128: the smallest maxModelLen fits

# (id, spec at the bound, (RunConfig attribute path, resolved value), spec past the bound, the problem)
BOUNDS: list[tuple[str, dict[str, Any], tuple[str, Any], dict[str, Any], str]] = [
    (
        "trainer.slices max",
        {"trainer": {"slices": 64}},
        ("trainer.dcn.data", 64),
        {"trainer": {"slices": 65}},
        "spec.trainer.slices: Input should be less than or equal to 64",
    ),
    (
        "trainer.containersPerHost min",
        {"trainer": {"containersPerHost": 1}},
        ("trainer.tpu.containers_per_host", 1),
        {"trainer": {"containersPerHost": 0}},
        "spec.trainer.containersPerHost: Input should be greater than or equal to 1",
    ),
    (
        "trainer.containersPerHost max",
        {"trainer": {"tpu": "tpu7x-16", "containersPerHost": 2}},
        ("trainer.tpu.containers_per_host", 2),
        {"trainer": {"tpu": "tpu7x-16", "containersPerHost": 3}},
        "spec.trainer.containersPerHost: Input should be less than or equal to 2",
    ),
    (
        "sampler.tensorParallel min",
        # TP x DP x EP is the replica's devices: 1 x 1 x 4 over a v5p-8 of the MoE gpt-oss-20b.
        {"model": {"maxtextModel": "gpt-oss-20b"}, "sampler": {"tensorParallel": 1, "expertParallel": 4}},
        ("sampler.tensor_parallel", 1),
        {"sampler": {"tensorParallel": 0}},
        "spec.sampler.tensorParallel: Input should be greater than or equal to 1",
    ),
    (
        "sampler.maxModelLen min",
        {**SHORT, "sampler": {"maxModelLen": 128}},
        ("sampler.max_model_len", 128),
        {**SHORT, "sampler": {"maxModelLen": 127}},
        "spec.sampler.maxModelLen: Input should be greater than or equal to 128",
    ),
    (
        "trainer.microBatchSize min",
        {"trainer": {"mesh": {"fsdp": 1, "tensor": -1}, "microBatchSize": 1}},
        ("trainer.micro_batch_size", 1),
        {"trainer": {"microBatchSize": 0}},
        "spec.trainer.microBatchSize: Input should be greater than or equal to 1",
    ),
    (
        "sampler.replicas min",
        {"sampler": {"replicas": 1}},
        ("sampler.replicas", 1),
        {"sampler": {"replicas": 0}},
        "spec.sampler.replicas: Input should be greater than or equal to 1",
    ),
    (
        "sampler.replicas max",
        {"sampler": {"replicas": 256}},
        ("sampler.replicas", 256),
        {"sampler": {"replicas": 257}},
        "spec.sampler.replicas: Input should be less than or equal to 256",
    ),
    (
        "sampler.maxLoras min",
        {"sampler": {"maxLoras": 1}},
        ("sampler.max_loras", 1),
        {"sampler": {"maxLoras": 0}},
        "spec.sampler.maxLoras: Input should be greater than or equal to 1",
    ),
    (
        "sampler.maxLoras max",
        {"sampler": {"maxLoras": 64}},
        ("sampler.max_loras", 64),
        {"sampler": {"maxLoras": 65}},
        "spec.sampler.maxLoras: Input should be less than or equal to 64",
    ),
    (
        "lora.rank min",
        {"lora": {"rank": 1}},
        ("sampler.lora_max_rank", 1),
        {"lora": {"rank": 0}},
        "spec.lora.rank: Input should be greater than or equal to 1",
    ),
    (
        "lora.alpha above 0",
        {"lora": {"alpha": 0.5}},
        ("spec.lora.alpha", 0.5),
        {"lora": {"alpha": 0}},
        "spec.lora.alpha: Input should be greater than 0",
    ),
    (
        "lora.targets one",
        {"lora": {"targets": ["q_proj"]}},
        ("spec.lora.targets", ("q_proj",)),
        {"lora": {"targets": []}},
        "spec.lora.targets: List should have at least 1 item after validation, not 0",
    ),
    (
        # The CRD admits 1; the plan refuses it as the RL loop does at start (rljob.recipes.startup).
        "algorithm.groupSize min",
        {"algorithm": {"groupSize": 2}},
        ("spec.algorithm.group_size", 2),
        {"algorithm": {"groupSize": 1}},
        "spec.algorithm.groupSize: GRPO needs at least 2 samples per prompt, got 1",
    ),
    (
        "algorithm.steps min",
        {"algorithm": {"steps": 1}},
        ("spec.algorithm.steps", 1),
        {"algorithm": {"steps": 0}},
        "spec.algorithm.steps: Input should be greater than or equal to 1",
    ),
    (
        "algorithm.learningRate above 0",
        {"algorithm": {"learningRate": 0.5}},
        ("spec.algorithm.learning_rate", 0.5),
        {"algorithm": {"learningRate": 0}},
        "spec.algorithm.learningRate: Input should be greater than 0",
    ),
    (
        "algorithm.learningRate below 1",
        {"algorithm": {"learningRate": 0.5}},
        ("spec.algorithm.learning_rate", 0.5),
        {"algorithm": {"learningRate": 1}},
        "spec.algorithm.learningRate: Input should be less than 1",
    ),
    (
        "algorithm.groupsPerBatch min",
        {"algorithm": {"groupsPerBatch": 1}},
        ("spec.algorithm.groups_per_batch", 1),
        {"algorithm": {"groupsPerBatch": 0}},
        "spec.algorithm.groupsPerBatch: Input should be greater than or equal to 1",
    ),
    (
        "algorithm.maxTokens min",
        {"algorithm": {"maxTokens": 1}},
        ("spec.packing.token_budget", 1536),  # 1024 + 1 rounded up to Splash's 512-token blocks
        {"algorithm": {"maxTokens": 0}},
        "spec.algorithm.maxTokens: Input should be greater than or equal to 1",
    ),
    (
        "algorithm.maxPromptTokens min",
        {"algorithm": {"maxPromptTokens": 1}},
        ("spec.packing.token_budget", 2560),  # 1 + 2048 rounded up to Splash's 512-token blocks
        {"algorithm": {"maxPromptTokens": 0}},
        "spec.algorithm.maxPromptTokens: Input should be greater than or equal to 1",
    ),
    (
        "algorithm.klPenaltyCoef min",
        {"algorithm": {"klPenaltyCoef": 0}},
        ("spec.algorithm.kl_penalty_coef", 0.0),
        {"algorithm": {"klPenaltyCoef": -0.5}},
        "spec.algorithm.klPenaltyCoef: Input should be greater than or equal to 0",
    ),
    (
        "packing.tokenBudget min",
        {**SHORT, "packing": {"tokenBudget": 128}},
        ("trainer.maxtext.max_target_length", 128),
        {**SHORT, "packing": {"tokenBudget": 127}},
        "spec.packing.tokenBudget: Input should be greater than or equal to 128",
    ),
    (
        "packing.padAlign min",
        {"packing": {"padPosition": "start", "segmentAlign": 1, "padAlign": 1}},
        ("spec.packing.pad_align", 1),
        {"packing": {"padPosition": "start", "padAlign": 0}},
        "spec.packing.padAlign: Input should be greater than or equal to 1",
    ),
    (
        "packing.segmentAlign min",
        {"packing": {"segmentAlign": 1}},
        ("spec.packing.token_budget", 3072),
        {"packing": {"segmentAlign": 0}},
        "spec.packing.segmentAlign: Input should be greater than or equal to 1",
    ),
    (
        "dataset.evalSize min",
        {"dataset": {"evalSize": 1}},
        ("spec.dataset.eval_size", 1),
        {"dataset": {"evalSize": 0}},
        "spec.dataset.evalSize: Input should be greater than or equal to 1",
    ),
    (
        "dataset.promptTemplate not empty",
        {"dataset": {"promptTemplate": "{question}"}},
        ("spec.dataset.prompt_template", "{question}"),
        {"dataset": {"promptTemplate": ""}},
        "spec.dataset.promptTemplate: String should have at least 1 character",
    ),
    (
        "failurePolicy.maxRestarts min",
        {"failurePolicy": {"maxRestarts": 0}},
        ("spec.failure_policy.max_restarts", 0),
        {"failurePolicy": {"maxRestarts": -1}},
        "spec.failurePolicy.maxRestarts: Input should be greater than or equal to 0",
    ),
    (
        "failurePolicy.maxRestarts max",
        {"failurePolicy": {"maxRestarts": 1000}},
        ("spec.failure_policy.max_restarts", 1000),
        {"failurePolicy": {"maxRestarts": 1001}},
        "spec.failurePolicy.maxRestarts: Input should be less than or equal to 1000",
    ),
    (
        "model.name not empty",
        {"model": {"name": "q", "maxtextModel": "qwen3-8b"}},
        ("spec.model.name", "q"),
        {"model": {"name": ""}},
        "spec.model.name: String should have at least 1 character",
    ),
    (
        "model.maxtextModel not empty",
        {"model": {"maxtextModel": "qwen3-8b"}},
        ("spec.model.maxtext_model", "qwen3-8b"),
        {"model": {"maxtextModel": ""}},
        "spec.model.maxtextModel: String should have at least 1 character",
    ),
    (
        "queueName max",
        {"queueName": "q" * 63},
        ("spec.queue_name", "q" * 63),
        {"queueName": "q" * 64},
        "spec.queueName: String should have at most 63 characters",
    ),
    (
        "priorityClassName max",
        {"priorityClassName": "p" * 253},
        ("spec.priority_class_name", "p" * 253),
        {"priorityClassName": "p" * 254},
        "spec.priorityClassName: String should have at most 253 characters",
    ),
]


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


@pytest.mark.parametrize(("name", "ok", "got", "bad", "problem"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_bound_accepted_and_one_past_refused(
    name: str, ok: dict[str, Any], got: tuple[str, Any], bad: dict[str, Any], problem: str
) -> None:
    assert problems(manifest(ok)) == []
    assert _get(resolve(manifest(ok)), got[0]) == got[1]
    assert problems(manifest(bad)) == [problem]


def test_namespace_length() -> None:
    doc = manifest({})
    doc["metadata"]["namespace"] = "n" * 63
    assert resolve(doc).storage.root == f"gs://bucket/runs/{'n' * 63}/t"
    doc["metadata"]["namespace"] = "n" * 64
    assert problems(doc) == ["metadata.namespace: String should have at most 63 characters"]
    doc["metadata"]["namespace"] = ""
    assert problems(doc) == ["metadata.namespace: String should have at least 1 character"]


def test_name_length() -> None:
    assert problems(manifest({}, name="")) == ["metadata.name: String should have at least 1 character"]
    # 63 is a valid object name: refused by rljob's own limit (the pods' DNS names), not the model's
    got = problems(manifest({}, name="a" * 63))
    assert got and all(p.startswith("metadata.name: too long: ") for p in got)
    assert problems(manifest({}, name="a" * 64)) == [
        "metadata.name: String should have at most 63 characters"
    ]


def test_tpu_fields_preserve_unknown_fields_in_the_crd_schema() -> None:
    """A tpu is a string or an object, which a structural schema cannot say: the CRD keeps the value
    as given (x-kubernetes-preserve-unknown-fields) and the models check it."""
    defs = RLJobSpec.model_json_schema()["$defs"]
    for role in ("TrainerSpec", "SamplerSpec"):
        branches = defs[role]["properties"]["tpu"]["anyOf"]
        assert [b.get("x-kubernetes-preserve-unknown-fields") for b in branches] == [True, None]
    # trainer.maxtext is a free-form map: kept whole too
    assert defs["TrainerSpec"]["properties"]["maxtext"]["x-kubernetes-preserve-unknown-fields"] is True


# ------------------------------------------------------------------ status and progress


@pytest.mark.parametrize("field", ["used", "left"])
def test_restarts_are_not_negative(field: str) -> None:
    assert RLJobStatus.model_validate({"restarts": {field: 0}}).restarts is not None
    with pytest.raises(ValidationError) as err:
        RLJobStatus.model_validate({"restarts": {field: -1}})
    assert [(".".join(map(str, e["loc"])), e["type"]) for e in err.value.errors()] == [
        (f"restarts.{field}", "greater_than_equal")
    ]


def test_status_defaults_count_from_zero() -> None:
    status = RLJobStatus.model_validate({"restarts": {}, "progress": {}, "roles": {}})
    assert status.model_dump(mode="json", by_alias=True, exclude_none=True) == {
        "conditions": [],
        "restarts": {"used": 0, "left": 0},
        "roles": {"trainer": {"ready": 0, "total": 0}, "sampler": {"ready": 0, "total": 0}},
        "progress": {"step": 0},
    }


@pytest.mark.parametrize(
    ("progress", "error"),
    [
        ({"step": 0, "lastCheckpointStep": 0, "resumedFromStep": 0, "adapterVersion": 0}, None),
        ({"resumedFromStep": -1}, "progress.resumedFromStep"),
        ({"lastCheckpointStep": -1}, "progress.lastCheckpointStep"),
        ({"adapterVersion": -1}, "progress.adapterVersion"),
        ({"step": -1}, "progress.step"),
    ],
)
def test_progress_steps_and_versions_start_at_zero(progress: dict[str, Any], error: str | None) -> None:
    if error is None:
        got = RLJobStatus.model_validate({"progress": progress}).progress
        assert got is not None and got.model_dump(by_alias=True, exclude_none=True) == progress
        return
    with pytest.raises(ValidationError) as err:
        RLJobStatus.model_validate({"progress": progress})
    assert [(".".join(map(str, e["loc"])), e["type"]) for e in err.value.errors()] == [
        (error, "greater_than_equal")
    ]


# ------------------------------------------------------------------ run.json (what the pods load)


_COUNTS = [
    *(
        f"{role}.tpu.{f}"
        for role in ("trainer", "sampler")
        for f in (
            "chips",
            "hosts",
            "chipsPerHost",
            "devicesPerChip",
            "devices",
            "containersPerHost",
            "chipsPerContainer",
        )
    ),
    *(f"trainer.{kind}.{axis}" for kind in ("ici", "dcn") for axis in MESH_AXES),
]


@pytest.fixture(scope="module")
def run_json() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(resolve(MINIMAL).model_dump_json())
    return doc


@pytest.mark.parametrize("path", _COUNTS)
@pytest.mark.parametrize(
    ("value", "error"),
    [("1", "int_type"), (1.0, "int_type"), (True, "int_type"), (0, "greater_than_equal")],
    ids=["string", "float", "bool", "zero"],
)
def test_run_json_counts_are_positive_integers(
    run_json: dict[str, Any], path: str, value: Any, error: str
) -> None:
    doc = copy.deepcopy(run_json)
    node = doc
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    assert type(node[last]) is int and node[last] >= 1
    node[last] = value
    with pytest.raises(ValidationError) as err:
        RunConfig.model_validate_json(json.dumps(doc))
    assert [(".".join(map(str, e["loc"])), e["type"]) for e in err.value.errors()] == [(path, error)]
