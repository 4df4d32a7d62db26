"""The trainer's process barrier (rljob.trainer.sync.align): the coordination service's barrier, by name
and deadline, on a multi-process run only."""

from __future__ import annotations

from typing import Any

import jax
import pytest
from jax._src import distributed
from rljob.trainer import sync


class _Client:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def wait_at_barrier(self, name: str, timeout_in_ms: int) -> None:
        self.calls.append((name, timeout_in_ms))


@pytest.mark.parametrize(
    ("processes", "timeout_s", "calls"),
    [(2, 900, [("step", 900_000)]), (4, 30, [("step", 30_000)]), (1, 900, [])],
)
def test_align_waits_at_the_named_barrier_on_several_processes(
    monkeypatch: pytest.MonkeyPatch, processes: int, timeout_s: int, calls: list[tuple[str, int]]
) -> None:
    client = _Client()
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    monkeypatch.setattr(distributed.global_state, "client", client)
    sync.align("step", timeout_s=timeout_s)
    assert client.calls == calls


def test_align_without_a_coordination_client_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed.global_state, "client", None)
    sync.align("step")  # a multi-process run that did not call jax.distributed.initialize: nothing to wait on


def test_align_default_deadline_is_15_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    client: Any = _Client()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed.global_state, "client", client)
    sync.align("start")
    assert client.calls == [("start", 900_000)]
