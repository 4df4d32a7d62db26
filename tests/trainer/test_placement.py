"""Arrays onto the trainer's mesh (rljob.trainer.placement): put_global lays out a value as a global array
in the sharding asked for, keeps one already so, and places typed PRNG keys by their key data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from rljob.trainer.placement import lay_out, put_global


def _sharding(spec: P | None = None) -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()[:1]), ("fsdp",)), spec or P())  # type: ignore[no-untyped-call]


def test_a_host_array_becomes_a_global_array_in_the_sharding() -> None:
    sharding = _sharding(P("fsdp"))  # type: ignore[no-untyped-call]
    x = np.arange(8, dtype=np.float32)
    got = put_global(x, sharding)
    assert isinstance(got, jax.Array)
    assert got.sharding == sharding
    np.testing.assert_array_equal(np.asarray(got), x)


def test_an_array_in_the_very_sharding_is_returned_as_is() -> None:
    sharding = _sharding()
    x = jax.device_put(jnp.ones(4), sharding)
    assert put_global(x, sharding) is x


def test_a_typed_prng_key_keeps_its_implementation_and_value() -> None:
    key = jax.random.key(7)
    got = put_global(key, _sharding())
    assert jnp.issubdtype(got.dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(got) == jax.random.key_impl(key)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)), np.asarray(jax.random.key_data(key)))


def test_a_traced_value_is_constrained_not_placed() -> None:
    sharding = _sharding()
    out = jax.jit(lambda a: put_global(a, sharding) * 2)(jnp.arange(3.0))
    np.testing.assert_array_equal(np.asarray(out), [0.0, 2.0, 4.0])


def test_lay_out_keeps_what_has_no_format() -> None:
    tree = {"a": jnp.ones(2), "b": np.zeros(3)}
    got = lay_out(tree, {"a": None, "b": None})
    assert got["a"] is tree["a"] and got["b"] is tree["b"]
