"""The sampler's weights: the bfloat16 weights of spec.model.name, or a quantized checkpoint of the same
model, as vLLM's TPU backend serves them. One row per quantization the manifest may name
(``spec.sampler.weights.quantization``); the plan (its checks), the fit check (the bytes of a weight), the
sampler's ``vllm serve`` flags (rljob.sampler.vllm) and the trainer's step-0 parity gate (its default
tolerance) read this table, no table of their own.

Sources: the pinned engine, vllm-tpu 0.32.0 and tpu-inference 0.32.0 (pyproject's ``sampler-tpu`` extra;
tpu_inference/... paths are those of https://pypi.org/project/tpu-inference/0.32.0/, vllm/... those of
https://pypi.org/project/vllm-tpu/0.32.0/):

- what it loads: ``get_tpu_quantization_config`` (tpu_inference/layers/vllm/quantization/__init__.py) maps
  the checkpoint's ``quantization_config.quant_method`` to its own configs (``fp8``: ``VllmFp8Config``;
  ``compressed-tensors``: ``VllmCompressedTensorsConfig``, whose W8A8 INT8 and FP8 schemes it implements)
  and refuses any other method; ``--quantization`` names the method, and vLLM refuses a checkpoint whose
  ``quantization_config`` names another (``ModelConfig._verify_quantization``);
- on which TPU generation: the engine's quantization table (docs/includes/quantization.md of
  https://github.com/vllm-project/tpu-inference, "Supported Hardware Acceleration"): FP8 W8A8 / W8A16 on
  v7; INT8 W8A8 on v5 and v6 (the generations with FP8, respectively INT8, matrix units). The engine's code
  does not itself refuse a method on another generation; rljob serves a quantization only where the table
  lists it (rljob.recipes.generations ``vllm_quantization_name`` names each generation as the table does);
- LoRA on a quantized base: vLLM's LoRA layers wrap the base layer and add the adapter's output to what the
  base layer's quantization method computes (vllm/lora/layers/base_linear.py,
  ``BaseLinearLayerWithLoRA._apply_sync``), with the adapter in the model's dtype; tpu-inference's FP8 and
  compressed-tensors linear methods put the processed ``weight`` back on the layer
  (``VllmFp8LinearMethod.process_weights_after_loading``; compressed_tensors_w8a8_int8.py, the same),
  which the LoRA wrappers read for their device (vllm/lora/layers/utils.py ``_get_lora_device``), and shard
  the adapter slots whatever the base's method (tpu_inference/layers/vllm/process_weights/
  cleanup_sharding.py). Nothing in the pinned engine refuses LoRA on either; no rljob test has run it on a
  chip. A row whose engine refuses LoRA names the reason in ``lora_refused`` and the plan refuses it.

What stays bfloat16 in a quantized checkpoint (and is counted at 2 bytes by rljob.recipes.fit): the token
embedding and the output head, the MoE routers, the gated delta net layers' small ``in_proj_ba`` and
convolution, and every norm: Qwen's FP8 checkpoints leave them out of the quantization
(``modules_to_not_convert`` in the quantization_config of e.g.
https://huggingface.co/Qwen/Qwen3.5-397B-A17B-FP8); the linear projections of attention, gated delta net
(qkvz and out), dense MLPs, shared and routed experts are quantized, with one float32 scale per 128 x 128
block for FP8 (``weight_block_size``).

Same weights (docs/fit.md, "Quantized sampler weights"): a quantized checkpoint is a rounding of the
trainer's base, not the base. The trainer keeps training the bfloat16 base of spec.model.name; the
sampler serves spec.sampler.weights.name, which the manifest declares to be a quantization of that model.
rljob cannot read the hub at validate, so the declaration is checked at start: vLLM refuses a checkpoint of
another method, and the step-0 parity gate compares the trainer's log-probs with the sampler's at the
quantization's wider tolerance (``parity_tolerance``, spec.sampler.weights.parityTolerance), which a
checkpoint of another model does not pass. The loss's importance ratio (trainer log-prob over the
sampler's, rljob.trainer.losses) is the correction for sampling from the quantized policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from rljob.recipes import generations

BFLOAT16 = "bfloat16"
_FIELD = "spec.sampler.weights"


@dataclass(frozen=True)
class Quantization:
    """One way the sampler's weights may be stored, as vLLM's TPU backend serves it."""

    name: str  # the manifest's value (spec.sampler.weights.quantization)
    vllm_method: str | None  # vLLM --quantization (the checkpoint's quant_method); None: unquantized
    weight_bytes: int  # bytes of one quantized weight
    scale_bytes: Fraction  # bytes of scales per quantized weight
    generations: tuple[str, ...]  # the engine's table's generation names; () for every generation
    parity_tolerance: float  # the step-0 parity gate's default bound (mean |log-prob difference|, nats)
    lora_refused: str | None = None  # the engine's reason where it refuses LoRA on this base
    example: str = ""  # a published checkpoint of this kind (the refusal lines name it)


# The step-0 parity gate on the same bfloat16 weights. Measured on a TPU v5e chip (hack/tpu/vllm_chip.py:
# vLLM's TPU engine, vllm-tpu 0.32.0, against the trainer, full-size Qwen3-0.6B in bf16, 8 x 512 tokens):
# mean |difference| 0.040 nats on the base, 0.045 with a rank-16 adapter (largest 0.19 / 0.22): two bf16
# programs of 28 layers round differently. The old bound, 1e-3 (float32 on CPU gives ~1e-6), would have
# refused every bf16 run on a TPU at step 0. 0.1 passes that noise with a margin and still refuses what the
# gate is for: weights of another model or revision, or an adapter not loaded, move log-probs by nats
# (0.72 nats was seen when a sampler read another run's state; docs/drill.md).
BF16_PARITY_NATS = 0.1
# The gate against a quantized sampler: a bound chosen, not measured (no quantized checkpoint has been served
# by rljob on a chip): the bf16 noise above plus FP8 or INT8 rounding of the weights, which moves a token's
# log-prob by hundredths of a nat on average; a checkpoint of another model, a wrong revision or a broken
# load moves it by nats. The gate reports the difference it sees (event "parity");
# spec.sampler.weights.parityTolerance sets another bound.
QUANTIZED_PARITY_NATS = 0.2

QUANTIZATIONS: dict[str, Quantization] = {
    q.name: q
    for q in (
        Quantization(BFLOAT16, None, 2, Fraction(0), (), BF16_PARITY_NATS),
        Quantization(
            "fp8",
            "fp8",
            1,
            Fraction(4, 128 * 128),
            ("v7",),
            QUANTIZED_PARITY_NATS,
            example="Qwen/Qwen3.5-397B-A17B-FP8",
        ),
        Quantization(
            "int8",
            "compressed-tensors",
            1,
            Fraction(0),  # one scale per output channel: well under 0.1% of the weights
            ("v5", "v6"),
            QUANTIZED_PARITY_NATS,
            example="a W8A8 INT8 checkpoint in the compressed-tensors format",
        ),
    )
}


def get(name: str | None) -> Quantization:
    """The row of a quantization name (None: bfloat16)."""
    return QUANTIZATIONS[name or BFLOAT16]


def served_on(q: Quantization, generation: generations.Generation) -> bool:
    """Whether vLLM's TPU backend serves ``q`` on ``generation`` (its quantization table)."""
    return not q.generations or generation.vllm_quantization_name in q.generations


