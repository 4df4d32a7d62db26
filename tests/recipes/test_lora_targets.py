"""rljob.recipes.lora_targets: every decoder block of the pinned MaxText is either exported (SUPPORTED) or
refused with its reason (REFUSED), and `rljob validate`'s message carries that reason."""

from __future__ import annotations

import pytest
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
