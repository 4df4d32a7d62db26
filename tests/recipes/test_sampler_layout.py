"""The sampler layout rules of vLLM's TPU backend (rljob.recipes.sampler_layout) against published layouts.

PUBLISHED: layouts vLLM's and Google's own recipes and MaxText's RL tutorials serve, each with its source;
every one must pass the rules, and where rljob plans the model family and the TPU today, a manifest with
that sampler must validate. A layout with data parallelism inside one server is listed as rljob runs it:
one replica per data-parallel rank (LoRA takes no data parallelism; REFUSED holds the one-server form).
REFUSED: layouts the engine refuses, each with the engine's own reason, which rljob must refuse naming the
field. The derivations (what the plan fills when the manifest leaves the layout unset) are tested last.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.recipes import manifest, recipe_manifest
from rljob.cli.main import explain
from rljob.recipes import plan, recipe_catalog, sampler_layout

VLLM_RECIPES = "https://github.com/vllm-project/recipes/blob/main"
TPU_RECIPES = "https://github.com/AI-Hypercomputer/tpu-recipes/blob/main/inference"
MAXTEXT = "https://github.com/AI-Hypercomputer/maxtext/blob/main"
HF = {
    "qwen3.5-397b-a17b": "Qwen/Qwen3.5-397B-A17B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "qwen3-4b": "Qwen/Qwen3-4B",
    "gemma4-31b": "google/gemma-4-31B-it",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "llama3.3-70b": "meta-llama/Llama-3.3-70B-Instruct",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B-Base",
}

# (source, MaxText model, devices of one server, tensorParallel, expertParallel, the rljob sampler TPU of
# those devices or None where rljob does not plan it today, and why not)
PUBLISHED: list[tuple[str, str, int, int, int, str | None]] = [
    # Qwen3.5-397B-A17B, 2 KV heads at tensor parallelism 8: replicated four times each.
    (
        f"{VLLM_RECIPES}/Qwen/Qwen3.5.md (vllm serve --tensor-parallel-size 8)",
        "qwen3.5-397b-a17b",
        8,
        8,
        1,
        "tpu7x-8",
    ),
    # --tensor-parallel-size=8 --enable-expert-parallel: the experts over all 8 devices, as rljob's
    # tensorParallel 1 x expertParallel 8 lays them.
    (
        f"{TPU_RECIPES}/ironwood/vLLM/Qwen3.5-397B/qwen3_5-server.yaml (tpu7x 2x2x1)",
        "qwen3.5-397b-a17b",
        8,
        1,
        8,
        "tpu7x-8",
    ),
    (f"{TPU_RECIPES}/ironwood/vLLM/Qwen3-32B/README.md (tpu7x 1x1x1, TP 2)", "qwen3-32b", 2, 2, 1, "tpu7x-2"),
    # --data-parallel-size=4 --tensor-parallel-size=2 on 2x2x1: four replicas of one chip each in rljob.
    (
        f"{TPU_RECIPES}/ironwood/vLLM/Gemma4/gemma4-server.yaml (DP 4 x TP 2)",
        "gemma4-31b",
        2,
        2,
        1,
        "tpu7x-2",
    ),
    (f"{TPU_RECIPES}/ironwood/vLLM/GPT-OSS/README-gcs.md (DP 4 x TP 2)", "gpt-oss-120b", 2, 2, 1, "tpu7x-2"),
    # Trillium (v6e, one device per chip): rljob plans v5p and tpu7x only, so these are checked against
    # the rules, and on the v5p slice of as many devices.
    (f"{TPU_RECIPES}/trillium/vLLM/Gemma4/README.md (v6e 2x4, TP 8)", "gemma4-31b", 8, 8, 1, "v5p-16"),
    (f"{TPU_RECIPES}/trillium/vLLM/Qwen3/README.md (v6e-4, Qwen3-32B TP 4)", "qwen3-32b", 4, 4, 1, "v5p-8"),
    (f"{TPU_RECIPES}/trillium/vLLM/Qwen3/README.md (v6e-1, Qwen3-4B)", "qwen3-4b", 1, 1, 1, None),
    # Llama: rljob's trainer exports LoRA adapters of the gemma4, gpt_oss, qwen3 and qwen3_5 decoder blocks
    # only today (its llama2 block is refused for that): the layouts are checked against the rules alone.
    (
        f"{TPU_RECIPES}/trillium/vLLM/Llama3.x/README.md (v6e-8, Llama-3.3-70B TP 8)",
        "llama3.3-70b",
        8,
        8,
        1,
        None,
    ),
    (f"{TPU_RECIPES}/trillium/vLLM/Llama3.x/README.md (v6e-1, Llama3.1-8B)", "llama3.1-8b", 1, 1, 1, None),
    # MaxText's RL tutorials: Llama3.1-70B on v5p-128 with rollout_tensor_parallelism=8 (the rest of the
    # rollout devices data parallel: replicas in rljob); Qwen3-30B-A3B on tpu7x-128, rollout data
    # parallelism 16 x tensor parallelism 4 (a 4-device server, which no tpu7x slice is; and its qwen3_moe
    # block is refused by rljob's adapter export today).
    (
        f"{MAXTEXT}/docs/tutorials/posttraining/rl_on_multi_host.md (v5p-128, rollout TP 8)",
        "llama3.1-70b",
        8,
        8,
        1,
        None,
    ),
    (
        f"{MAXTEXT}/src/maxtext/trainers/post_train/rl/scripts/run_qwen3_30b_rl.sh "
        "(tpu7x-128, rollout DP 16 x TP 4)",
        "qwen3-30b-a3b",
        4,
        4,
        1,
        None,
    ),
]


def _sampler_manifest(model: str, sampler: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return manifest(
        {"model": {"name": HF.get(model, model), "maxtextModel": model}, "sampler": sampler, **spec}
    )


def _resolve(doc: dict[str, Any]) -> Any:
    return plan.resolve(plan.parse_manifest(yaml.safe_dump(doc)))


@pytest.mark.parametrize(
    ("source", "model", "devices", "tp", "ep", "tpu"), PUBLISHED, ids=[p[0] for p in PUBLISHED]
)
def test_a_published_layout_validates(
    source: str, model: str, devices: int, tp: int, ep: int, tpu: str | None
) -> None:
    f = sampler_layout.facts(model)
    assert f is not None, source
    assert sampler_layout.problems(f, model, tp, ep, 1, devices, "published") == [], source
    assert (tp, ep) in sampler_layout.layouts(f, model, devices)
    if tpu is None:
        return
    doc = _sampler_manifest(model, {"tpu": tpu, "tensorParallel": tp, "expertParallel": ep})
    # The layout is the engine's question; whether the bf16 weights fit the slice's HBM is the fit check's
    # (rljob.recipes.fit), asked below: a published layout may serve a quantized checkpoint or run on GPUs of
    # more memory (vLLM's Qwen3.5 recipe: 8 H200s), and then rljob's bf16 sampler on the same number of
    # TPU devices is refused for memory, naming the slice that holds it, never for its layout.
    run = plan.resolve(plan.parse_manifest(yaml.safe_dump(doc)), fit_check=False)
    assert (run.sampler.tpu.devices, run.sampler.tensor_parallel, run.sampler.expert_parallel) == (
        devices,
        tp,
        ep,
    )
    try:
        _resolve(doc)
    except plan.PlanError as e:
        for problem in e.problems:
            assert problem.startswith(("spec.trainer.tpu: ", "spec.sampler.tpu: ")), problem
            assert "cannot hold" in problem or "cannot serve" in problem, problem


def test_every_catalog_recipe_sets_a_layout_the_rules_accept() -> None:
    """rljob's own recipes (recipes/catalog/*.yaml, from the design documents' runs)."""
    seen = {}
    for name in recipe_catalog.names():
        run = _resolve(recipe_manifest(name))
        s = run.sampler
        f = sampler_layout.facts(run.spec.model.maxtext_model)
        assert f is not None
        assert (
            sampler_layout.problems(
                f, run.spec.model.maxtext_model, s.tensor_parallel, s.expert_parallel, 1, s.tpu.devices, "x"
            )
            == []
        )
        seen[name] = (s.tpu.type_name, s.tensor_parallel, s.expert_parallel)
    assert seen["qwen3.5-397b-a17b-tpu7x"] == ("tpu7x-16", 1, 16)


# (what, MaxText model, sampler fields, the engine's own reason, the first line rljob gives)
REFUSED: list[tuple[str, str, dict[str, Any], str, str]] = [
    (
        "Gemma 4 on tpu7x 2x2x1 as one server with data parallelism 4 (tpu-recipes' Ironwood Gemma4)",
        "gemma4-31b",
        {"tpu": "tpu7x-8", "tensorParallel": 2, "dataParallel": 4},
        "tpu_inference/layers/common/sharding.py ShardingConfigManager.validate: LoRA is not supported with "
        "data parallelism",
        "spec.sampler.dataParallel: 4; vLLM's TPU backend serves LoRA adapters only without data parallelism",
    ),
    (
        "the tunix launcher's Qwen3.5-397B server: expert parallelism 16 x attention data parallelism 2",
        "qwen3.5-397b-a17b",
        {"tpu": "tpu7x-32", "tensorParallel": 1, "expertParallel": 16, "dataParallel": 2},
        "ShardingConfigManager.validate: LoRA is not supported with data parallelism",
        "spec.sampler.dataParallel: 2; vLLM's TPU backend serves LoRA adapters only without data parallelism",
    ),
    (
        "Qwen3.5-397B over 32 attention devices (tensorParallel 2 x expertParallel 16)",
        "qwen3.5-397b-a17b",
        {"tpu": "tpu7x-32", "tensorParallel": 2, "expertParallel": 16},
        "tpu_inference/layers/common/gdn_attention.py run_jax_gdn_attention: n_kq // tp_size heads a device "
        "(16 // 32 = 0)",
        "spec.sampler.tensorParallel: 2 x expertParallel 16 = 32 does not divide the 16 key and 64 value "
        "heads",
    ),
    (
        "a control: 128 experts over tensorParallel 8 x expertParallel 4 = 32 devices (accepted)",
        "gpt-oss-120b",
        {"tpu": "tpu7x-32", "tensorParallel": 8, "expertParallel": 4},
        "process_weights/moe_weights.py shard_moe_weights: the experts split over every device of the "
        "replica",
        "",  # 128 experts divide by 32: accepted (a control for the next row)
    ),
    (
        # 32 experts divide by the expert parallelism alone, not by the 64 devices they split over
        "32 experts over tensorParallel 2 x expertParallel 32 = 64 devices",
        "gpt-oss-20b",
        {"tpu": "tpu7x-64", "tensorParallel": 2, "expertParallel": 32},
        "fused_moe_gmm.py: num_experts // ep_size experts a device",
        "spec.sampler.tensorParallel: 2 x expertParallel 32 = 64 does not divide the 32 experts of "
        "gpt-oss-20b",
    ),
    (
        "expert parallelism for a dense model",
        "qwen3-8b",
        {"tpu": "v5p-8", "tensorParallel": 2, "expertParallel": 2},
        "vllm/config/model.py ModelConfig._verify_with_expert_parallelism: Number of experts in the model "
        "must be greater than 0 when expert parallelism is enabled",
        "spec.sampler.expertParallel: 2, but qwen3-8b has no experts",
    ),
    (
        "a tensor parallelism that divides neither the attention nor the KV heads",
        "qwen3-8b",
        {"tpu": "v5p-8", "tensorParallel": 3},
        "vllm/config/model.py ModelConfig.verify_with_parallel_config: Total number of attention heads (32) "
        "must be divisible by tensor parallel size (3)",
        "spec.sampler.tensorParallel: 3 x dataParallel 1 x expertParallel 1 = 3 is not the 4 devices",
    ),
]


@pytest.mark.parametrize(
    ("what", "model", "sampler", "engine", "first"), REFUSED, ids=[r[0] for r in REFUSED]
)
def test_a_layout_the_engine_refuses_is_refused(
    what: str, model: str, sampler: dict[str, Any], engine: str, first: str
) -> None:
    doc = _sampler_manifest(model, sampler)
    if not first:
        run = plan.resolve(plan.parse_manifest(yaml.safe_dump(doc)), fit_check=False)  # the layout alone
        assert run.sampler.expert_parallel == sampler["expertParallel"], what
        return
    with pytest.raises(plan.PlanError) as e:
        _resolve(doc)
    lines = [p for p in e.value.problems if p.startswith("spec.sampler.")]
    assert lines and lines[0].startswith(first), (what, engine, e.value.problems)
    # the last line says what to set instead (a layout, or the slice that fits)
    assert lines[-1].startswith(("spec.sampler.tensorParallel: a ", "spec.sampler.tpu: no layout")), lines


# Rules with no published model that breaks them alone: LayoutFacts written here.
@pytest.mark.parametrize(
    ("facts", "tp", "ep", "expected"),
    [
        # 40 heads, 8 KV heads over 20 devices: 20 is not a multiple of 8 (VllmQKVParallelLinear.__init__:
        # "tp_size (20) must be divisible by total_num_kv_heads (8) for KV-head replication")
        (sampler_layout.LayoutFacts(40, (8,)), 20, 1, ["is not a multiple of the 8 KV heads"]),
        # 8 KV heads over 40 attention devices: 5 copies each, on the first axis at least 5 wide, the
        # tensor axis of 8, which does not split into 5 (VllmQKVParallelLinear.forward)
        (sampler_layout.LayoutFacts(40, (8,), experts=40), 8, 5, ["cannot hold the 5 copies"]),
        (sampler_layout.LayoutFacts(40, (8,), experts=40), 10, 4, []),  # the tensor axis holds 5 x 2
        # an expert MLP of 2880 over 64 devices at expertParallel 1 divides; over 128 it does not
        (
            sampler_layout.LayoutFacts(128, (8,), experts=128, expert_mlp=2880),
            128,
            1,
            ["2880-wide expert MLP"],
        ),
        # Gemma 4's global layers: 4 KV heads at tensor parallelism 8 are replicated, 16 split
        (sampler_layout.LayoutFacts(32, (16, 4)), 8, 1, []),
        (sampler_layout.LayoutFacts(32, (16, 3)), 8, 1, ["is not a multiple of the 3 KV heads"]),
    ],
)
def test_the_rules_without_a_published_case(
    facts: sampler_layout.LayoutFacts, tp: int, ep: int, expected: list[str]
) -> None:
    got = sampler_layout.model_problems(facts, "m", tp, ep)
    assert len(got) == len(expected), got
    for line, part in zip(got, expected, strict=True):
        assert part in line and line.startswith("spec.sampler."), line


def test_the_padding_of_an_expert_mlp_under_tensor_parallelism() -> None:
    f = sampler_layout.facts("qwen3.5-397b-a17b")
    assert f is not None and f.expert_mlp == 1024
    assert [sampler_layout.expert_padding(f, tp) for tp in (1, 4, 8, 16, 32)] == [1.0, 1.0, 1.0, 2.0, 4.0]
    assert sampler_layout.expert_padding(sampler_layout.LayoutFacts(32, (8,)), 16) == 1.0  # dense


# ------------------------------------------------------------------------------------ derivations


HELD_OUT = {
    "model": {"name": "Qwen/Qwen3.5-397B-A17B", "maxtextModel": "qwen3.5-397b-a17b"},
    "trainer": {"tpu": "tpu7x-256", "mesh": {"fsdp": 32, "expert": 2, "context": 4}},
}


def test_the_held_out_397b_manifest_on_a_32_device_sampler_is_refused_naming_the_slice_that_serves_it() -> (
    None
):
    """The design document's trainer mesh and a tpu7x-32 sampler, nothing else set: no layout of 32
    devices serves Qwen3.5-397B with LoRA on the pinned engine (16 gated delta net key heads), so the plan
    says which slice does instead of deriving a layout the engine refuses at start."""
    with pytest.raises(plan.PlanError) as e:
        _resolve(manifest({**HELD_OUT, "sampler": {"tpu": "tpu7x-32"}}))
    assert [p.split(":")[0] for p in e.value.problems] == ["spec.sampler.tensorParallel", "spec.sampler.tpu"]
    assert e.value.problems[1].endswith(
        "use a sampler slice of at most 16 devices per replica (tpu7x-16), and more replicas"
    )


def test_the_held_out_397b_manifest_on_a_16_device_sampler_validates_with_derived_values() -> None:
    run = _resolve(manifest({**HELD_OUT, "sampler": {"tpu": "tpu7x-16"}}))
    assert (run.sampler.tensor_parallel, run.sampler.expert_parallel, run.sampler.data_parallel) == (1, 16, 1)
    assert run.trainer.maxtext["context_parallel_load_balance"] is False
    assert run.trainer.maxtext_sources["context_parallel_load_balance"] == "derived"
    assert run.derived is not None
    assert sorted(run.derived) == [
        "spec.packing.maxSegmentsPerRow",
        "spec.sampler.expertParallel",
        "spec.sampler.tensorParallel",
        "spec.trainer.maxtext.context_parallel_load_balance",
        "spec.trainer.maxtext.weight_dtype",  # unset: bfloat16 (rljob.recipes.maxtext_keys.derived_keys)
    ]
    assert "pads to 128: 2x the expert weights" in run.derived["spec.sampler.expertParallel"]
    assert "context parallelism 4" in run.derived["spec.trainer.maxtext.context_parallel_load_balance"]
    text = explain(run)
    assert "  context_parallel_load_balance  False                    [derived]" in text
    assert (
        "  spec.sampler.expertParallel = 16 [derived]: tensorParallel 16 at expertParallel 1 would split"
        in text
    )
    assert (
        "  spec.trainer.maxtext.context_parallel_load_balance = False [derived]: the qwen3_5 decoder's gated "
        "delta net layers with context parallelism 4" in text
    )


@pytest.mark.parametrize(
    ("spec", "first"),
    [
        # set explicitly: never derived, refused naming the field
        (
            {"trainer": {"maxtext": {"context_parallel_load_balance": True}}, "sampler": {"tpu": "tpu7x-16"}},
            "spec.trainer.maxtext.context_parallel_load_balance: the qwen3_5 decoder's gated delta net "
            "layers with context parallelism 4 need context_parallel_load_balance=false",
        ),
        (
            {"sampler": {"tpu": "tpu7x-16", "tensorParallel": 16, "expertParallel": 2}},
            "spec.sampler.tensorParallel: 16 x dataParallel 1 x expertParallel 2 = 32 is not the 16 devices",
        ),
    ],
)
def test_an_explicit_value_that_cannot_work_is_refused(spec: dict[str, Any], first: str) -> None:
    doc = manifest(HELD_OUT)
    doc = manifest(spec, base=doc)
    with pytest.raises(plan.PlanError) as e:
        _resolve(doc)
    assert e.value.problems[0].startswith(first), e.value.problems


def test_an_explicit_layout_the_default_would_change_is_kept() -> None:
    """tensorParallel 16 at expertParallel 1 pads the experts, but the manifest chose it: it stays."""
    run = _resolve(manifest({**HELD_OUT, "sampler": {"tpu": "tpu7x-16", "tensorParallel": 16}}))
    assert (run.sampler.tensor_parallel, run.sampler.expert_parallel) == (16, 1)
    assert run.derived is not None and "spec.sampler.expertParallel" not in run.derived


def test_the_expert_parallelism_left_unset_beside_a_set_tensor_parallelism_is_derived() -> None:
    bf16 = {"maxtext": {"weight_dtype": "bfloat16"}}  # set: the trainer's weight_dtype is not derived
    run = _resolve(_sampler_manifest("gpt-oss-20b", {"tpu": "tpu7x-16", "tensorParallel": 2}, trainer=bf16))
    assert (run.sampler.tensor_parallel, run.sampler.expert_parallel) == (2, 8)
    assert run.derived == {
        "spec.sampler.expertParallel": "the default would not run on a tpu7x-16 replica: "
        "spec.sampler.tensorParallel: 2 x dataParallel 1 x expertParallel 1 = 2 is not the 16 devices of a "
        "tpu7x-16 sampler replica"
    }


def test_a_dense_model_nothing_is_derived() -> None:
    run = _resolve(manifest({"trainer": {"maxtext": {"weight_dtype": "bfloat16"}}}))
    assert run.derived is None and "derived" not in explain(run)
    assert "derived" not in run.model_dump_json(exclude_none=True)


def test_rljob_plan_shows_the_derived_values_of_the_held_out_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rljob.cli.main import main

    path = tmp_path / "q397.yaml"
    path.write_text(yaml.safe_dump(manifest({**HELD_OUT, "sampler": {"tpu": "tpu7x-16"}})))
    assert main(["validate", "-f", str(path)]) == 0
    capsys.readouterr()
    assert main(["plan", "-f", str(path)]) == 0
    out = capsys.readouterr().out
    derived = out[out.index("derived (5; unset, and the default would not run") :].splitlines()[1:]
    assert [line.split(" [derived]: ")[0] for line in derived] == [
        "  spec.packing.maxSegmentsPerRow = 1",
        "  spec.sampler.expertParallel = 16",
        "  spec.sampler.tensorParallel = 1",
        "  spec.trainer.maxtext.context_parallel_load_balance = False",
        "  spec.trainer.maxtext.weight_dtype = bfloat16",
    ]
    assert "replicas: 1, tensor x expert x data parallel 1 x 16 x 1" in out
    assert main(["plan", "-f", str(path), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["derived"]) == [line.split(" = ")[0].strip() for line in derived]
