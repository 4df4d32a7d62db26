"""Loopback ports for the processes a local run starts (the CPU loop, `rljob drill`, the tests).

A port asked of the kernel with ``bind(0)`` comes from the ephemeral range, the same range every
outgoing connection takes its source port from: between the probe and the child's own bind, another
process's connection can take it (the sampler then dies on ``EADDRINUSE``). So ports are drawn at random
from below the ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by
default), probed, and never handed out twice by one process. ``span`` reserves consecutive ports (the
sampler serves on ``port`` and its adapter agent on ``port + 1``).
"""

from __future__ import annotations

import random
import socket
import threading

_LOW, _HIGH = 15000, 32000
_given: set[int] = set()
_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A loopback port ``p`` such that ``p .. p + span - 1`` are all free now and none was handed out
    before by this process."""
    rng = random.SystemRandom()
    with _lock:
        for _ in range(2000):
            port = rng.randrange(_LOW, _HIGH - span)
            ports = range(port, port + span)
            if any(p in _given for p in ports) or not all(_bindable(p) for p in ports):
                continue
            _given.update(ports)
            return port
    raise OSError(f"no {span} consecutive free loopback ports in {_LOW}-{_HIGH}")
