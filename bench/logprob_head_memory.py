"""Compiled memory of the log-prob head, forward + backward w.r.t. the hidden states.

Compile only (jax.ShapeDtypeStruct inputs, ``.lower().compile().memory_analysis()``; nothing is
allocated or run) at T=16,384 tokens a device, H=5,120, V=248,320 on the local backend (CPU here).

One device:

  naive        log_softmax(hidden @ w) then take_along_axis (materializes [T, V] twice)
  token_tiled  the seed's custom VJP over token tiles only (vocab_chunk = V: one [tile, V] block)
  fused        token tiles x vocabulary chunks with an online logsumexp (one [tile, chunk] block)

``--devices N`` (N forced CPU devices, mesh fsdp=N, the head weight laid out as MaxText's FSDP rules lay
it out: its H rows split over fsdp; N x T tokens, rows over fsdp), the two ways to run the fused head:

  gathered     each device scores its rows against the whole head (shard_map, the head replicated: XLA
               all-gathers [H, V] on every device), the trainer's head before the ring
  ring         the head's columns split over the devices (one all-to-all), blocks passed around the
               ring (rljob.trainer.logprobs.sharded_token_logprobs), the trainer's head now

JSON lines: metric temp_bytes per variant (per device), all_gather_bytes (per device: the all-gathers'
results in the compiled program), naive_over_fused / naive_over_token_tiled per tile,
gathered_over_ring, compile_s per compile. Run:
``.venv/bin/python bench/logprob_head_memory.py [--dtype bfloat16] [--devices 4]``.
The head is frozen (LoRA): gradient w.r.t. hidden only (grad_w=False).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import time
from collections.abc import Callable
from typing import Any

T, H, V = 16_384, 5_120, 248_320


def _compiled(f: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, float]:
    import jax

    t0 = time.perf_counter()
    compiled = jax.jit(f).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def temp_bytes(f: Callable[..., Any], dtype: Any) -> tuple[int, float]:
    import jax
    import jax.numpy as jnp

    def grad_hidden(h: jax.Array, w: jax.Array, t: jax.Array, g: jax.Array) -> jax.Array:
        dh: jax.Array = jax.grad(lambda hh: (f(hh, w, t) * g).sum())(h)
        return dh

    args = (
        jax.ShapeDtypeStruct((T, H), dtype),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((H, V), dtype),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((T,), jnp.int32),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((T,), jnp.float32),  # type: ignore[no-untyped-call]
    )
    compiled, elapsed = _compiled(grad_hidden, args)
    return int(compiled.memory_analysis().temp_size_in_bytes), elapsed


_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "pred": 1}


def _all_gather_bytes(hlo: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo):
        n = 1
        for d in (int(x) for x in dims.split(",") if x):
            n *= d
        total += n * _BYTES.get(dtype, 4)
    return total


def sharded(devices: int, dtype: Any, tile: int, chunk: int) -> dict[str, dict[str, float]]:
    """Per-device temporary bytes and all-gathered bytes of the two ways to run the head on ``devices``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from rljob.trainer.logprobs import head_spec, padded_vocab, sharded_token_logprobs, token_logprobs

    mesh = Mesh(np.array(jax.devices()[:devices]), ("fsdp",))
    rows = NamedSharding(mesh, P("fsdp"))  # type: ignore[no-untyped-call]
    vp = padded_vocab(V, devices)
    args = (
        jax.ShapeDtypeStruct((devices, T, H), dtype, sharding=NamedSharding(mesh, P("fsdp"))),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((H, vp), dtype, sharding=NamedSharding(mesh, P("fsdp", None))),  # type: ignore[no-untyped-call]  # FSDP layout
        jax.ShapeDtypeStruct((devices, T), jnp.int32, sharding=rows),  # type: ignore[no-untyped-call]
        jax.ShapeDtypeStruct((devices, T), jnp.float32, sharding=rows),  # type: ignore[no-untyped-call]
    )

    def local(h: jax.Array, w: jax.Array, t: jax.Array) -> jax.Array:
        lp = token_logprobs(
            h.reshape(-1, H), w, t.reshape(-1), token_tile=tile, vocab_chunk=chunk, grad_w=False
        )
        return lp.reshape(t.shape)

    gathered_head = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P("fsdp"), P(), P("fsdp")),  # type: ignore[no-untyped-call]
        out_specs=P("fsdp"),  # type: ignore[no-untyped-call]
        check_vma=False,
    )
    ring_head = sharded_token_logprobs(mesh, ("fsdp", None), None, V, token_tile=tile, vocab_chunk=chunk)

    def ring(h: jax.Array, w: jax.Array, t: jax.Array) -> jax.Array:
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, head_spec(("fsdp",))))  # type: ignore[no-untyped-call]
        return ring_head(h, w, t, jnp.ones(t.shape, bool))

    out: dict[str, dict[str, float]] = {}
    for name, f in (("gathered", gathered_head), ("ring", ring)):

        def grad_hidden(h: jax.Array, w: jax.Array, t: jax.Array, g: jax.Array, f: Any = f) -> jax.Array:
            dh: jax.Array = jax.grad(lambda hh: (f(hh, w, t) * g).sum())(h)
            return dh

        compiled, elapsed = _compiled(grad_hidden, args)
        mem = compiled.memory_analysis()
        out[name] = {
            "temp_bytes": float(mem.temp_size_in_bytes),
            "argument_bytes": float(mem.argument_size_in_bytes),
            "all_gather_bytes": float(_all_gather_bytes(compiled.as_text())),
            "compile_s": round(elapsed, 2),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tiles", default="2048,512")
    ap.add_argument("--chunks", default="4096,8192,16384")
    ap.add_argument("--devices", type=int, default=1, help="> 1: also the head on a mesh of N CPU devices")
    a = ap.parse_args()
    if a.devices > 1:  # before JAX starts: the device count is fixed then
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={a.devices}"
        )
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    from rljob.trainer.logprobs import naive_token_logprobs, token_logprobs

    dtype = jnp.dtype(a.dtype)
    ctx = {"T": T, "H": H, "V": V, "dtype": a.dtype, "backend": jax.default_backend()}

    def emit(metric: str, value: float, **kw: object) -> None:
        print(
            json.dumps({"bench": "logprob_head_memory", "metric": metric, "value": value, **ctx, **kw}),
            flush=True,
        )

    naive, s = temp_bytes(naive_token_logprobs, dtype)
    emit("temp_bytes", naive, variant="naive", compile_s=round(s, 2))
    for tile in (int(x) for x in a.tiles.split(",")):
        tok, s = temp_bytes(
            lambda h, w, t, tile=tile: token_logprobs(h, w, t, token_tile=tile, vocab_chunk=V, grad_w=False),
            dtype,
        )
        emit("temp_bytes", tok, variant="token_tiled", tile=tile, compile_s=round(s, 2))
        emit("naive_over_token_tiled", round(naive / tok, 2), tile=tile)
        for chunk in (int(x) for x in a.chunks.split(",")):
            fused, s = temp_bytes(
                lambda h, w, t, tile=tile, chunk=chunk: token_logprobs(
                    h, w, t, token_tile=tile, vocab_chunk=chunk, grad_w=False
                ),
                dtype,
            )
            emit("temp_bytes", fused, variant="fused", tile=tile, vocab_chunk=chunk, compile_s=round(s, 2))
            emit("naive_over_fused", round(naive / fused, 2), tile=tile, vocab_chunk=chunk)
    if a.devices > 1:
        tile, chunk = int(a.tiles.split(",")[0]), int(a.chunks.split(",")[1 if "," in a.chunks else 0])
        got = sharded(a.devices, dtype, tile, chunk)
        for name, m in got.items():
            for metric in ("temp_bytes", "argument_bytes", "all_gather_bytes"):
                emit(
                    metric,
                    m[metric],
                    variant=name,
                    devices=a.devices,
                    tile=tile,
                    vocab_chunk=chunk,
                    compile_s=m["compile_s"],
                    per="device",
                )
        emit(
            "gathered_over_ring",
            round(got["gathered"]["temp_bytes"] / got["ring"]["temp_bytes"], 2),
            devices=a.devices,
            of="temp_bytes",
        )
    emit("peak_rss_bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, note="compile only")


if __name__ == "__main__":
    main()
