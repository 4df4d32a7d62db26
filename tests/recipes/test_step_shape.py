"""The compiled step's shape of the catalog recipes whose shape was chosen on the TPU compiler's figures
(bench/train_step_compiled.py, docs/architecture.md "tunix"): a step's accumulate calls hold only packed
micro-batches (no all-pad micro-batch is computed), and the token budget is the longest rollout rounded up
(a longer row raises the activations' peak per device with no rollout that needs it).

The rollouts are the bench's spread at the recipe's limits (``groupSize x groupsPerBatch``; prompts
uniform in 256..maxPromptTokens, completions log-uniform in 256..maxTokens), several seeds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import yaml
from rljob.recipes.plan import parse_manifest, resolve
from rljob.trainer.main import model_setup
from rljob.trainer.packing import Rollout, pack_rollouts
from rljob.trainer.train_step import stack_micro_batches

pytestmark = pytest.mark.jax

RECIPES = ("qwen3-8b-v5p", "gpt-oss-20b-v5p")


def run_config(recipe: str, maxtext: dict[str, Any] | None = None) -> Any:
    spec: dict[str, Any] = {"recipe": recipe, "storage": {"root": "gs://rljob-test"}}
    if maxtext:
        spec["trainer"] = {"maxtext": maxtext}
    doc = {"apiVersion": "rljob.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "shape"}, "spec": spec}
    return resolve(parse_manifest(yaml.safe_dump(doc)))


def rollouts(rc: Any, seed: int) -> list[Rollout]:
    alg = rc.spec.algorithm
    n = int(alg.group_size) * int(alg.groups_per_batch)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(256, int(alg.max_prompt_tokens) + 1, n)
    completions = np.exp(rng.uniform(np.log(256), np.log(int(alg.max_tokens)), n)).astype(int)
    return [
        Rollout(
            np.full(p, 2, np.int32),
            np.full(c, 3, np.int32),
            advantage=1.0,
            per_token={"old_logprobs": np.zeros(c, np.float32)},
        )
        for p, c in zip(prompts, completions, strict=True)
    ]


def all_pad_micro_batches(rc: Any, seed: int) -> int:
    """All-pad micro-batches in the step's accumulate calls for one seeded batch."""
    _, step_cfg, _ = model_setup(rc, "config", None)
    packed = pack_rollouts(rollouts(rc, seed), step_cfg.pack_config())
    calls = stack_micro_batches(packed, step_cfg.micro_batches)
    return sum(int(not call["weights"][m].any()) for call in calls for m in range(step_cfg.micro_batches))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("seed", range(4))
def test_calls_hold_only_packed_micro_batches(recipe: str, seed: int) -> None:
    assert all_pad_micro_batches(run_config(recipe), seed) == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_four_micro_batches_per_call_compute_padding(recipe: str) -> None:
    """The broken variant: MaxText's default of 4 micro-batches per call completes some step's last call
    with all-pad micro-batches, computed in full."""
    rc = run_config(recipe, {"gradient_accumulation_steps": 4})
    assert sum(all_pad_micro_batches(rc, seed) for seed in range(4)) > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_token_budget_is_the_longest_rollout(recipe: str) -> None:
    rc = run_config(recipe)
    alg, budget = rc.spec.algorithm, int(rc.spec.packing.token_budget)
    longest = int(alg.max_prompt_tokens) + int(alg.max_tokens)
    assert longest <= budget < longest + 128, (budget, longest)
