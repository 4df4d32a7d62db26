"""Arrays onto the trainer's mesh (rljob.trainer.placement): put_global lays out a value as a global array
in the sharding asked for, keeps one already so, and places typed PRNG keys by their key data."""

from __future__ import annotations

from typing import Any

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


def _formats() -> tuple[dict[str, jax.Array], dict[str, Any]]:
    from jax.experimental.layout import Format, Layout

    s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    w = jnp.arange(24.0).reshape(4, 6)
    tree = {"w": w, "tied": w, "b": jnp.arange(60.0).reshape(3, 4, 5), "v": jnp.arange(5.0)}
    column = Format(Layout(major_to_minor=(1, 0)), s)  # neither this nor the next is the CPU's default
    formats = {"w": column, "tied": column, "b": Format(Layout(major_to_minor=(0, 2, 1)), s), "v": None}
    return tree, formats


def test_lay_out_releases_what_it_copied_when_handed_the_tree() -> None:
    """release=True: every array whose layout changed is deleted once copied (the trainer's base is laid
    out beside its largest weight, not beside a second copy of itself); one kept as it is stays, and an
    array the tree holds twice (tied weights) is copied once."""
    tree, formats = _formats()
    want = {k: np.asarray(v) for k, v in tree.items()}
    got = lay_out(tree, formats, release=True)
    assert tree["w"].is_deleted() and tree["b"].is_deleted()
    assert not tree["v"].is_deleted() and got["v"] is tree["v"]
    assert got["tied"] is got["w"]
    assert got["w"].format.layout.major_to_minor == (1, 0)
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v)


def test_lay_out_keeps_the_callers_tree_by_default() -> None:
    tree, formats = _formats()
    got = lay_out(tree, formats)
    assert not any(x.is_deleted() for x in tree.values())
    assert got["w"] is not tree["w"] and got["w"].format.layout.major_to_minor == (1, 0)
