"""Compiled temporary memory of the log-prob head, forward + backward w.r.t. the hidden states.

Compile only (jax.ShapeDtypeStruct inputs, ``.lower().compile().memory_analysis()``; nothing is
allocated or run) at T=16,384 tokens, H=5,120, V=248,320 on the local backend (CPU here):

  naive        log_softmax(hidden @ w) then take_along_axis (materializes [T, V] twice)
  token_tiled  the seed's custom VJP over token tiles only (vocab_chunk = V: one [tile, V] block)
  fused        token tiles x vocabulary chunks with an online logsumexp (one [tile, chunk] block)

JSON lines: metric temp_bytes per variant, naive_over_fused and naive_over_token_tiled per tile,
compile_s per compile. Run: ``.venv/bin/python bench/logprob_head_memory.py [--dtype bfloat16]``.
The head is frozen (LoRA): gradient w.r.t. hidden only (grad_w=False).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from rljob.trainer.logprobs import naive_token_logprobs, token_logprobs

T, H, V = 16_384, 5_120, 248_320


def temp_bytes(f: Callable[..., jax.Array], dtype: jnp.dtype) -> tuple[int, float]:
    def grad_hidden(h: jax.Array, w: jax.Array, t: jax.Array, g: jax.Array) -> jax.Array:
        return jax.grad(lambda hh: (f(hh, w, t) * g).sum())(h)

    args = (
        jax.ShapeDtypeStruct((T, H), dtype),
        jax.ShapeDtypeStruct((H, V), dtype),
        jax.ShapeDtypeStruct((T,), jnp.int32),
        jax.ShapeDtypeStruct((T,), jnp.float32),
    )
    t0 = time.perf_counter()
    compiled = jax.jit(grad_hidden).lower(*args).compile()
    elapsed = time.perf_counter() - t0
    return int(compiled.memory_analysis().temp_size_in_bytes), elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tiles", default="2048,512")
    ap.add_argument("--chunks", default="4096,8192,16384")
    a = ap.parse_args()
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
    emit("peak_rss_bytes", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, note="compile only")


if __name__ == "__main__":
    main()
