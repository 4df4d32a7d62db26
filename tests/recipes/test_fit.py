"""The plan's fit check (rljob.recipes.fit): parameter counts against published sizes and a hand count,
the refusal of a model too big for its slices (both roles, fields named, a slice that fits computed), every
catalog recipe, profile and example still accepted, and properties: it never raises on any model config
override, and more devices never turn a fitting role into one that does not fit."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from rljob.recipes import fit, maxtext_keys, plan, recipe_catalog, tpu

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30

# Published total parameter counts (model cards on Hugging Face), in billions; the count by shapes leaves
# out norms, biases and (Qwen3.5) the vision encoder, so it must land within TOLERANCE of them.
TOLERANCE = 0.015
PUBLISHED = [
    ("qwen3-8b", 8.2),  # Qwen/Qwen3-8B: "Number of Parameters: 8.2B"
    ("qwen3-0.6b", 0.6),  # Qwen/Qwen3-0.6B: 0.6B (with tied embeddings)
    ("qwen3-30b-a3b", 30.5),  # Qwen/Qwen3-30B-A3B: 30.5B in total
    ("qwen3-235b-a22b", 235.0),  # Qwen/Qwen3-235B-A22B: 235B
    ("gpt-oss-20b", 20.9),  # openai/gpt-oss-20b model card: 21B (20.9B)
    ("gpt-oss-120b", 116.8),  # openai/gpt-oss-120b model card: 117B (116.8B)
    ("qwen3.5-397b-a17b", 397.0),  # Qwen/Qwen3.5-397B-A17B: 397B
    ("deepseek3-671b", 671.0),  # deepseek-ai/DeepSeek-V3: 671B
    ("llama3.1-8b", 8.03),  # meta-llama/Llama-3.1-8B: 8.03B
    ("llama3.1-70b", 70.6),  # meta-llama/Llama-3.1-70B: 70.6B
    ("mixtral-8x7b", 46.7),  # mistralai/Mixtral-8x7B: 46.7B
]


@pytest.mark.parametrize(("model", "billions"), PUBLISHED)
def test_the_count_by_shapes_matches_the_published_size(model: str, billions: float) -> None:
    shapes = fit.shapes(model, {})
    assert shapes is not None
    total = fit.params(shapes).total / 1e9
    assert abs(total - billions) <= TOLERANCE * billions, (model, total, billions)


def test_qwen3_8b_counts_exactly_as_by_hand() -> None:
    # Qwen3-8B: emb 4096, 36 layers, 32 query / 8 KV heads of 128, gated MLP 12288, vocab 151936 untied.
    emb, layers, vocab = 4096, 36, 151_936
    attention = emb * 32 * 128 + 2 * emb * 8 * 128 + 32 * 128 * emb
    mlp = 3 * emb * 12_288
    by_hand = 2 * vocab * emb + layers * (attention + mlp)
    shapes = fit.shapes("qwen3-8b", {})
    assert shapes is not None
    assert fit.params(shapes).total == by_hand == 8_190_427_136
    # The checkpoint's exact count, 8,190,735,360 (model.safetensors.index.json of Qwen/Qwen3-8B), adds
    # the RMSNorm scales the count by shapes leaves out: 36 x (2 x 4096 + 2 x 128 q/k norms) + 4096.
    assert by_hand + 36 * (2 * 4096 + 2 * 128) + 4096 == 8_190_735_360
    # rank-16 LoRA on every projection: r x (in + out) per projection and layer
    per_layer = (emb + 4096) + 2 * (emb + 1024) + (4096 + emb) + 2 * (emb + 12_288) + (12_288 + emb)
    assert fit.lora_params(
        shapes, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ) == (16 * layers * per_layer)


def test_an_expert_lora_counts_a_factor_pair_per_expert_projection_by_hand() -> None:
    # Qwen3-30B-A3B: 48 MoE layers of 128 experts, emb 2048, expert width 768; rank 8 on the experts:
    # r x (in + out) for gate, up and down of each expert and layer
    shapes = fit.shapes("qwen3-30b-a3b", {})
    assert shapes is not None
    assert (shapes.moe_layers(), shapes.experts, shapes.emb, shapes.moe_mlp) == (48, 128, 2048, 768)
    attention = fit.lora_params(shapes, 8, ["q_proj"])
    assert fit.lora_params(shapes, 8, ["q_proj", "experts"]) - attention == 8 * 48 * 128 * 3 * (2048 + 768)


def test_qwen3_5_counts_its_gated_delta_net_layers_and_experts_by_hand() -> None:
    shapes = fit.shapes("qwen3.5-397b-a17b", {})
    assert shapes is not None
    assert (shapes.attention_layers, shapes.gdn_layers, shapes.moe_layers()) == (15, 45, 60)
    p = fit.params(shapes)
    emb = 4096
    assert p.experts == 60 * (512 * 3 * emb * 1024 + emb * 512)
    gdn = emb * (2 * 16 * 128 + 2 * 64 * 128) + emb * 2 * 64 + (2 * 16 * 128 + 64 * 128) * 4 + 64 * 128 * emb
    gated_attention = emb * (2 * 32 * 256 + 2 * 2 * 256) + 32 * 256 * emb
    assert p.attention == 45 * gdn + 15 * gated_attention
    # bf16 weights: about 739 GiB
    assert 735 * GIB < p.total * 2 < 742 * GIB


def test_a_model_config_override_changes_the_count() -> None:
    base = fit.shapes("qwen3-8b", {})
    smaller = fit.shapes("qwen3-8b", {"base_num_decoder_layers": 18})
    assert base is not None and smaller is not None
    assert fit.params(smaller).total < fit.params(base).total


def test_hbm_per_device_of_each_generation() -> None:
    assert tpu.hbm_bytes_per_device("tpu-v5p-slice") == 95 * GIB
    assert tpu.hbm_bytes_per_device("tpu7x") == 96 * GIB  # 192 GiB per chip, two devices


def _job(spec: dict[str, Any]) -> Any:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "fit"},
        "spec": {"storage": {"root": "gs://bkt/runs"}, **spec},
    }
    return plan.parse_manifest(yaml.safe_dump(doc))


def _problems(spec: dict[str, Any]) -> list[str]:
    try:
        plan.resolve(_job(spec))
    except plan.PlanError as e:
        return e.problems
    return []


QWEN35 = {"name": "Qwen/Qwen3.5-397B-A17B"}

# (spec, expected line prefixes, expected fragments): the too-big cases name the field and a size that fits.
REFUSED = [
    (
        {"model": QWEN35, "trainer": {"tpu": "v5p-8"}, "sampler": {"tpu": "v5p-8"}},
        ["spec.trainer.tpu: v5p-8 x 1 slice(s) cannot hold", "spec.sampler.tpu: a v5p-8 replica"],
        # weight_dtype unset: derived bfloat16 (MaxText's float32 does not run under the LoRA's layer scan)
        ["the smallest v5p slice that holds it with every device on fsdp is v5p-32", "is v5p-32 as"],
    ),
    (  # bf16 weights halve the trainer's slice; a valid sampler layout is still too small
        {
            "model": QWEN35,
            "trainer": {"tpu": "v5p-8", "maxtext": {"weight_dtype": "bfloat16"}},
            "sampler": {"tpu": "v5p-8", "tensorParallel": 2, "expertParallel": 2},
        },
        [
            "spec.trainer.tpu: v5p-8",
            "spec.sampler.tpu: a v5p-8 replica (tensorParallel 2 x expertParallel 2)",
        ],
        ["is v5p-32", "is v5p-32 as tensorParallel 2 x expertParallel 8"],
    ),
    (  # tpu7x: 96 GiB per device
        {
            "model": QWEN35,
            "trainer": {"tpu": "tpu7x-8", "maxtext": {"weight_dtype": "bfloat16"}},
            "sampler": {"tpu": "tpu7x-8", "tensorParallel": 2, "expertParallel": 4},
        },
        ["spec.trainer.tpu: tpu7x-8", "spec.sampler.tpu: a tpu7x-8 replica"],
        ["tpu7x slice that holds it", "tpu7x replica that serves it"],
    ),
]


@pytest.mark.parametrize(("spec", "prefixes", "fragments"), REFUSED)
def test_a_model_too_big_for_its_slices_is_refused_on_each_role(
    spec: dict[str, Any], prefixes: list[str], fragments: list[str]
) -> None:
    problems = _problems(spec)
    for prefix, fragment in zip(prefixes, fragments, strict=True):
        lines = [p for p in problems if p.startswith(prefix)]
        assert len(lines) == 1, (prefix, problems)
        assert fragment in lines[0], (fragment, lines[0])


def test_a_micro_batch_too_large_for_the_slice_is_refused_with_the_most_rows_that_fit() -> None:
    # Qwen3-8B on v5p-8 (fsdp 4): a row of 5120 tokens puts 1280 tokens on each device, whose 36 layer
    # inputs take 36 x 1280 x 4096 x 2 bytes; beside the 3.8 GiB of weights and the LoRA state,
    # (85.5 GiB - fixed) / that per row, rounded down to a multiple of data x fsdp x expert = 4.
    spec = {"recipe": "qwen3-8b-v5p", "trainer": {"microBatchSize": 400}}
    run = plan.resolve(_job({"recipe": "qwen3-8b-v5p"}))
    ok = fit.of_run(run).trainer
    assert ok is not None
    per_row = 36 * 1280 * 4096 * 2
    assert ok.parts["layer_inputs"] == 4 * per_row
    most = (ok.capacity_bytes - (ok.used_bytes - ok.parts["layer_inputs"])) // per_row // 4 * 4
    lines = [p for p in _problems(spec) if p.startswith("spec.trainer.")]
    assert len(lines) == 1 and lines[0].startswith("spec.trainer.microBatchSize: 400 rows of 5120 tokens"), (
        lines
    )
    assert lines[0].endswith(f"at most {most} rows fit (a multiple of data x fsdp x expert = 4)")
    assert not [
        p for p in _problems({**spec, "trainer": {"microBatchSize": most}}) if p.startswith("spec.trainer.")
    ]
    assert [
        p
        for p in _problems({**spec, "trainer": {"microBatchSize": most + 4}})
        if p.startswith("spec.trainer.")
    ]


def test_the_suggested_slice_fits_and_the_next_smaller_does_not() -> None:
    spec = {"model": QWEN35, "trainer": {"tpu": "v5p-8"}, "sampler": {"tpu": "v5p-8"}}
    # weight_dtype unset: derived bfloat16, so v5p-32 holds the weights and v5p-16 does not.
    assert not [
        p for p in _problems({**spec, "trainer": {"tpu": "v5p-32"}}) if p.startswith("spec.trainer.tpu")
    ]
    assert [p for p in _problems({**spec, "trainer": {"tpu": "v5p-16"}}) if p.startswith("spec.trainer.tpu")]
    fits = {**spec, "sampler": {"tpu": "v5p-32", "tensorParallel": 2, "expertParallel": 8}}
    assert not [p for p in _problems(fits) if p.startswith("spec.sampler.tpu")]
    small = {**spec, "sampler": {"tpu": "v5p-16", "tensorParallel": 2, "expertParallel": 4}}
    assert [p for p in _problems(small) if p.startswith("spec.sampler.tpu")]


def _catalog() -> list[tuple[str, Any]]:
    out = [(f.name, plan.parse_manifest(f.read_text())) for f in sorted((REPO / "examples").glob("*.yaml"))]
    for name in recipe_catalog.names():
        for profile in [None, *recipe_catalog.load(name).profiles]:
            spec: dict[str, Any] = {"recipe": name}
            if profile:
                spec["trainer"] = {"profile": profile}
            out.append((f"{name}/{profile}", _job(spec)))
    return out


@pytest.mark.parametrize(("name", "job"), _catalog(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_catalog_recipe_profile_and_example_fits(name: str, job: Any) -> None:
    run = plan.resolve(job)
    result = fit.of_run(run)
    assert result.problems == []
    assert result.trainer is not None and result.sampler is not None
    assert 0 < result.trainer.used_bytes <= result.trainer.capacity_bytes
    assert result.sampler.kv_sequences is not None and result.sampler.kv_sequences >= 1
    lines = fit.summary(result, run.sampler)
    assert lines[0].startswith("trainer fit: ") and lines[1].startswith("sampler fit: ")


def test_the_397b_recipe_figures() -> None:
    run = plan.resolve(_job({"recipe": "qwen3.5-397b-a17b-tpu7x"}))
    result = fit.of_run(run)
    assert result.trainer is not None and result.sampler is not None
    shapes = fit.shapes("qwen3.5-397b-a17b", {})
    assert shapes is not None
    # 396.35e9 bf16 parameters over fsdp 16 x expert 2 x context 8 = 256 shards
    assert result.trainer.parts["weights"] == -(-fit.params(shapes).total * 2 // 256)
    # each decoder layer's input on device: 60 layers x 32 rows x 65536 tokens / 256 devices x 4096 x bf16
    assert result.trainer.parts["layer_inputs"] == 60 * 8_192 * 4096 * 2
    # 15 full-attention layers x 1 KV head per device (tp 2 over 2 heads) x 256 x K and V x bf16
    assert fit.kv_bytes_per_token(shapes, 2) == 15 * 2 * 1 * 256 * 2
    assert result.sampler.kv_sequences is not None
    assert 1 <= result.sampler.kv_sequences < run.sampler.max_num_seqs


def test_the_check_takes_milliseconds() -> None:
    job = _job({"model": QWEN35, "trainer": {"tpu": "v5p-8"}, "sampler": {"tpu": "v5p-8"}})
    run = plan.resolve(_job({"recipe": "qwen3.5-397b-a17b-tpu7x"}))
    start = time.perf_counter()
    for _ in range(10):
        fit.of_run(run)
    with pytest.raises(plan.PlanError):
        plan.resolve(job)  # the refusal computes the hints: every slice size of v5p
    assert time.perf_counter() - start < 5.0  # generous: a loaded 2-core machine


# --------------------------------------------------------------------------------------------- properties

MODELS = sorted(maxtext_keys.load(maxtext_keys.DEFAULT_VERSION).models)


@pytest.mark.parametrize("model", MODELS)
def test_every_model_has_its_shapes(model: str) -> None:
    shapes = fit.shapes(model, {})
    assert shapes is not None
    assert shapes.layers >= 1 and shapes.emb >= 1


SHAPE_KEYS = [
    "base_emb_dim",
    "base_mlp_dim",
    "base_moe_mlp_dim",
    "base_num_decoder_layers",
    "base_num_kv_heads",
    "base_num_query_heads",
    "head_dim",
    "num_experts",
    "shared_experts",
    "first_num_dense_layers",
    "interleave_moe_layer_step",
    "inhomogeneous_layer_cycle_interval",
    "vocab_size",
    "kv_lora_rank",
    "gdn_num_value_heads",
    "weight_dtype",
    "dtype",
    "decoder_block",
    "mlp_activations",
]
VALUES = st.one_of(
    st.integers(min_value=-(10**6), max_value=10**30),
    st.sampled_from(["bfloat16", "float32", "fp8", "qwen3_5", "deepseek", "gemma4", "x", "", "1e400", "nan"]),
    st.lists(st.sampled_from(["silu", "linear"]), max_size=3),
    st.none(),
    st.floats(allow_nan=True),
)


@settings(max_examples=200, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    keys=st.dictionaries(st.sampled_from(SHAPE_KEYS), VALUES, max_size=5),
    hbm=st.integers(min_value=1, max_value=200 * GIB),
    tp=st.integers(min_value=1, max_value=64),
    ep=st.integers(min_value=1, max_value=64),
    length=st.integers(min_value=128, max_value=1 << 22),
    seqs=st.integers(min_value=1, max_value=1 << 16),
    rank=st.sampled_from([1, 8, 16, 512]),
)
def test_the_check_never_raises(
    model: str, keys: dict[str, Any], hbm: int, tp: int, ep: int, length: int, seqs: int, rank: int
) -> None:
    shapes = fit.shapes(model, keys)
    if shapes is None:
        # only a key that leaves the model without layers or a width takes its shapes away
        assert {"num_decoder_layers", "base_num_decoder_layers", "base_emb_dim"} & set(keys), keys
        return
    fit.params(shapes)
    t = fit.trainer_fit(shapes, keys, hbm, tp * ep, tp * ep, 8192.0, rank, ["q_proj", "down_proj"])
    s = fit.sampler_fit(shapes, hbm, tp, ep, length, seqs, 4, rank)
    fit.summary(fit.Fit(t, s, []))


@settings(max_examples=200, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    generation=st.sampled_from(["v5p", "tpu7x"]),
    sizes=st.lists(st.integers(min_value=0, max_value=60), min_size=2, max_size=2, unique=True),
    tokens=st.sampled_from([1024.0, 8192.0, 65536.0]),
    rank=st.sampled_from([8, 64, 512]),
    weight_dtype=st.sampled_from(["bfloat16", "float32"]),
)
def test_more_devices_never_make_a_fitting_trainer_not_fit(
    model: str, generation: str, sizes: list[int], tokens: float, rank: int, weight_dtype: str
) -> None:
    shapes = fit.shapes(model, {})
    assert shapes is not None  # every MaxText model has its shapes (test_every_model_has_its_shapes)
    names = fit._slice_sizes(generation)  # the slice sizes the hints walk
    small, large = (names[min(i, len(names) - 1)][1] for i in sorted(sizes))
    hbm = tpu.hbm_bytes_per_device(tpu.GENERATIONS[generation].accelerator)
    keys = {"weight_dtype": weight_dtype}
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    a = fit.trainer_fit(shapes, keys, hbm, small, small, tokens, rank, targets)
    b = fit.trainer_fit(shapes, keys, hbm, large, large, tokens, rank, targets)
    assert b.used_bytes <= a.used_bytes
    assert b.fits or not a.fits


@settings(max_examples=200, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    tp=st.sampled_from([1, 2, 4, 8]),
    ep=st.sampled_from([1, 2, 4, 8]),
    more_tp=st.sampled_from([1, 2]),
    more_ep=st.sampled_from([1, 2, 4]),
    length=st.sampled_from([1024, 32768, 262144]),
)
def test_more_devices_never_make_a_fitting_sampler_not_fit(
    model: str, tp: int, ep: int, more_tp: int, more_ep: int, length: int
) -> None:
    shapes = fit.shapes(model, {})
    assert shapes is not None, model  # a catalog model's own config always has its shapes
    hbm = 95 * GIB
    a = fit.sampler_fit(shapes, hbm, tp, ep, length, 256, 2, 16)
    b = fit.sampler_fit(shapes, hbm, tp * more_tp, ep * more_ep, length, 256, 2, 16)
    assert b.parts["weights"] <= a.parts["weights"]
    assert (b.kv_sequences or 0) >= (a.kv_sequences or 0)
    assert b.fits or not a.fits


@settings(max_examples=40, deadline=None)
@given(
    model=st.sampled_from(
        ["Qwen/Qwen3-8B", "openai/gpt-oss-20b", "Qwen/Qwen3.5-397B-A17B", "google/gemma-4-31b"]
    ),
    sizes=st.lists(
        st.sampled_from(["v5p-8", "v5p-16", "v5p-32", "v5p-64", "v5p-128", "v5p-256"]), min_size=2, max_size=2
    ),
)
def test_a_larger_trainer_slice_of_a_plan_never_turns_a_fit_into_a_refusal(
    model: str, sizes: list[str]
) -> None:
    small, large = sorted(sizes, key=lambda n: int(n.split("-")[1]))
    maxtext_model = {"google/gemma-4-31b": "gemma4-31b"}.get(model)
    spec_model = {"name": model, **({"maxtextModel": maxtext_model} if maxtext_model else {})}

    def refused(size: str) -> bool:
        spec = {
            "model": spec_model,
            "trainer": {"tpu": size, "maxtext": {"weight_dtype": "bfloat16"}},
            "sampler": {"tpu": "v5p-8"},
        }
        return any(p.startswith("spec.trainer.tpu:") for p in _problems(spec))

    assert refused(large) <= refused(small)
