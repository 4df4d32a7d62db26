"""`rljob status`'s reward history: TensorBoard event files written by the trainer's own StepLog, read back
(TFRecord framing with CRCs, Event protos), across restarts and with a file still being written."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rljob.cli import metrics
from rljob.trainer.progress import StepLog


def _write(logdir: Path, steps: dict[int, float], loss: bool = True) -> None:
    log = StepLog(str(logdir), stream=open(logdir.parent / "steps.log", "a"))  # noqa: SIM115
    for step, reward in steps.items():
        log.step(step, {"reward_mean": reward, **({"loss": -reward} if loss else {})})
    log.close()


def test_round_trip_and_restart(tmp_path: Path) -> None:
    tb = tmp_path / "tb"
    _write(tb, {1: 0.1, 2: 0.2, 3: 0.3})
    # A restarted attempt resumes from step 2's checkpoint and redoes step 3 (its own file, later name).
    import time

    time.sleep(1.1)  # tensorboardX names files by the second
    _write(tb, {3: 0.35, 4: 0.4})
    files = metrics.read_event_files(str(tb))
    assert len(files) == 2
    got = metrics.scalars(files)
    assert got["train/reward_mean"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.35, 4: 0.4})
    assert got["train/loss"][4] == pytest.approx(-0.4)


def test_truncated_or_corrupt_tail_keeps_what_came_before(tmp_path: Path) -> None:
    tb = tmp_path / "tb"
    _write(tb, {1: 0.5, 2: 0.75}, loss=False)
    (data,) = metrics.read_event_files(str(tb))
    whole = metrics.scalars([data])["train/reward_mean"]
    assert whole == {1: 0.5, 2: 0.75}
    # A file being written: cut anywhere in the last record, the earlier records still read.
    last = list(metrics.records(data))[-1]
    cut = data[: len(data) - len(last) // 2]
    assert metrics.scalars([cut])["train/reward_mean"] == {1: 0.5}
    # A flipped payload byte fails its CRC: reading stops there instead of returning garbage.
    broken = bytearray(data)
    broken[len(data) - 8] ^= 0xFF
    assert metrics.scalars([bytes(broken)]).get("train/reward_mean", {}) == {1: 0.5}


def _frame(payload: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the payload, its masked CRC."""
    from tensorboardX.record_writer import masked_crc32c

    header = struct.pack("<Q", len(payload))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + payload
        + struct.pack("<I", masked_crc32c(payload))
    )


@settings(max_examples=25, deadline=None)
@given(st.binary(max_size=256))
def test_records_never_crash_on_garbage(data: bytes) -> None:
    """Garbage after good records: the good ones read back whole, and whatever follows is framed inside
    the bytes given (nothing read past the end, nothing made up)."""
    good = [b"first", b"", b"third record"]
    stream = b"".join(_frame(p) for p in good)
    got = list(metrics.records(stream + data))
    assert got[:3] == good
    assert sum(16 + len(p) for p in got) <= len(stream) + len(data)
    alone = list(metrics.records(data))
    assert b"".join(_frame(p) for p in alone) == data[: sum(16 + len(p) for p in alone)]


def test_tensorboard_dir_follows_the_plan() -> None:
    obj = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "grpo", "namespace": "rl", "uid": "0d4c-1", "resourceVersion": "7"},
        "spec": {"recipe": "qwen3-8b-v5p", "storage": {"root": "gs://bucket/runs/"}},
        "status": {"phase": "Running"},
    }
    assert metrics.tensorboard_dir(obj) == "gs://bucket/runs/rl/grpo/0d4c-1/tensorboard"
    history, note = metrics.reward_history({**obj, "spec": {"recipe": "nope"}})
    assert history == [] and note.startswith("cannot derive its storage")


def test_reward_history_from_gcs(gcs_bucket: str, tmp_path: Path) -> None:
    obj = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "grpo", "namespace": "rl", "uid": "u1"},
        "spec": {"recipe": "qwen3-8b-v5p", "storage": {"root": gcs_bucket}},
    }
    history, note = metrics.reward_history(obj)
    assert history == [] and note == f"no reward events under {gcs_bucket}/rl/grpo/u1/tensorboard yet"
    log = StepLog(f"{gcs_bucket}/rl/grpo/u1/tensorboard", stream=open(tmp_path / "log", "w"))  # noqa: SIM115
    for step in (1, 2, 3):
        log.step(step, {"reward_mean": step / 4})
    log.close()
    history, note = metrics.reward_history(obj)
    assert history == [(1, 0.25), (2, 0.5), (3, 0.75)] and note == ""
