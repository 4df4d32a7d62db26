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
            "deepseek",
            ["q_proj"],
            [
                (
                    "spec.model.maxtextModel",
                    "decoder block 'deepseek': its multi-head latent attention (MLA: wq_a/wq_b, wkv_a/wkv_b) "
                    "has no PEFT layout exported yet; the trainer exports LoRA adapters of the decoder "
                    "blocks gemma3, gemma4, gpt_oss, llama2, mixtral, qwen3, qwen3_5, qwen3_moe only",
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
                    "blocks gemma3, gemma4, gpt_oss, llama2, mixtral, qwen3, qwen3_5, qwen3_moe only",
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
def test_serving_problems(targets: list[str], want: list[tuple[str, str]]) -> None:
    assert lora_targets.serving_problems(targets) == want


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
