"""Step-exact checkpoints with orbax under ``{storage.root}/{ns}/{name}/checkpoints`` (gs:// or local).

A checkpoint holds the train state pytree (LoRA parameters, optimizer state, step and skip counters)
and a JSON ``meta`` item (step, adapter version, anything the loop needs to resume exactly). Saves are
synchronous and committed atomically by orbax: on a local filesystem it writes a temporary directory
and renames it; on GCS (no rename) it writes ``commit_success.txt`` last and never lists a step
without it. A process killed mid-save therefore leaves either the previous step or the whole new one
(tests/trainer/test_checkpoint.py kills savers with SIGKILL and checks).

This module does not import MaxText (fast to import in small subprocesses).
"""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


class Checkpointer:
    """Save / restore train states by step under ``directory``; keeps the newest ``max_to_keep``."""

    def __init__(self, directory: str, *, max_to_keep: int = 3) -> None:
        self.directory = directory.rstrip("/")
        self._mngr = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=False,
                create=True,
            ),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        self._mngr.reload()
        step = self._mngr.latest_step()
        return None if step is None else int(step)

    def all_steps(self) -> list[int]:
        self._mngr.reload()
        return sorted(int(s) for s in self._mngr.all_steps())

    def delete(self, step: int) -> None:
        """Remove the checkpoint of ``step``."""
        self._mngr.delete(step)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Save ``state`` (a pytree of arrays) and ``meta`` (JSON) as ``step``; returns when committed."""
        self._mngr.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave({**meta, "step": step}),
            ),
            force=True,
        )
        self._mngr.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]] | None:
        """(state, meta) of ``step`` (default: the newest committed), shaped like ``abstract_state``
        (a pytree of arrays or ShapeDtypeStructs); None when there is no checkpoint."""
        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        out = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self._mngr.close()
