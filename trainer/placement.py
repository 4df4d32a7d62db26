"""Arrays onto the trainer's mesh: :func:`put_global` lays a value every process holds out as a global
array (on several processes ``jax.device_put`` cannot place a local array on other processes' devices).
Where each parameter goes (MaxText's logical axis rules) is rljob.trainer.base_checkpoint's
``logical_shardings``; :class:`rljob.trainer.model.Policy` places its base and LoRA parameters with both.
:func:`lay_out` puts arrays in the memory layouts a compiled program chose for them (the train step's
frozen base weights: rljob.trainer.train_step); :func:`abstract` gives a tree's shapes placed as the arrays
would be, what a program is lowered with before any array exists.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["abstract", "lay_out", "put_global"]


def put_global(x: Any, sharding: NamedSharding) -> Any:
    """``x``, an array with the same value on every process (local, or global and replicated), as a global
    array laid out by ``sharding`` (on several processes ``jax.device_put`` cannot place a local array
    on other processes' devices: each process supplies its own devices' shards). An array already laid
    out so is returned as is; a traced one (``jax.eval_shape`` of the trainer's state, the compile stage)
    is constrained to ``sharding``."""
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)  # type: ignore[no-untyped-call]
    if not isinstance(x, jax.Array):
        x = jnp.asarray(x)
    if x.sharding == sharding:  # the very sharding: jit's cache keys on it (an equivalent one recompiles)
        return x
    if x.is_fully_addressable and sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    if not x.is_fully_addressable and not x.sharding.is_fully_replicated:
        # A global array laid out otherwise (build_model's come sharded): no process holds it whole,
        # reshard it on the devices (an identity under jit).
        return jax.jit(lambda a: a, out_shardings=sharding)(x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed PRNG keys: place their key data
        data = jax.random.key_data(x)
        spec = tuple(sharding.spec) + (None,) * (data.ndim - len(sharding.spec))
        return jax.random.wrap_key_data(
            put_global(data, NamedSharding(sharding.mesh, P(*spec))),  # type: ignore[no-untyped-call]
            impl=jax.random.key_impl(x),
        )
    host = np.asarray(x if x.is_fully_addressable else x.addressable_data(0))
    return jax.make_array_from_callback(x.shape, sharding, lambda index: host[index])


def lay_out(tree: Any, formats: Any, *, release: bool = False) -> Any:
    """``tree``'s arrays in ``formats`` (a compiled program's ``input_formats`` for them: sharding and
    memory layout). An array already so is kept as is; another is copied into its format, one at a time,
    under jit on the devices (so on several processes too); an array that appears twice is copied once.
    While the caller holds ``tree`` the copies add up to every array that changes, beside the tree.
    ``release``: the caller hands ``tree`` over, and each array that changed is deleted once its copy is
    made, so laying out needs only the largest array's bytes beside the tree."""
    from jax.experimental.layout import Format

    done: dict[int, Any] = {}

    def put(x: Any, f: Any) -> Any:
        if not isinstance(f, Format) or f.layout is None or getattr(x, "format", None) == f:
            return x
        if id(x) in done:
            return done[id(x)]
        out = jax.jit(lambda a: a, out_shardings=f)(x)
        if release:
            out.block_until_ready()
            x.delete()
        done[id(x)] = out
        return out

    return jax.tree.map(put, tree, formats)


def abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of ``tree`` (arrays or shapes) placed by ``shardings``: a prefix tree of
    NamedShardings (as the Trainer's jit shardings are), or a tree of a compiled program's ``input_formats``
    (sharding and memory layout: the arguments of a program that reads arrays :func:`lay_out` put in them)."""
    from jax.experimental.layout import Format

    def place(s: Any, sub: Any) -> Any:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),  # type: ignore[no-untyped-call]
            sub,
        )

    return jax.tree.map(place, shardings, tree, is_leaf=lambda s: isinstance(s, (NamedSharding, Format)))
