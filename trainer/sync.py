"""Process barriers of a multi-process trainer (imports JAX only when called, so the entrypoint can set
libtpu's environment before JAX starts)."""

from __future__ import annotations

__all__ = ["align"]


def align(name: str, timeout_s: int = 900) -> None:
    """Every process of a multi-process run reaches this point before any goes on (the coordination
    service's barrier, ``timeout_s`` long). On CPU, gloo gives each collective's first use a fixed deadline
    to find its peers; processes that reach it minutes apart (one still importing MaxText on a loaded
    machine) fail it (``Gloo context initialization failed: DEADLINE_EXCEEDED``). TPUs do not use gloo;
    the barrier costs them one round trip."""
    import jax

    if jax.process_count() > 1:
        from jax._src import distributed  # the client jax.distributed.initialize made

        client = distributed.global_state.client
        if client is not None:
            client.wait_at_barrier(name, timeout_in_ms=timeout_s * 1000)
