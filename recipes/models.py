"""Facts about models that the plan checks a spec against.

``MODELS``: what the sampler plan checks its parallelism against. ``num_kv_heads`` and ``num_experts``
are MaxText 0.2.5's own values (``base_num_kv_heads``, ``num_experts`` in
``maxtext/configs/models/<maxtextModel>.yml``; tests/recipes/test_models.py reads the installed MaxText
and compares). Any other MaxText model's facts are read from the same keys in the MaxText key table the
plan checks keys against (``rljob.recipes.maxtext_keys``, generated from MaxText 0.2.5's model configs), so
a Qwen3 size the catalog has no recipe for is checked too. A model MaxText does not know is not checked
(the plan refuses its name).

``RECURRENT_DECODER_BLOCKS``: the decoder blocks whose rollouts the trainer packs one per row (the plan's
spec.packing, which the trainer follows).
"""

from __future__ import annotations

from dataclasses import dataclass

from rljob.recipes import families, maxtext_keys


@dataclass(frozen=True)
class ModelFacts:
    num_kv_heads: int
    num_experts: int = 0  # 0: a dense model


def facts(maxtext_model: str | None, version: str) -> ModelFacts | None:
    """The model's facts from its MaxText config in the key table of MaxText ``version`` (the manifest's
    spec.trainer.maxtextVersion); None: the version or the model is unknown."""
    name = maxtext_model or ""
    try:
        cfg = maxtext_keys.load(version).models.get(name)
    except KeyError:
        return None
    kv = maxtext_keys.number(cfg.get("base_num_kv_heads")) if cfg else None
    if not kv:
        return None
    experts = int(maxtext_keys.number(cfg.get("num_experts")) or 0) if cfg else 0
    return ModelFacts(num_kv_heads=int(kv), num_experts=experts if experts > 1 else 0)


# MaxText decoder blocks with gated delta net layers (rljob.recipes.families ``recurrent``; MaxText 0.2.5
# models/qwen3.py Qwen3NextGatedDeltaNet, also Qwen3.5's): their causal depthwise convolution and their
# delta-rule recurrence run along the whole row, reading the segment ids only as a padding mask (segment
# id 0), so a rollout packed after another starts from the other's state, and one after leading padding
# convolves the padding's projections into its first tokens. Such a model trains one rollout per row,
# starting the row (spec.packing.maxSegmentsPerRow 1, padPosition end), so each rollout is scored exactly
# as the sampler scores it alone.
RECURRENT_DECODER_BLOCKS = families.blocks_where("recurrent")


def recurrent(decoder_block: str | None) -> bool:
    """Whether a decoder block has gated delta net layers (RECURRENT_DECODER_BLOCKS)."""
    return (decoder_block or "").lower() in RECURRENT_DECODER_BLOCKS


__all__ = ["RECURRENT_DECODER_BLOCKS", "ModelFacts", "facts", "recurrent"]
