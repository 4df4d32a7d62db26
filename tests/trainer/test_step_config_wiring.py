"""The run config's algorithm reaches the compiled step on every path: the pods' (model_setup with the
config's model), `--model tiny`, and the CPU loop's tiny model (loop.cpu_step_config): the KL penalty
against the base policy (the CPU loop used to drop it) and the log-prob head's tile and chunk
(spec.trainer.logprobs; they used to be hard-coded)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from rljob.local.localrun import LOCAL_MANIFEST
from rljob.recipes.plan import parse_manifest, resolve

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
    """A dense model packing balanced under context parallelism: the pods' step gets the mesh's context
    ranks, the Splash blocks and the chunk assignment (context_parallel_load_balance: contiguous chunks
    when false); ``--model tiny`` keeps the layout on one rank with blocks that fit its 128-token rows."""
    from rljob.trainer.main import model_setup

    doc = copy.deepcopy(LOCAL_MANIFEST)
    spec = doc["spec"]
    spec["trainer"].update(
        tpu="tpu7x-16",
        mesh={"fsdp": 2, "context": 8},
        maxtext={"context_parallel_load_balance": False, "sa_block_q": 256, "sa_block_kv_dkv": 1024},
    )
    spec["packing"] = {"padPosition": "balanced", "tokenBudget": 8192, "padAlign": 2048}
    rc = resolve(parse_manifest(yaml.safe_dump(doc)))
    assert (rc.spec.packing.pad_position, rc.spec.packing.max_segments_per_row) == ("balanced", None)
    cfg = model_setup(rc, "config", None)[1]
    assert (cfg.pad_position, cfg.max_segments) == ("balanced", None)
    assert (cfg.context_ranks, cfg.dual_chunk_swap) == (8, False)
    assert cfg.kernel_blocks == ((256, 512), (512, 1024))
    pack = cfg.pack_config()
    assert (pack.pad_position, pack.context_ranks, pack.kernel_blocks) == ("balanced", 8, cfg.kernel_blocks)
    tiny = model_setup(rc, "tiny", None)[1]
    assert (tiny.context_ranks, tiny.kernel_blocks) == (1, ((64, 64), (64, 64)))
    tiny.pack_config()


def test_a_gated_delta_net_model_trains_the_plans_one_rollout_per_row() -> None:
    """Qwen3.5's plan (the 397B example) says one rollout per row with the padding at the end
    (rljob.recipes.plan), and every path of the step takes it from there: the pods' step, ``--model
    tiny`` and the CPU loop's."""
    from pathlib import Path

    from rljob.trainer.loop import cpu_step_config
    from rljob.trainer.main import model_setup

    text = (Path(__file__).resolve().parents[2] / "examples" / "qwen3.5-397b-tpu7x-256chips.yaml").read_text()
    rc = resolve(parse_manifest(text))
    assert (rc.spec.packing.pad_position, rc.spec.packing.max_segments_per_row) == ("end", 1)
    configs = {
        "config": model_setup(rc, "config", None)[1],
        "tiny": model_setup(rc, "tiny", None)[1],
        "cpu loop": cpu_step_config(rc, 32),
    }
    for path, cfg in configs.items():
        assert (cfg.pad_position, cfg.max_segments) == ("end", 1), path
        pack = cfg.pack_config()
        assert (pack.pad_position, pack.max_segments) == ("end", 1), path


@pytest.mark.parametrize(
    ("block", "recurrent"), [("qwen3_5", True), ("qwen3_next", True), ("qwen3", False), ("gemma4", False)]
)
def test_a_gated_delta_net_step_refuses_packed_rows(block: str, recurrent: bool) -> None:
    """Gated delta nets carry their state along the row (MaxText reads segment ids as a padding mask
    only): two rollouts packed in one row, or one after leading padding, would be scored differently
    from the sampler, which scores each alone. The plan resolves such a model to one rollout per row at
    its start; a step config that disagrees (not from the plan) is refused naming the field, and the
    plan's one packs one rollout per row. Other decoders take any packing."""
    import numpy as np
    from rljob.trainer.packing import Rollout, pack_rollouts
    from rljob.trainer.train_step import StepConfig, model_problem

    packed = StepConfig(budget=64, rows=2, segment_align=1, pad_position="start", pad_align=8)
    one = StepConfig(budget=64, rows=2, segment_align=1, max_segments=1)
    problem = model_problem(packed, block)
    assert model_problem(one, block) is None
    rollouts = [Rollout(prompt_ids=np.arange(1, 4), completion_ids=np.arange(4, 9)) for _ in range(3)]
    if recurrent:
        assert problem == (
            f"spec.packing.maxSegmentsPerRow: the {block} decoder has gated delta net layers and trains one "
            "rollout per row with padPosition end; the step has max_segments None, pad_position start"
        )
        mbs = pack_rollouts(rollouts, one.pack_config())
        seg = np.concatenate([mb.segment_ids for mb in mbs])
        assert len(mbs) == 2 and seg.max() == 1  # three rows of one rollout each, in two micro-batches
        assert [int((row > 0).sum()) for row in seg[:3]] == [8, 8, 8]
        assert (seg[:3, :8] == 1).all()  # each starts its row
    else:
        assert problem is None
        mbs = pack_rollouts(rollouts, packed.pack_config())
        seg = np.concatenate([mb.segment_ids for mb in mbs])
        assert len(mbs) == 1 and seg.max() == 3  # all three share one row
