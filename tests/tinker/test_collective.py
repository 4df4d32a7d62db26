"""The multi-process Tinker service's channel (rljob.trainer.tinker.collective.Channel) on one process: its
framing of a payload, the key each operation announces and its order, and a follower's wait that outlasts
an idle service. Two processes run it in tests/tinker/test_tinker_multihost.py."""

from __future__ import annotations

from typing import Any

import pytest
from jax._src import distributed
from rljob.trainer.tinker.collective import KEY_PREFIX, MIN_PAYLOAD, WAIT_MS, Channel


class _Client:
    def __init__(self, idle_waits: int = 0) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.idle_waits = idle_waits

    def key_value_set(self, key: str, value: str) -> None:
        self.calls.append(("set", key, value))

    def key_value_delete(self, key: str) -> None:
        self.calls.append(("delete", key))

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        self.calls.append(("get", key, str(timeout_ms)))
        if self.idle_waits:
            self.idle_waits -= 1
            raise RuntimeError("DEADLINE_EXCEEDED: nothing yet")
        return "1"


def _channel(monkeypatch: pytest.MonkeyPatch, client: Any) -> Channel:
    monkeypatch.setattr(distributed.global_state, "client", client)
    return Channel()


def test_a_channel_needs_the_coordination_client(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match=r"jax\.distributed\.initialize"):
        _channel(monkeypatch, None)


@pytest.mark.parametrize("size", [0, 1, MIN_PAYLOAD - 8, MIN_PAYLOAD - 7, 3 * MIN_PAYLOAD + 5])
def test_a_payload_comes_back_whole(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    assert Channel._broadcast(payload) == payload


def test_send_announces_each_operation_under_its_number(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _Client()
    ch = _channel(monkeypatch, client)
    ch.send(b"a")
    ch.send(b"b")
    assert client.calls == [
        ("set", f"{KEY_PREFIX}/0", "1"),
        ("delete", f"{KEY_PREFIX}/0"),
        ("set", f"{KEY_PREFIX}/1", "1"),
        ("delete", f"{KEY_PREFIX}/1"),
    ]


def test_receive_waits_through_an_idle_service_and_raises_anything_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = _Client(idle_waits=2)
    ch = _channel(monkeypatch, client)
    monkeypatch.setattr(Channel, "_broadcast", staticmethod(lambda payload: b"op"))
    assert ch.receive() == b"op"
    assert client.calls == [("get", f"{KEY_PREFIX}/0", str(WAIT_MS))] * 3
    assert ch.n == 1

    def broken(key: str, timeout_ms: int) -> str:
        raise RuntimeError("UNAVAILABLE: coordinator gone")

    client.blocking_key_value_get = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        ch.receive()
