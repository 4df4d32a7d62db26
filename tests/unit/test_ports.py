"""rljob.common.ports: ports below the ephemeral range, each span free, never handed out twice."""

from __future__ import annotations

import socket

import pytest
from rljob.common.ports import free_port


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except OSError:
        return 32768


@pytest.mark.parametrize("span", [1, 2, 5])
def test_spans_are_free_distinct_and_below_the_ephemeral_range(span: int) -> None:
    got = [free_port(span) for _ in range(50)]
    taken = [p for base in got for p in range(base, base + span)]
    assert len(taken) == len(set(taken))  # no port handed out twice, spans do not overlap
    assert all(p + span <= _ephemeral_low() for p in got)
    for p in taken[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free


def test_a_port_in_use_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import rljob.common.ports as ports

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        used: int = busy.getsockname()[1]
        busy.listen()
        # Force the draw onto the busy port first, then onto others: the busy one is skipped. The later
        # draws walk away from it (any one of them can be taken by another process on a shared machine).
        others = [*range(used + 2, 65535), *range(used - 2, 1024, -1)]
        draws = iter([used, *others])
        drawn: list[int] = []
        monkeypatch.setattr(ports, "_LOW", 1024)
        monkeypatch.setattr(ports, "_HIGH", 65535)

        class R:
            def randrange(self, lo: int, hi: int) -> int:
                drawn.append(next(draws))
                return drawn[-1]

        monkeypatch.setattr(ports.random, "SystemRandom", lambda: R())
        got = free_port()
        assert drawn[0] == used  # the busy port was drawn first ...
        assert got != used and len(drawn) >= 2  # ... and passed over


def test_no_module_draws_a_local_port_from_the_ephemeral_range() -> None:
    """``bind(("127.0.0.1", 0))`` hands out an ephemeral port that an outgoing connection can take before
    the child binds it (a sampler, or a local Ray head, then dies on EADDRINUSE): every module that picks
    a port for another process takes it from rljob.common.ports. The only ``bind(.., 0)`` left are in
    tests that hold the socket they bind."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(r"\.bind\(\(\s*['\"][^'\"]*['\"]\s*,\s*0\s*\)\)")
    dirs = ["cli", "operator", "recipes", "sampler", "trainer", "hack", "bench", "tests/fixtures"]
    offenders = [
        f"{path.relative_to(root)}:{n}"
        for d in dirs
        for path in sorted((root / d).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == [], offenders
