"""JAX profiler traces of chosen train steps, written to the run's storage (MaxText keys ``profiler``,
``skip_first_n_steps_for_profiler``, ``profiler_steps``; rljob.recipes.maxtext_policy).

With ``profiler: xplane`` the trainer traces steps ``skip .. skip + count - 1`` (0-based step indices of
the run, so a run resumed after them does not trace again; one resumed inside them traces the rest) with
``jax.profiler.start_trace`` into a local directory, then copies the trace files through the run's store
(contract 6) to ``{storage}/tensorboard/plugins/profile/<run>/<host>.xplane.pb``
(``StoragePaths.profile``): the layout TensorBoard's profile plugin and XProf read, so
``tensorboard --logdir {storage}/tensorboard`` (or ``xprof``) shows the trace beside the step scalars.
Every process traces its own devices (one file per host). `rljob status` names the directory.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
from rljob.recipes import maxtext_policy

__all__ = ["ProfileSettings", "StepProfiler", "profile_settings"]

log = logging.getLogger("rljob.trainer.profiling")

PLUGIN_DIR = "plugins/profile"  # under the TensorBoard log directory (TensorBoard's profile plugin)


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    first: int  # first step index traced
    count: int  # steps traced
    dest: str  # the TensorBoard log directory (storage): traces go to {dest}/plugins/profile/<run>/

    def traced(self, step: int) -> bool:
        return self.first <= step < self.first + self.count


def profile_settings(keys: dict[str, Any], tensorboard: str) -> ProfileSettings | None:
    """The run's profile settings from its MaxText keys (the plan checked them); None without a profiler."""
    if str(keys.get("profiler", "") or "") != "xplane":
        return None
    return ProfileSettings(
        first=maxtext_policy.trainer_int(keys, "skip_first_n_steps_for_profiler", 1),
        count=maxtext_policy.trainer_int(keys, "profiler_steps", 5),
        dest=tensorboard,
    )


class StepProfiler:
    """Starts a trace before the first traced step and stops it after the last (or when the run ends),
    then uploads the trace files."""

    def __init__(self, settings: ProfileSettings | None) -> None:
        self.settings = settings
        self.local: Path | None = None
        self.uploaded: list[str] = []

    def before(self, step: int) -> None:
        if self.settings is None or self.local is not None or not self.settings.traced(step):
            return
        self.local = Path(tempfile.mkdtemp(prefix="rljob-profile-"))
        jax.profiler.start_trace(str(self.local))
        log.info("profiling from step %d into %s", step, self.local)

    def after(self, step: int, last: bool = False) -> None:
        if self.settings is None or self.local is None:
            return
        if last or not self.settings.traced(step + 1):
            self.stop()

    def stop(self) -> None:
        """Stops a running trace and copies its files to storage."""
        if self.settings is None or self.local is None:
            return
        from rljob.common.storage import open_store

        local, self.local = self.local, None
        try:
            jax.profiler.stop_trace()
            store = open_store(self.settings.dest)
            root = local / PLUGIN_DIR
            for f in sorted(p for p in root.rglob("*") if p.is_file()):
                key = f"{PLUGIN_DIR}/{f.relative_to(root).as_posix()}"
                store.write(key, f.read_bytes())
                self.uploaded.append(key)
        finally:
            shutil.rmtree(local, ignore_errors=True)
