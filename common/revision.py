"""The run's pinned base revision: the one commit of ``spec.model.name`` that both roles load.

A manifest may name a moving ``spec.model.revision`` (a branch such as ``main``, or a tag). Asked at each
role's own start, the Hub could answer the trainer and the samplers with different commits (a push
between two pods' starts, or before a restart), and the two roles would then serve and train different
weights. So the revision is resolved once per run: the trainer's process 0 asks the Hub at its first
start (rljob.trainer.hf_weights) and writes the answer to the object ``BASE_REVISION_KEY`` under the
run's storage root (``StoragePaths.root``, which holds the RLJob's uid: a new RLJob resolves anew);
every later start of the trainer reads it instead of asking again, and every sampler start waits for it
(:func:`wait`) and serves that commit (rljob.sampler.main). A full commit hash in the manifest is
already pinned: nobody writes or waits.

The object: ``{"model": <spec.model.name>, "ref": <spec.model.revision as written>, "revision": <the
commit>}``; where the trainer could not reach the Hub, ``revision`` is the ref itself (both roles then
load the ref as written, as before the pin existed). One that names another model or ref, or a revision
that is neither a commit hash nor the ref, is not this run's pin: :func:`read` returns None.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from rljob.common.storage import open_store
from rljob.recipes import syntax
from rljob.recipes.runconfig import BASE_REVISION_KEY

__all__ = ["PinTimeout", "Pinned", "is_commit", "read", "wait", "write"]


def is_commit(revision: str) -> bool:
    """Whether ``revision`` is a full commit hash (syntax.HF_COMMIT), which never moves."""
    return syntax.matches(syntax.HF_COMMIT, revision)


@dataclass(frozen=True)
class Pinned:
    """``ref`` of ``model`` as this run loads it: ``revision`` (a commit, or ``ref`` where unresolved)."""

    model: str
    ref: str
    revision: str

    def encode(self) -> bytes:
        return json.dumps({"model": self.model, "ref": self.ref, "revision": self.revision}).encode()


class PinTimeout(TimeoutError):
    """The trainer wrote no pin for the run in time (it has not started, or cannot reach storage)."""


def read(run_root: str, model: str, ref: str) -> Pinned | None:
    """The run's pin of ``model`` at ``ref``; None where there is none yet (or it is not this one)."""
    raw = open_store(run_root).read(BASE_REVISION_KEY)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        got = Pinned(str(doc["model"]), str(doc["ref"]), str(doc["revision"]))
    except (ValueError, KeyError, TypeError):
        return None
    if (got.model, got.ref) != (model, ref) or not (is_commit(got.revision) or got.revision == ref):
        return None
    return got


def write(run_root: str, pinned: Pinned) -> None:
    """Write the run's pin (the trainer's process 0 only, once per run)."""
    if not (is_commit(pinned.revision) or pinned.revision == pinned.ref):
        raise ValueError(f"{pinned.revision!r} is neither a commit hash nor the ref {pinned.ref!r}")
    open_store(run_root).write(BASE_REVISION_KEY, pinned.encode())


def wait(
    run_root: str,
    model: str,
    ref: str,
    *,
    timeout_s: float,
    poll_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """The revision to load for ``model`` at ``ref``: ``ref`` itself when it is a commit hash, else the
    run's pin, polled every ``poll_s`` until it appears; :class:`PinTimeout` after ``timeout_s``."""
    if is_commit(ref):
        return ref
    deadline = clock() + timeout_s
    while True:
        got = read(run_root, model, ref)
        if got is not None:
            return got.revision
        if clock() >= deadline:
            raise PinTimeout(
                f"spec.model.revision: {model}@{ref}: the trainer wrote no pinned commit to "
                f"{run_root}/{BASE_REVISION_KEY} within {timeout_s:.0f} s (it resolves spec.model.revision "
                "once per run at its first start; name a full commit hash to serve without it)"
            )
        sleep(max(0.0, min(poll_s, deadline - clock())))
