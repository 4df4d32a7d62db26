"""rljob.recipes.lora_targets: every decoder block of the pinned MaxText is either exported (SUPPORTED) or
refused with its reason (REFUSED), and `rljob validate`'s message carries that reason; a LoRA on the routed
experts, which the trainer trains (tests/trainer/test_expert_lora.py) but vLLM's TPU backend does not
serve, is refused by `rljob validate` with that reason, on one line naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from rljob.cli.main import main as rljob
from rljob.recipes import lora_targets


@pytest.mark.jax
def test_every_maxtext_decoder_block_is_exported_or_refused_with_a_reason() -> None:
    from maxtext.common.common_types import DecoderBlockType

    blocks = {b.value for b in DecoderBlockType}
    assert not set(lora_targets.SUPPORTED) & set(lora_targets.REFUSED)
    assert blocks - set(lora_targets.SUPPORTED) == set(lora_targets.REFUSED)


@pytest.mark.parametrize(
    ("block", "targets", "want"),
    [
        (
            "deepseek4",
            ["q_proj"],
            [
                (
                    "spec.model.maxtextModel",
                    "decoder block 'deepseek4': its attention (MLA with compressed KV) has no PEFT layout "
                    "exported yet; the trainer exports LoRA adapters of the decoder blocks deepseek, "
                    "gemma3, gemma4, gpt_oss, llama2, mixtral, qwen3, qwen3_5, qwen3_moe only",
                )
            ],
        ),
        ("deepseek", ["q_a_proj", "wq_b", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "down_proj"], []),
        (
            "deepseek",
            ["q_a_proj", "k_proj", "v_proj"],
            [
                (
                    "spec.lora.targets",
                    "k_proj, v_proj: no such projection to wrap in the deepseek decoder (its LoRA targets: "
                    "q_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, gate_proj, up_proj, "
                    "down_proj)",
                )
            ],
        ),
        ("llama2", ["q_proj", "down_proj", "wi_0"], []),
        (
            "qwen3_moe",
            ["q_proj", "gate_proj"],
            [
                (
                    "spec.lora.targets",
                    "gate_proj: no such projection to wrap in the qwen3_moe decoder (its LoRA targets: "
                    "q_proj, k_proj, v_proj, o_proj)",
                )
            ],
        ),
        ("gemma3", ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], []),
        (
            "mixtral",
            ["q_proj", "up_proj"],
            [
                (
                    "spec.lora.targets",
                    "up_proj: no such projection to wrap in the mixtral decoder (its LoRA targets: "
                    "q_proj, k_proj, v_proj, o_proj)",
                )
            ],
        ),
        # the routed experts: the trainer wraps them in the qwen3_moe and mixtral decoders only
        ("qwen3_moe", ["q_proj", "experts"], []),
        ("mixtral", ["experts"], []),
        (
            "gpt_oss",
            ["experts"],
            [
                (
                    "spec.lora.targets",
                    "experts: the trainer wraps and exports the routed experts of the mixtral, qwen3_moe "
                    "decoders only, not gpt_oss",
                )
            ],
        ),
        (
            "a_block_maxtext_lacks",
            ["q_proj"],
            [
                (
                    "spec.model.maxtextModel",
                    "decoder block 'a_block_maxtext_lacks': the trainer exports LoRA adapters of the decoder "
                    "blocks deepseek, gemma3, gemma4, gpt_oss, llama2, mixtral, qwen3, qwen3_5, qwen3_moe "
                    "only",
                )
            ],
        ),
    ],
)
def test_problems(block: str, targets: list[str], want: list[tuple[str, str]]) -> None:
    assert lora_targets.problems(block, targets) == want


@pytest.mark.parametrize(
    ("targets", "want"),
    [
        (["q_proj", "o_proj"], []),
        (["q_proj", "experts"], [("spec.lora.targets", f"experts: {lora_targets.SERVING_REFUSED}")]),
    ],
)
def test_the_sampler_refuses_expert_adapters_on_any_block(
    targets: list[str], want: list[tuple[str, str]]
) -> None:
    assert lora_targets.sampler_problems(None, targets) == want
    assert lora_targets.sampler_problems("qwen3_moe", targets) == want


def test_validate_refuses_an_expert_adapter_the_sampler_cannot_serve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job: dict[str, Any] = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "experts", "namespace": "default"},
        "spec": {
            "recipe": "qwen3-8b-v5p",
            "storage": {"root": "gs://rljob-test"},
            "model": {"maxtextModel": "qwen3-30b-a3b"},
            "lora": {"targets": ["q_proj", "experts"]},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert rljob(["validate", "-f", str(path)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "spec.lora.targets" in line]
    assert len(lines) == 1, lines
    assert (
        "experts: vLLM's TPU backend (vllm-tpu 0.32.0 with tpu-inference 0.32.0) does not serve LoRA"
        in lines[0]
    )
    assert (
        "https://github.com/vllm-project/tpu-inference/blob/main/tpu_inference/lora/torch_punica_tpu.py"
        in (lines[0])
    )
    # the same job with attention targets only validates
    job["spec"]["lora"]["targets"] = ["q_proj"]
    path.write_text(yaml.safe_dump(job))
    code = rljob(["validate", "-f", str(path)])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("targets", "q_lora_rank", "want"),
    [
        (["q_a_proj", "q_b_proj", "o_proj"], 1536, []),
        (["q_proj", "o_proj"], 0, []),
        (["q_proj", "o_proj"], None, []),
        (
            ["q_proj", "kv_a_proj_with_mqa"],
            1536,
            "q_proj: no such projection in this deepseek model's query: it has q_a_proj and q_b_proj "
            "(q_lora_rank 1536)",
        ),
        (
            ["wq_a", "q_b_proj"],
            0,
            "q_a_proj, q_b_proj: no such projection in this deepseek model's query: it has q_proj "
            "(q_lora_rank 0)",
        ),
    ],
)
def test_a_deepseek_query_projection_follows_q_lora_rank(
    targets: list[str], q_lora_rank: int | None, want: list[Any] | str
) -> None:
    """DeepSeek-V3's MLA query goes through a latent (q_a_proj, q_b_proj), DeepSeek-V2's through one
    q_proj (q_lora_rank 0): a target of the other kind wraps nothing."""
    got = lora_targets.mla_problems("deepseek", targets, q_lora_rank)
    assert got == ([("spec.lora.targets", want)] if isinstance(want, str) else [])
    assert lora_targets.mla_problems("qwen3", targets, q_lora_rank) == []


def test_the_sampler_refuses_deepseeks_kv_b_proj() -> None:
    """vLLM's MLA never applies a kv_b_proj adapter: the plan refuses it (the trainer exports it)."""
    assert lora_targets.problems("deepseek", ["kv_b_proj"]) == []
    got = lora_targets.sampler_problems("deepseek", ["q_a_proj", "wkv_b"])
    assert [(f, m.split(":")[0]) for f, m in got] == [("spec.lora.targets", "kv_b_proj")]
    assert "vllm-project/vllm/issues/48974" in got[0][1]
    assert lora_targets.sampler_problems("deepseek", ["q_a_proj", "kv_a_proj_with_mqa", "o_proj"]) == []


@pytest.mark.parametrize(
    ("model", "targets", "want"),
    [
        ("deepseek2-16b", ["q_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj"], []),
        ("deepseek2-16b", ["q_proj", "kv_b_proj"], ["kv_b_proj"]),
        ("deepseek2-16b", ["q_a_proj"], ["q_a_proj"]),
    ],
)
def test_validate_refuses_what_the_deepseek_sampler_or_model_lacks(
    model: str, targets: list[str], want: list[str]
) -> None:
    """The plan (rljob validate, the admission webhook) of a DeepSeek-V2-Lite job: MLA targets resolve;
    kv_b_proj (vLLM never applies it) and q_a_proj (V2-Lite's query has no latent) are refused by name,
    one line each under spec.lora.targets."""
    from fixtures.recipes import manifest, problems

    doc = manifest(
        {
            "model": {"name": "deepseek-ai/DeepSeek-V2-Lite", "maxtextModel": model},
            "lora": {"targets": targets},
        }
    )
    got = [p for p in problems(doc) if p.startswith("spec.lora.targets")]
    assert [p.removeprefix("spec.lora.targets: ").split(":")[0] for p in got] == want