def problems(
    quantization: str | None,
    name: str | None,
    model: str | None,
    generation: generations.Generation | None,
) -> list[str]:
    """What the plan refuses of spec.sampler.weights: ``quantization`` and the checkpoint ``name`` it set,
    ``model`` spec.model.name, ``generation`` the sampler slice's (None: unknown, not checked)."""
    q = get(quantization)
    out = []
    if q.vllm_method is None and name is not None and name != model:
        out.append(
            f"{_FIELD}.name: {name} is not spec.model.name ({model}); at quantization {BFLOAT16} the sampler "
            "serves the weights the trainer trains (set quantization to the checkpoint's, or remove name)"
        )
    if q.vllm_method is not None and name is None:
        out.append(
            f"{_FIELD}.name: required with quantization {q.name}: the Hugging Face id of {model}'s {q.name} "
            f"checkpoint (e.g. {q.example})"
        )
    if generation is not None and not served_on(q, generation):
        where = [g.prefix for g in generations.GENERATIONS.values() if served_on(q, g)]
        out.append(
            f"{_FIELD}.quantization: {q.name} is not served on {generation.prefix} by vLLM's TPU backend "
            f"(tpu-inference's quantization table lists it for {', '.join(q.generations)} only: "
            f"{', '.join(where)} sampler slices); serve {BFLOAT16} or use a {' / '.join(where)} sampler"
        )
    if q.lora_refused:
        out.append(
            f"{_FIELD}.quantization: {q.name}: vLLM's TPU backend serves no LoRA on it: {q.lora_refused}"
        )
    return out


__all__ = [
    "BF16_PARITY_NATS",
    "BFLOAT16",
    "QUANTIZATIONS",
    "QUANTIZED_PARITY_NATS",
    "Quantization",
    "get",
    "problems",
    "served_on",
]
