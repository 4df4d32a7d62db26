"""Orbax checkpoints on the GCS emulator: round trip, newest-first, and SIGKILL during a save never
leaves a checkpoint that loads wrong (orbax's commit marker on GCS)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from rljob.trainer.checkpoint import Checkpointer

pytestmark = pytest.mark.jax

SAVER = textwrap.dedent(
    """
    import asyncio, os, sys, json
    import numpy as np
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from rljob.trainer.checkpoint import Checkpointer

    # Stop inside the save of step PAUSE_AT, after its data is written and before its commit marker, and
    # say so: the test's SIGKILL then lands mid-save for certain (a timed kill mostly lands between saves).
    PAUSE_AT = int(sys.argv[2])

    def pausing(original):
        async def finalize(self):
            name = self._final_path.name  # the step directory (its items finalize too: "state", "meta")
            if name.isdigit() and int(name) == PAUSE_AT:
                print(json.dumps({"mid_save": int(name)}), flush=True)
                await asyncio.sleep(3600)
            return await original(self)
        return finalize

    for cls in (atomicity.CommitFileTemporaryPath, atomicity.AtomicRenameTemporaryPath):
        cls.finalize = pausing(cls.finalize)
    ck = Checkpointer(sys.argv[1], max_to_keep=100)
    for step in range((ck.latest_step() or 0) + 1, 1000):
        state = {"w": jnp.full((256, 256), float(step)), "b": jnp.arange(step, step + 3000.0),
                 "step": jnp.int32(step)}
        ck.save(step, state, {"tag": step})
        print(json.dumps({"saved": step}), flush=True)
    """
)


def _forget_listings() -> None:
    """Drop gcsfs' cached directory listings in this process (a restarted trainer starts without any)."""
    import gcsfs

    for fs in list(gcsfs.GCSFileSystem._cache.values()):
        fs.invalidate_cache()


def _state(step: int) -> dict[str, object]:
    import jax.numpy as jnp

    return {
        "w": jnp.full((256, 256), float(step)),
        "b": jnp.arange(step, step + 3000.0),
        "step": jnp.int32(step),
    }


def test_round_trip_and_latest(gcs_bucket: str) -> None:
    ck = Checkpointer(f"{gcs_bucket}/ns/job/checkpoints", max_to_keep=2)
    assert ck.latest_step() is None and ck.restore(_state(0)) is None
    for s in (1, 2, 3):
        ck.save(s, _state(s), {"adapter_version": s})
    assert ck.all_steps() == [2, 3]
    restored = ck.restore(_state(0))
    assert restored is not None
    tree, meta = restored
    assert meta == {"adapter_version": 3, "step": 3}
    np.testing.assert_array_equal(np.asarray(tree["w"]), np.full((256, 256), 3.0))
    tree2, _ = ck.restore(_state(0), step=2)  # type: ignore[misc]
    assert int(tree2["step"]) == 2


def test_kill_during_save_never_loads_wrong(gcs_bucket: str, tmp_path: Path) -> None:
    """SIGKILL inside a save (its data written, its commit marker not yet): the checkpoint that loads is
    the previous one, whole, and the partial step is never listed. Each kill is proved to have landed
    mid-save: the saver says it is inside the save, and the partial step's files are in the bucket."""
    from rljob.common.storage import open_store

    directory = f"{gcs_bucket}/ns/job/checkpoints"
    committed_before = 0
    for attempt in range(3):
        pause_at = committed_before + 2  # one save completes, the next is killed inside
        log = tmp_path / f"saver-{attempt}.log"
        proc = subprocess.Popen(
            [sys.executable, "-c", SAVER, directory, str(pause_at)],
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            cwd=tmp_path,
            env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONSAFEPATH": "1"},
        )
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        if json.loads(lines[-1] or "{}") != {"mid_save": pause_at}:
            proc.kill()
            proc.wait()
            tail = [x for x in log.read_text().splitlines() if "gcsfs" not in x][-5:]
            raise AssertionError(f"the saver never paused inside save {pause_at}: {lines} {tail}")
        assert json.loads(lines[0]) == {"saved": pause_at - 1}
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL

        names = open_store(directory).list()
        steps_with_files = {n.split("/")[0] for n in names}
        committed = {
            n.split("/")[0] for n in names if n.endswith("/commit_success.txt") and n.count("/") == 1
        }
        # The kill landed mid-save: the killed step has files in the bucket but no commit marker.
        assert str(pause_at) in steps_with_files and str(pause_at) not in committed, sorted(steps_with_files)

        _forget_listings()  # this process listed the bucket before the saver wrote to it
        ck = Checkpointer(directory, max_to_keep=100)
        latest = ck.latest_step()
        assert latest == pause_at - 1, (sorted(names), sorted(committed))
        assert {str(s) for s in ck.all_steps()} <= committed and pause_at not in ck.all_steps()
        restored = ck.restore(_state(0))
        assert restored is not None
        tree, meta = restored
        assert meta["tag"] == latest == int(tree["step"])
        np.testing.assert_array_equal(np.asarray(tree["w"]), np.full((256, 256), float(latest)))
        np.testing.assert_array_equal(np.asarray(tree["b"]), np.arange(latest, latest + 3000.0))
        committed_before = latest
