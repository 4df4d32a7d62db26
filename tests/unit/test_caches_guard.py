"""rljob.common.caches.LoadGuard through jax_compilation_cache: an attempt that dies while it loads its
programs from a restored cache turns that cache off for the run's later attempts (no crash loop), and only
such an attempt does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rljob.common import caches
from rljob.common.storage import open_store

TESTED_MODULES = ("rljob.common.caches",)


class _Jax:
    """What jax_compilation_cache asked of JAX's config."""

    def __init__(self) -> None:
        self.set: dict[str, Any] = {}

    def update(self, key: str, value: Any) -> None:
        self.set[key] = value


def _start(root: Path, disk: str, process: int = 0) -> tuple[caches.CacheSync, _Jax]:
    jax = _Jax()
    sync = caches.jax_compilation_cache(
        caches.JAX_TRAINER, str(root / "cache"), root / disk, jax.update, guard_process=process
    )
    return sync, jax


def _entry(root: Path) -> None:
    open_store(str(root / "cache" / caches.JAX_TRAINER)).write("jit_step-abc-cache", b"executable")


def _used(jax: _Jax) -> bool:
    return "jax_compilation_cache_dir" in jax.set and jax.set.get("jax_enable_compilation_cache", True)


@pytest.mark.parametrize(
    ("entries", "loaded", "next_uses_cache"),
    [
        (False, False, True),  # a first start (nothing restored) that died: it loaded nothing
        (True, True, True),  # its programs ran: the cache is fine
        (True, False, False),  # died with restored entries before its first step: off for the run
    ],
)
def test_an_attempt_that_died_loading_its_cache_turns_it_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entries: bool, loaded: bool, next_uses_cache: bool
) -> None:
    if entries:
        _entry(tmp_path)
    first, jax1 = _start(tmp_path, "disk1")
    assert _used(jax1)
    if loaded:
        first.loaded()
    first._stop.set()  # the attempt ends here (died, unless it loaded: nothing else runs)
    second, jax2 = _start(tmp_path, "disk2")  # the restart, on a fresh disk
    assert _used(jax2) is next_uses_cache, jax2.set
    err = capsys.readouterr().err
    assert ("cache jax-trainer: not used: an earlier attempt died" in err) is not next_uses_cache, err
    second.close()  # an orderly end (an exception included) is not a death while loading
    third, jax3 = _start(tmp_path, "disk3")  # and every later attempt of the run
    assert _used(jax3) is next_uses_cache
    third.close()


def test_a_cache_turned_off_writes_nothing_back(tmp_path: Path) -> None:
    _entry(tmp_path)
    _start(tmp_path, "disk1")[0]._stop.set()
    off, jax = _start(tmp_path, "disk2")
    assert jax.set == {"jax_enable_compilation_cache": False}
    (tmp_path / "disk2" / caches.JAX_TRAINER).mkdir(parents=True)
    (tmp_path / "disk2" / caches.JAX_TRAINER / "jit_new-def-cache").write_bytes(b"x")
    assert off.close() == 0
    assert open_store(str(tmp_path / "cache" / caches.JAX_TRAINER)).list() == ["jit_step-abc-cache"]


def test_each_process_answers_for_its_own_loads(tmp_path: Path) -> None:
    _entry(tmp_path)
    p0, _ = _start(tmp_path, "a0", process=0)
    p1, _ = _start(tmp_path, "a1", process=1)
    p0.loaded()  # process 1 died before its first step, process 0 did not
    guard = open_store(str(tmp_path / "cache" / f"{caches.JAX_TRAINER}-guard"))
    assert guard.list() == ["loading-1"]
    p0._stop.set()
    p1._stop.set()
    # The restart: process 1 turns the cache off (process 0, which loaded it fine, may start with it
    # when it looks first: another process's marker may be that process's current attempt's)...
    _, jax = _start(tmp_path, "b1", process=1)
    assert not _used(jax)
    # ...and from then on no process of the run uses it.
    _, jax = _start(tmp_path, "b0", process=0)
    assert not _used(jax)


def test_without_a_guard_nothing_is_written_beside_the_cache(tmp_path: Path) -> None:
    _entry(tmp_path)
    jax = _Jax()
    caches.jax_compilation_cache(
        caches.JAX_TRAINER, str(tmp_path / "cache"), tmp_path / "d", jax.update
    ).close()
    assert _used(jax)
    assert open_store(str(tmp_path / "cache" / f"{caches.JAX_TRAINER}-guard")).list() == []
