"""Start-up checks the plan and the trainer share, so that ``rljob validate`` (and the admission webhook)
refuses what the trainer would refuse at start, with the same field and message.

Each function returns a ``field: message`` line, or None when the value is fine. The LoRA targets' checks
live in :mod:`rljob.recipes.lora_targets` (a table of the decoder blocks). tests/recipes/test_startup.py
enumerates the trainer's start-up refusals and shows each one refused by ``rljob validate``.
"""

from __future__ import annotations

__all__ = ["MIN_GROUP_SIZE", "group_size_problem"]

# GRPO's baseline is the group's mean reward: one sample per prompt has no advantage to learn from.
MIN_GROUP_SIZE = 2


def group_size_problem(group_size: int) -> str | None:
    """spec.algorithm.groupSize: the RL loop (rljob.trainer.loop) needs at least two samples a prompt."""
    if group_size < MIN_GROUP_SIZE:
        return (
            f"spec.algorithm.groupSize: GRPO needs at least {MIN_GROUP_SIZE} samples per prompt, got "
            f"{group_size}"
        )
    return None
