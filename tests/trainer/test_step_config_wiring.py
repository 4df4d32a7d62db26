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
