"""What the plan decides for the trainer's log-prob head and its GRPO advantages: spec.trainer.logprobs
(tokenTile derived from a device's tokens per micro-batch, checked when set), spec.algorithm.
advantageNormalization, and every MaxText setting under which the head could not run, refused with the
field (the trainer itself no longer refuses any of them at start)."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.recipes import manifest, problems, recipe_manifest, resolve
from rljob.recipes import recipe_catalog

# spec overrides -> (spec.trainer.logprobs.token_tile, vocab_chunk, spec.algorithm.advantage_normalization)
RESOLVED: list[tuple[str, dict[str, Any], tuple[int, int, str]]] = [
    # v5p-8: 4 rows x 3072 tokens over 4 devices = 3072 a device: the largest divisor <= 2048 is 1536
    ("defaults", {}, (1536, 8192, "mean")),
    ("a divisor up to 2048", {"packing": {"tokenBudget": 8192}}, (2048, 8192, "mean")),
    (
        "set",
        {
            "trainer": {"logprobs": {"tokenTile": 512, "vocabChunk": 4096}},
            "algorithm": {"advantageNormalization": "std"},
        },
        (512, 4096, "std"),
    ),
    # 1 row of 1024 tokens over 4 devices (tensor 4): 256 a device
    (
        "fewer tokens than a tile",
        {
            "trainer": {"mesh": {"fsdp": 1, "tensor": 4}},
            "algorithm": {"maxTokens": 512, "maxPromptTokens": 512},
        },
        (256, 8192, "mean"),
    ),
]


@pytest.mark.parametrize(("name", "spec", "want"), RESOLVED, ids=[r[0] for r in RESOLVED])
def test_resolved(name: str, spec: dict[str, Any], want: tuple[int, int, str]) -> None:
    rc = resolve(manifest(spec))
    lp = rc.spec.trainer.logprobs
    assert (lp.token_tile, lp.vocab_chunk, rc.spec.algorithm.advantage_normalization) == want


def test_every_catalog_recipe_resolves_a_tile_that_divides_its_tokens() -> None:
    for name in recipe_catalog.names():
        for profile in [None, *recipe_catalog.load(name).profiles]:
            rc = resolve(recipe_manifest(name, profile))
            assert rc.spec.trainer and rc.spec.trainer.logprobs and rc.spec.packing
            per_device = rc.trainer.micro_batch_size * rc.spec.packing.token_budget // rc.trainer.devices
            tile = rc.spec.trainer.logprobs.token_tile
            assert tile and per_device % tile == 0 and tile <= 2048, (name, profile, tile, per_device)


REFUSED: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "tile that does not divide",
        {"trainer": {"logprobs": {"tokenTile": 1000}}},
        [
            "spec.trainer.logprobs.tokenTile: 1000 does not divide the 3072 tokens each device scores per "
            "micro-batch (microBatchSize x tokenBudget / 4 devices): the last tile of every micro-batch "
            "would be partly recomputed"
        ],
    ),
    (
        "chunk beyond the vocabulary",
        {"trainer": {"logprobs": {"vocabChunk": 200000}}},
        ["spec.trainer.logprobs.vocabChunk: 200000 exceeds the model's vocabulary of 151936 tokens"],
    ),
    (
        "zero sizes",
        {"trainer": {"logprobs": {"tokenTile": 0, "vocabChunk": 0}}},
        [
            "spec.trainer.logprobs.tokenTile: Input should be greater than or equal to 1",
            "spec.trainer.logprobs.vocabChunk: Input should be greater than or equal to 1",
        ],
    ),
    (
        "vLLM's attention",
        {"trainer": {"maxtext": {"attention": "vllm_rpa"}}},
        [
            "spec.trainer.maxtext.attention: vllm_rpa is vLLM's serving attention: MaxText then computes "
            "neither logits nor the hidden states the trainer's log-prob head reads"
        ],
    ),
    (
        "quantized logits projection",
        {"trainer": {"maxtext": {"quantize_logits_proj": True}}},
        [
            "spec.trainer.maxtext.quantize_logits_proj: MaxText refuses it with vocabulary tiling, which the "
            "trainer always turns on (num_vocab_tiling >= 2) to read the hidden states instead of [B, T, V] "
            "logits"
        ],
    ),
    (
        "the indexer's dense warm-up",
        {"trainer": {"maxtext": {"use_indexer": True, "indexer_loss_scaling_factor": 0.1}}},
        [
            "spec.trainer.maxtext.use_indexer: the indexer's dense warm-up (indexer_loss_scaling_factor > 0 "
            "without indexer_sparse_training) trains the indexer alone: MaxText skips the hidden states the "
            "RL trainer's log-prob head reads"
        ],
    ),
    (
        "half a token per device: no vocabulary tiles",
        {
            "trainer": {"tpu": "tpu7x-256", "mesh": {"fsdp": 1, "tensor": 256}},
            "algorithm": {"maxPromptTokens": 64, "maxTokens": 64},
            "packing": {"tokenBudget": 128},
        },
        [
            "spec.trainer.microBatchSize: 0.5 tokens per device (microBatchSize x tokenBudget / 256 "
            "devices) do not split into the 2 vocabulary tiles of MaxText's num_vocab_tiling, which the "
            "trainer sets to at least 2 (the hidden states instead of [B, T, V] logits)"
        ],
    ),
    (
        "advantage normalization",
        {"algorithm": {"advantageNormalization": "rank"}},
        ["spec.algorithm.advantageNormalization: Input should be 'mean' or 'std'"],
    ),
]


@pytest.mark.parametrize(("name", "spec", "want"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused(name: str, spec: dict[str, Any], want: list[str]) -> None:
    assert problems(manifest(spec)) == want
