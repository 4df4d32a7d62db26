"""The reward-by-step history of a run, for `rljob status`: read from the TensorBoard event files the
trainer writes under the run's storage (rljob.recipes.runconfig.StoragePaths.tensorboard)."""

from __future__ import annotations

from typing import Any


def reward_history(obj: dict[str, Any]) -> tuple[list[tuple[int, float]], str]:
    """(step, mean reward) pairs, and why there are none."""
    return [], "no TensorBoard events read"
