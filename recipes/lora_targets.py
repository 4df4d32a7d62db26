"""LoRA targets: which projections of which MaxText decoder block the trainer can wrap and export.

One table for the plan (``rljob validate`` and the admission webhook refuse a manifest with these
problems) and the trainer (``rljob.trainer.model.ModelSpec`` / ``Policy`` refuse the same at start, with
the same field). ``spec.lora.targets`` names Hugging Face projections (``q_proj``...) or the MaxText
modules they map to (``query``...).

A target counts only where the decoder has a module of that name that qwix can wrap and whose adapter
the trainer exports to PEFT under the Hugging Face model's names:

- qwen3 (Qwen3ForCausalLM), gemma4 (Gemma4ForConditionalGeneration): attention and the dense MLP;
- qwen3_5 (Qwen3_5MoeForConditionalGeneration): attention (the full-attention layers; the gated delta
  net layers have no q/k/v/o projection) and the shared expert's MLP (``mlp.shared_expert.*_proj``);
  the routed experts are stacked parameters (MaxText ``routed_experts/wi_0``, Hugging Face
  ``mlp.experts.gate_up_proj``), not modules;
- gpt_oss (GptOssForCausalLM): attention only; its MLP is all experts, stacked parameters on both
  sides (MaxText ``GptOssMlp/wi_0``, Hugging Face ``mlp.experts.gate_up_proj``).

Sources: MaxText 0.2.5 models/{qwen3,qwen3_5,gpt_oss,gemma4}.py; transformers 5.x models/<family>/
modeling_<family>.py (https://github.com/huggingface/transformers/tree/main/src/transformers/models).
tests/trainer/test_families.py builds each family's miniature and checks this table against the LoRA
parameters qwix actually creates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "ATTENTION",
    "HF_TO_MAXTEXT",
    "MLP",
    "SUPPORTED",
    "decoder_block",
    "problems",
]

# Hugging Face projection -> MaxText module.
HF_TO_MAXTEXT: dict[str, str] = {
    "q_proj": "query",
    "k_proj": "key",
    "v_proj": "value",
    "o_proj": "out",
    "gate_proj": "wi_0",
    "up_proj": "wi_1",
    "down_proj": "wo",
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# decoder_block -> the Hugging Face projections the trainer wraps and exports.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "qwen3": ATTENTION + MLP,
    "gemma4": ATTENTION + MLP,
    "qwen3_5": ATTENTION + MLP,
    "gpt_oss": ATTENTION,
}

_MT_TO_HF = {mt: hf for hf, mt in HF_TO_MAXTEXT.items()}


def decoder_block(keys: Mapping[str, Any], model_config: Mapping[str, Any]) -> str:
    """The decoder block of a model: the job's ``decoder_block`` key, else its model config's."""
    block = keys.get("decoder_block", model_config.get("decoder_block", ""))
    return str(block).lower()


def problems(block: str | None, targets: Iterable[str]) -> list[tuple[str, str]]:
    """(field, message) for each reason the trainer would refuse these LoRA targets on a model with
    decoder block ``block`` (None: the block is not known, only the names are checked)."""
    targets = list(targets)
    out: list[tuple[str, str]] = []
    unknown = [t for t in targets if t not in HF_TO_MAXTEXT and t not in _MT_TO_HF]
    if unknown:
        out.append(
            (
                "spec.lora.targets",
                f"unknown module(s) {unknown}; known: {sorted(HF_TO_MAXTEXT)} or {sorted(_MT_TO_HF)}",
            )
        )
    if block is None:
        return out
    if block not in SUPPORTED:
        out.append(
            (
                "spec.model.maxtextModel",
                f"decoder block {block!r}: the trainer exports LoRA adapters of the decoder blocks "
                f"{', '.join(sorted(SUPPORTED))} only",
            )
        )
        return out
    hf = [_MT_TO_HF.get(t, t) for t in targets if t not in unknown]
    missing = sorted({t for t in hf if t not in SUPPORTED[block]})
    if missing:
        out.append(
            (
                "spec.lora.targets",
                f"{', '.join(missing)}: no such projection to wrap in the {block} decoder "
                f"(its LoRA targets: {', '.join(SUPPORTED[block])})",
            )
        )
    return out
