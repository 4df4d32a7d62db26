"""The base weights are created sharded: no device ever holds a whole random initialization.

``build_model`` traces the MaxText Transformer abstractly (``nnx.eval_shape``), then either restores
``spec.model.checkpoint`` straight into the sharded abstract target or initializes inside a jit whose
out_shardings are MaxText's logical shardings. Checked on four forced CPU devices (fsdp=4, a subprocess:
the device count is fixed when JAX starts):

- with a checkpoint: the Policy's base weights equal the checkpoint's bit for bit; no initializer ever
  produced a concrete array (the normal/truncated_normal/uniform draws of jax's initializers, which every
  MaxText weight initializer uses, only ran on tracers), and when the restore ran its target held only
  ShapeDtypeStructs carrying the logical shardings while no array of any weight's shape was alive;
- without one: under ``jax.transfer_guard("disallow_explicit")`` (no host or device transfer at all),
  every base array comes out with the logical NamedSharding, each of the four devices holding one shard
  of the full shape divided as the rules say (the big kernels and the embedding four ways along fsdp);
  again no initializer ran concretely; the values equal an eager initialization with the same seed;
- on one device (this process): same-seed initialization gives the very values of an eager
  ``models.Transformer`` (what ``build_model`` was before), so existing seeds keep their meaning.

On the eager construction (the code before this change) the four-device checks fail: the initializers
run concretely and every weight lies whole on one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.jax

SCRIPT = textwrap.dedent(
    """
    import gc, json, sys
    import jax, numpy as np
    from flax import nnx

    # Every MaxText weight initializer draws through these (jax.nn.initializers calls jax._src.random's);
    # count the draws that produced concrete arrays (eager initialization), not tracers (eval_shape, jit).
    import jax._src.random as jax_random
    concrete = {"n": 0}
    for name in ("normal", "truncated_normal", "uniform"):
        def wrap(f):
            def drawn(*a, **k):
                out = f(*a, **k)
                if not isinstance(out, jax.core.Tracer):
                    concrete["n"] += 1
                return out
            return drawn
        for module in (jax_random, jax.random):
            setattr(module, name, wrap(getattr(jax_random, name)))

    from maxtext.common import checkpointing
    from rljob.trainer.base_checkpoint import logical_shardings, save_converted_checkpoint
    from rljob.trainer.model import ModelSpec, Policy, build_model, maxtext_config, tiny_keys

    keys = tiny_keys(ici_fsdp_parallelism=4)
    cfg = maxtext_config(keys)

    def flat(tree):
        return {
            "/".join(str(getattr(k, "key", k)) for k in kp): v
            for kp, v in jax.tree_util.tree_flatten_with_path(tree)[0]
        }

    def layout(arrays, shardings):
        out = {}
        for name, a in arrays.items():
            shards = {tuple(s.data.shape) for s in a.addressable_shards}
            devices = {s.device.id for s in a.addressable_shards}
            want = shardings[name].shard_shape(a.shape)
            out[name] = {
                "shape": list(a.shape), "spec": [str(x) for x in getattr(a.sharding, "spec", ())],
                "sharding_ok": a.sharding == shardings[name], "shards": [list(s) for s in shards],
                "want": list(want), "devices": len(devices),
            }
        return out

    out = {"devices": jax.device_count()}

    # (b) no checkpoint: every array created sharded, no transfer, no concrete initializer.
    with jax.transfer_guard("disallow_explicit"):
        model = build_model(cfg, 5)
    out["random_concrete_draws"] = concrete["n"]
    params = nnx.state(model, nnx.Param)
    want = flat(nnx.to_pure_dict(logical_shardings(params, cfg)))
    got = flat(nnx.to_pure_dict(params))
    out["random"] = layout(got, want)
    from maxtext.models import models
    eager = models.Transformer(
        cfg, model.mesh, quant=None, rngs=nnx.Rngs(params=5, dropout=6, aqt=7), model_mode="train"
    )
    ref = flat(nnx.state(eager, nnx.Param).to_pure_dict())
    out["random_equals_eager"] = all(np.array_equal(np.asarray(got[n]), np.asarray(ref[n])) for n in ref)
    shapes = nnx.state(nnx.eval_shape(lambda: build_model(cfg, 0)), nnx.Param).to_pure_dict()
    del model, params, got, eager, ref
    gc.collect()

    # (a) checkpoint: restored into the sharded abstract target, never randomly initialized.
    rng = np.random.default_rng(7)
    values = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32) * 0.1, shapes)
    path = save_converted_checkpoint(sys.argv[1], values, cfg)
    gc.collect()
    weight_shapes = {(tuple(v.shape), np.dtype(np.float32)) for v in flat(values).values()}
    seen = {}
    load = checkpointing.load_params_from_path

    def spy(path, target, *a, **k):
        leaves = jax.tree_util.tree_leaves(target)
        seen["abstract"] = all(type(x) is jax.ShapeDtypeStruct for x in leaves)
        seen["sharded"] = all(getattr(x.sharding, "mesh", None) is not None for x in leaves)
        seen["live_weights"] = sorted(
            str(a.shape) for a in jax.live_arrays() if (tuple(a.shape), a.dtype) in weight_shapes
        )
        return load(path, target, *a, **k)

    checkpointing.load_params_from_path = spy
    concrete["n"] = 0
    policy = Policy(ModelSpec(maxtext=keys, seed=5, checkpoint=path))
    out["ckpt_concrete_draws"] = concrete["n"]
    out["restore"] = seen
    got = flat(nnx.to_pure_dict(policy.base.filter(nnx.Param)))
    want = flat(nnx.to_pure_dict(logical_shardings(policy.base.filter(nnx.Param), cfg)))
    out["ckpt"] = layout(got, want)
    out["ckpt_equal"] = {n: bool(np.array_equal(np.asarray(got[n]), v)) for n, v in flat(values).items()}
    print(json.dumps(out))
    """
)

OLD_CODE = os.environ.get("RLJOB_TEST_MODEL_PY")  # only to show the checks fail on another model.py


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sharded-init")
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONSAFEPATH": "1",
    }
    code = SCRIPT
    if OLD_CODE:
        code = (
            "import importlib.util, sys\n"
            f"s = importlib.util.spec_from_file_location('rljob.trainer.model', {OLD_CODE!r})\n"
            "m = importlib.util.module_from_spec(s); sys.modules['rljob.trainer.model'] = m\n"
            "s.loader.exec_module(m)\n" + SCRIPT
        )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp / "tiny-qwen3")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    return out


def _assert_sharded(params: dict[str, Any]) -> None:
    assert len(params) == 14
    for name, p in params.items():
        # The logical sharding, each of the four devices holding one shard of the rules' shard shape.
        assert p["sharding_ok"] and p["devices"] == 4 and p["shards"] == [p["want"]], (name, p)
    split = {n for n, p in params.items() if "fsdp" in p["spec"]}
    big = {n for n in params if n.endswith(("kernel", "embedding"))}
    assert big <= split, sorted(big - split)
    for name in split:
        p = params[name]
        axis = p["spec"].index("fsdp")
        assert p["want"][axis] * 4 == p["shape"][axis], (name, p)


def test_checkpoint_is_restored_into_the_sharded_abstract_model(four_devices: dict[str, Any]) -> None:
    out = four_devices
    assert out["ckpt_concrete_draws"] == 0, out["ckpt_concrete_draws"]
    assert out["restore"] == {"abstract": True, "sharded": True, "live_weights": []}, out["restore"]
    assert len(out["ckpt_equal"]) == 14 and all(out["ckpt_equal"].values()), out["ckpt_equal"]
    _assert_sharded(out["ckpt"])


def test_random_initialization_is_created_sharded(four_devices: dict[str, Any]) -> None:
    out = four_devices
    assert out["random_concrete_draws"] == 0, out["random_concrete_draws"]
    _assert_sharded(out["random"])
    assert out["random_equals_eager"]


def test_same_seed_gives_the_eager_values_on_one_device() -> None:
    """build_model's jit initialization draws what the eager construction drew, RNG streams included."""
    from flax import nnx
    from maxtext.models import models
    from rljob.trainer.model import build_model, maxtext_config, tiny_keys

    cfg = maxtext_config(tiny_keys(vocab_size=32, max_target_length=32))
    built = build_model(cfg, 3)
    eager = models.Transformer(
        cfg, built.mesh, quant=None, rngs=nnx.Rngs(params=3, dropout=4, aqt=5), model_mode="train"
    )

    def flat(model: Any) -> dict[str, np.ndarray]:
        def value(x: Any) -> np.ndarray:
            return np.asarray(
                jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            )

        return {
            jax.tree_util.keystr(kp): value(v)
            for kp, v in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
        }

    have, want = flat(built), flat(eager)
    assert set(have) == set(want) and len(want) == 26  # 14 weights, 12 RNG keys and counts
    for name, v in want.items():
        np.testing.assert_array_equal(have[name], v, err_msg=name)
        assert have[name].dtype == v.dtype
    assert float(np.abs(have["['decoder']['logits_dense']['kernel'].value"]).max()) > 0
