"""Quantized sampler weights (rljob.recipes.quantization): the bytes the fit check counts, the refusals that
name spec.sampler.weights, the `vllm serve` flags, the parity gate's default, and the vendors' published
Qwen3.5-397B tpu7x-8 serving layout (Qwen/Qwen3.5-397B-A17B-FP8) validating."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.recipes import manifest, problems, resolve
from rljob.recipes import fit, generations, quantization, tpu
from rljob.sampler.vllm import build_command

TESTED_MODULES = ("rljob.recipes.generations",)

GIB = 2**30
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3.5-397b-tpu7x-fp8-sampler.yaml"
FP8_ID = "Qwen/Qwen3.5-397B-A17B-FP8"


def _example(**sampler: Any) -> dict[str, Any]:
    doc = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    doc["spec"]["sampler"].update(sampler)
    return dict(doc)


def test_fp8_bytes_of_qwen3_8b_by_hand() -> None:
    # Qwen3-8B (no experts, no gated delta net): the untied embedding and output head stay bf16, every
    # other counted weight (the linear projections) is one byte with a float32 scale per 128 x 128 block.
    emb, vocab = 4096, 151_936
    s = fit.shapes("qwen3-8b", {})
    assert s is not None
    p = fit.params(s)
    kept = 2 * vocab * emb
    assert fit.unquantized_params(s) == (kept, 0)
    quantized_attention = p.attention
    scales = -(-quantized_attention * 4 // (128 * 128))
    attention, mlp = fit.sampler_weight_bytes(s, quantization.get("fp8"))
    assert attention == kept * 2 + quantized_attention + scales
    assert mlp == p.dense_mlp + -(-p.dense_mlp * 4 // (128 * 128))
    # bf16: two bytes each, as before
    assert fit.sampler_weight_bytes(s, quantization.get("bfloat16")) == (
        (p.embedding + p.attention) * 2,
        p.dense_mlp * 2,
    )


def test_what_a_quantized_qwen3_5_keeps_in_bf16_by_hand() -> None:
    # Qwen3.5-397B-A17B: the embedding and output head, each gated delta net layer's in_proj_ba and
    # convolution, each MoE layer's router.
    s = fit.shapes("qwen3.5-397b-a17b", {})
    assert s is not None
    emb = 4096
    small_gdn = emb * 2 * 64 + (2 * 16 * 128 + 64 * 128) * 4
    assert fit.unquantized_params(s) == (2 * 248_320 * emb + 45 * small_gdn, 60 * emb * 512)


# Qwen3.5-397B-A17B on one tpu7x-8 replica (8 devices of 96 GiB), rank-32 LoRA, 2 slots: weights GiB per
# device, whether it fits, sequences of maxModelLen the KV cache holds.
@pytest.mark.parametrize(
    ("quant", "tp", "ep", "max_model_len", "max_num_seqs", "weights_gib", "fits", "sequences"),
    [
        ("bfloat16", 8, 1, 9216, 64, 92.28, False, 0),  # the 92.3 GiB: refused
        ("bfloat16", 1, 8, 9216, 64, 106.82, False, 0),
        ("fp8", 8, 1, 9216, 64, 46.41, True, 277),
        ("fp8", 1, 8, 9216, 64, 55.35, True, 87),  # the vendors' layout, experts over the 8 devices
        ("fp8", 1, 8, 65536, 256, 55.35, True, 15),  # the example: the recipe's rollout length
    ],
)
def test_fit_of_the_397b_on_a_tpu7x_8(
    quant: str,
    tp: int,
    ep: int,
    max_model_len: int,
    max_num_seqs: int,
    weights_gib: float,
    fits: bool,
    sequences: int,
) -> None:
    s = fit.shapes("qwen3.5-397b-a17b", {})
    assert s is not None
    f = fit.sampler_fit(
        s,
        tpu.hbm_bytes_per_device("tpu7x"),
        tp,
        ep,
        max_model_len,
        max_num_seqs,
        2,
        32,
        quantization.get(quant),
    )
    assert round(f.parts["weights"] / GIB, 2) == weights_gib
    assert (f.fits, f.kv_sequences) == (fits, sequences)


def test_the_vendor_layout_validates() -> None:
    rc = resolve(_example())
    assert (rc.sampler.tpu.type_name, rc.sampler.tensor_parallel, rc.sampler.expert_parallel) == (
        "tpu7x-8",
        1,
        8,
    )
    assert rc.sampler.quantization == "fp8"
    w = rc.spec.sampler.weights
    assert (w.quantization, w.name, w.revision, w.parity_tolerance) == (
        "fp8",
        FP8_ID,
        "main",
        quantization.QUANTIZED_PARITY_NATS,
    )
    assert rc.spec.model.name == "Qwen/Qwen3.5-397B-A17B"  # the trainer trains the bf16 base
    sampler = fit.of_run(rc).sampler
    assert sampler is not None and sampler.fits
    # the vendors' own serving numbers (--max-model-len 9216, --max-num-seqs 64), with rollouts that fit them
    doc = _example(maxModelLen=9216, maxNumSeqs=64)
    doc["spec"]["algorithm"] = {"maxTokens": 9216 - 4096}
    assert problems(doc) == []


def test_the_same_layout_in_bf16_is_refused_with_the_quantization_that_serves_it() -> None:
    doc = _example(weights=None)
    del doc["spec"]["sampler"]["weights"]
    found = [p for p in problems(doc) if p.startswith("spec.sampler.tpu:")]
    assert len(found) == 1
    assert "55.4 GiB" not in found[0] and "106.8 GiB of bfloat16 weights" in found[0]
    assert (
        "at spec.sampler.weights.quantization fp8 (the model's fp8 checkpoint) this replica serves it"
        in found[0]
    )


@pytest.mark.parametrize(
    ("sampler", "line"),
    [
        (
            {"weights": {"quantization": "fp8"}},
            "spec.sampler.weights.name: required with quantization fp8: the Hugging Face id of "
            "Qwen/Qwen3.5-397B-A17B's fp8 checkpoint (e.g. Qwen/Qwen3.5-397B-A17B-FP8)",
        ),
        (
            {"weights": {"name": FP8_ID}},
            "spec.sampler.weights.name: Qwen/Qwen3.5-397B-A17B-FP8 is not spec.model.name "
            "(Qwen/Qwen3.5-397B-A17B); at quantization bfloat16 the sampler serves the weights the trainer "
            "trains (set quantization to the checkpoint's, or remove name)",
        ),
        (
            {"tpu": "v5p-8", "tensorParallel": 2, "expertParallel": 2},
            "spec.sampler.weights.quantization: fp8 is not served on v5p by vLLM's TPU backend "
            "(tpu-inference's quantization table lists it for v7 only: tpu7x sampler slices); serve "
            "bfloat16 or use a tpu7x sampler",
        ),
    ],
)
def test_refusals_name_the_field(sampler: dict[str, Any], line: str) -> None:
    doc = _example()
    for k, v in sampler.items():
        if k == "weights":
            doc["spec"]["sampler"]["weights"] = v
        else:
            doc["spec"]["sampler"][k] = v
    assert line in problems(doc)


def test_int8_is_served_on_v5_and_v6_only() -> None:
    where = {
        g.prefix
        for g in generations.GENERATIONS.values()
        if quantization.served_on(quantization.get("int8"), g)
    }
    assert where == {"v5p", "v5litepod", "v6e"}
    assert all(quantization.served_on(quantization.get(None), g) for g in generations.GENERATIONS.values())


def test_a_quantization_whose_engine_refuses_lora_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    row = dataclasses.replace(quantization.QUANTIZATIONS["fp8"], lora_refused="the engine's reason")
    monkeypatch.setitem(quantization.QUANTIZATIONS, "fp8", row)
    assert (
        "spec.sampler.weights.quantization: fp8: vLLM's TPU backend serves no LoRA on it: the engine's reason"
        in problems(_example())
    )


def test_the_sampler_serves_the_quantized_checkpoint_with_its_method() -> None:
    argv = build_command(resolve(_example())).argv
    assert argv[2:5] == [FP8_ID, "--revision", "main"]
    assert argv[argv.index("--quantization") + 1] == "fp8"
    # the API name stays spec.model.name, which the trainer asks for
    assert argv[argv.index("--served-model-name") + 1] == "Qwen/Qwen3.5-397B-A17B"
    assert "--enable-lora" in argv
    # every flag is an option of the pinned vllm-tpu's `vllm serve` (tests/sampler/data, extracted from it)
    known = json.loads(
        (Path(__file__).parents[1] / "sampler" / "data" / "vllm-tpu-0.32.0-serve-args.json").read_text()
    )
    assert {a for a in argv[3:] if a.startswith("--")} <= set(known["options"])


def test_bf16_serves_the_model_itself_without_a_quantization_flag() -> None:
    rc = resolve(manifest())
    argv = build_command(rc).argv
    assert argv[2] == rc.spec.model.name == rc.spec.sampler.weights.name
    assert argv[argv.index("--revision") + 1] == rc.spec.model.revision
    assert "--quantization" not in argv
    assert rc.spec.sampler.weights.parity_tolerance == quantization.BF16_PARITY_NATS


def test_a_set_parity_tolerance_is_kept() -> None:
    doc = _example()
    doc["spec"]["sampler"]["weights"]["parityTolerance"] = 0.02
    assert resolve(doc).spec.sampler.weights.parity_tolerance == 0.02


def test_the_fp8_scales_are_one_float32_per_block() -> None:
    assert quantization.get("fp8").scale_bytes == Fraction(4, 16384)
