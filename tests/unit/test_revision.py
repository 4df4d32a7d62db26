"""The run's pinned base revision (rljob.common.revision): what counts as this run's pin, and the wait."""

from __future__ import annotations

from pathlib import Path

import pytest
from rljob.common import revision
from rljob.recipes.runconfig import BASE_REVISION_KEY

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    ("stored", "want"),
    [
        (b'{"model": "Qwen/Q", "ref": "main", "revision": "%s"}' % COMMIT.encode(), COMMIT),
        (b'{"model": "Qwen/Q", "ref": "main", "revision": "main"}', "main"),  # the trainer had no Hub
        (b'{"model": "Qwen/Other", "ref": "main", "revision": "%s"}' % COMMIT.encode(), None),
        (b'{"model": "Qwen/Q", "ref": "v1", "revision": "%s"}' % COMMIT.encode(), None),
        (b'{"model": "Qwen/Q", "ref": "main", "revision": "v2"}', None),  # neither a commit nor the ref
        (b'{"model": "Qwen/Q", "ref": "main", "revision": "%s"}' % COMMIT.upper().encode(), None),
        (b'{"model": "Qwen/Q"}', None),
        (b"not json", None),
        (None, None),
    ],
)
def test_only_this_runs_pin_is_read(tmp_path: Path, stored: bytes | None, want: str | None) -> None:
    if stored is not None:
        (tmp_path / BASE_REVISION_KEY).write_bytes(stored)
    got = revision.read(str(tmp_path), "Qwen/Q", "main")
    assert (got.revision if got else None) == want


def test_a_pin_is_written_read_back_and_only_as_a_commit_or_the_ref(tmp_path: Path) -> None:
    revision.write(str(tmp_path), revision.Pinned("Qwen/Q", "main", COMMIT))
    assert revision.read(str(tmp_path), "Qwen/Q", "main") == revision.Pinned("Qwen/Q", "main", COMMIT)
    with pytest.raises(ValueError, match="neither a commit hash nor the ref"):
        revision.write(str(tmp_path), revision.Pinned("Qwen/Q", "main", "v2"))


def test_the_wait_is_bounded_and_polls_until_the_pin_appears(tmp_path: Path) -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s
        if now[0] >= 12.0 and not (tmp_path / BASE_REVISION_KEY).exists():
            revision.write(str(tmp_path), revision.Pinned("Qwen/Q", "main", COMMIT))

    got = revision.wait(
        str(tmp_path), "Qwen/Q", "main", timeout_s=60, poll_s=5, clock=lambda: now[0], sleep=sleep
    )
    assert got == COMMIT and slept == [5, 5, 5]
    now[0], slept[:] = 0.0, []
    with pytest.raises(revision.PinTimeout, match=r"^spec\.model\.revision: Qwen/Q@v9: the trainer wrote no"):
        revision.wait(str(tmp_path), "Qwen/Q", "v9", timeout_s=7, poll_s=5, clock=lambda: now[0], sleep=sleep)
    assert slept == [5, 2]  # never past the deadline


def test_a_commit_is_its_own_pin() -> None:
    assert revision.wait("/nonexistent", "Qwen/Q", COMMIT, timeout_s=0) == COMMIT
