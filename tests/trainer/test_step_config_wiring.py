"""The run config's algorithm reaches the compiled step on every path: the pods' (model_setup with the
config's model), `--model tiny`, and the CPU loop's tiny model (loop.cpu_step_config): the KL penalty
against the base policy (the CPU loop used to drop it) and the log-prob head's tile and chunk
(spec.trainer.logprobs; they used to be hard-coded)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from rljob.recipes.plan import parse_manifest, resolve
from rljob.trainer.localrun import LOCAL_MANIFEST

pytestmark = pytest.mark.jax


def _rc(kl: float) -> Any:
    doc = copy.deepcopy(LOCAL_MANIFEST)
    doc["spec"]["algorithm"]["klPenaltyCoef"] = kl
    doc["spec"]["trainer"]["logprobs"] = {"tokenTile": 64, "vocabChunk": 96}
    return resolve(parse_manifest(yaml.safe_dump(doc)))


@pytest.mark.parametrize("kl", [0.0, 0.25])
def test_every_path_takes_the_kl_penalty_and_the_head_blocks(kl: float) -> None:
    from rljob.trainer.loop import cpu_step_config
    from rljob.trainer.main import model_setup

    rc = _rc(kl)
    configs = {
        "config": model_setup(rc, "config", None)[1],
        "tiny": model_setup(rc, "tiny", None)[1],
        "cpu loop": cpu_step_config(rc, 32),
    }
    for path, cfg in configs.items():
        assert cfg.loss.kl_coef == kl, path
        assert (cfg.token_tile, cfg.vocab_chunk) == (64, 96), path


def test_balanced_packing_reaches_the_step_with_the_plans_tile_model() -> None:
    """The 397B recipe packs balanced: the pods' step gets the mesh's context parallelism, the recipe's
    Splash blocks and its chunk assignment (context_parallel_load_balance false: contiguous chunks);
    ``--model tiny`` keeps the layout on one rank with blocks that fit its 128-token rows."""
    from pathlib import Path

    from rljob.trainer.main import model_setup

    text = (Path(__file__).resolve().parents[2] / "examples" / "qwen3.5-397b-tpu7x-256chips.yaml").read_text()
    rc = resolve(parse_manifest(text))
    assert rc.spec.packing.pad_position == "balanced"
    cfg = model_setup(rc, "config", None)[1]
    assert (cfg.pad_position, cfg.context_ranks, cfg.dual_chunk_swap) == ("balanced", 8, False)
    assert cfg.kernel_blocks == ((1024, 4096), (2048, 2048))
    pack = cfg.pack_config()
    assert (pack.pad_position, pack.context_ranks, pack.kernel_blocks) == ("balanced", 8, cfg.kernel_blocks)
    tiny = model_setup(rc, "tiny", None)[1]
    assert (tiny.context_ranks, tiny.kernel_blocks) == (1, ((64, 64), (64, 64)))
    tiny.pack_config()
