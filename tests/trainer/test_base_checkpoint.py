"""spec.model.checkpoint: the frozen base weights from a converted MaxText checkpoint.

A checkpoint of the CPU loop's tiny model is written on the GCS emulator exactly as MaxText's conversion
writes one (to_maxtext's Linen parameter tree, save_weights_to_checkpoint: ``{dir}/0/items``, weights
under ``params/params``), with random values no initialization produces. A Policy built with another
seed loads it: every base parameter equals the saved one. The CPU sampler (built by the sampler's own
code path from the same run config) serves the same weights: the step-0 parity gate passes against it
and fails against a sampler without the checkpoint. Broken checkpoints (a wrong shape, a missing weight,
no such path, the conversion's output directory instead of its step) are refused with the field named,
and the trainer, loop and sampler entrypoints exit 2 with one line. On four CPU devices (fsdp=4) the
weights come back sharded as MaxText's logical rules say.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from fixtures.cpu_sampler import serve_cpu_sampler
from fixtures.trainer_run import local_run_config, write_run_config
from flax import nnx
from rljob.common.storage import open_store
from rljob.recipes.failure import EXIT_BAD_CONFIG
from rljob.recipes.runconfig import RunConfig

pytestmark = pytest.mark.jax


def _base_params(policy: Any) -> dict[str, Any]:
    """The frozen nnx.Param weights of a Policy (LoRA parameters are split off) as a nested dict."""
    return nnx.to_pure_dict(policy.base.filter(nnx.Param))


def _flat(tree: Any) -> dict[str, np.ndarray]:
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
        for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _random_like(params: dict[str, Any], seed: int) -> dict[str, Any]:
    """Values of the same shapes no initializer produces: N(0, 0.1), norm scales around 1."""
    rng = np.random.default_rng(seed)

    def draw(path: Any, x: Any) -> np.ndarray:
        v: np.ndarray = 0.1 * rng.standard_normal(np.shape(x)).astype(np.float32)
        return v + 1.0 if str(getattr(path[-1], "key", "")) == "scale" else v

    return jax.tree_util.tree_map_with_path(draw, params)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def converted(gcs_emulator: Any, cpu_policy: Any) -> tuple[str, dict[str, Any]]:
    """(load path gs://.../0/items, saved values) of the CPU loop's tiny model, converted layout."""
    from rljob.trainer.base_checkpoint import save_converted_checkpoint

    values = _random_like(_base_params(cpu_policy), seed=42)
    bucket = gcs_emulator.new_bucket("ckpt")
    path = save_converted_checkpoint(f"gs://{bucket}/tiny-qwen3", values, cpu_policy.cfg)
    return path, values


@pytest.fixture(scope="module")
def loaded(converted: tuple[str, dict[str, Any]]) -> Any:
    """The trainer's side: the CPU loop's tiny Policy built with seed 1, base weights from the checkpoint."""
    from rljob.trainer.model import Policy
    from rljob.trainer.tinypolicy import cpu_model_spec

    return Policy(cpu_model_spec(8, 16.0, checkpoint=converted[0], seed=1))


def _write_broken(gcs_emulator: Any, cpu_policy: Any, name: str, tree: dict[str, Any]) -> str:
    """``tree`` saved with MaxText's conversion writer as is (no check against the Linen tree)."""
    from maxtext.checkpoint_conversion.utils.utils import save_weights_to_checkpoint

    cfg = cpu_policy.cfg
    out = f"gs://{gcs_emulator.new_bucket('broken')}/{name}"
    save_weights_to_checkpoint(
        out, {"params": tree}, 1, cfg.checkpoint_storage_use_ocdbt, cfg.checkpoint_storage_use_zarr3
    )
    return f"{out}/0/items"


def _config_with_checkpoint(tmp_path: Path, bucket: str, checkpoint: str) -> Path:
    """A resolved run config (storage on the emulator) whose spec.model.checkpoint is ``checkpoint``."""
    rc = local_run_config(bucket, tmp_path)
    data = json.loads(rc.model_dump_json(by_alias=True))
    data["spec"]["model"]["checkpoint"] = checkpoint
    return write_run_config(RunConfig.model_validate(data), tmp_path)


# ------------------------------------------------------------------------------------- loading


def test_checkpoint_has_the_converted_layout(
    converted: tuple[str, dict[str, Any]], gcs_emulator: Any
) -> None:
    """What MaxText's conversion leaves: step 0, item ``items``, the weights under params/params."""
    from orbax.checkpoint import v1 as ocp

    path, values = converted
    bucket, _, prefix = path[len("gs://") :].partition("/")
    names = set(open_store(f"gs://{bucket}").list())
    step = prefix.removesuffix("/items")
    assert {f"{step}/_CHECKPOINT_METADATA", f"{prefix}/_METADATA", f"{prefix}/commit_success.txt"} <= names
    tree = ocp.metadata(f"gs://{bucket}/{step}", checkpointable_name="items").metadata
    stored = {
        "/".join(str(getattr(k, "key", k)) for k in kp): tuple(m.shape)
        for kp, m in jax.tree_util.tree_flatten_with_path(
            tree["params"]["params"], is_leaf=lambda x: hasattr(x, "shape")
        )[0]
    }
    assert stored == {k: v.shape for k, v in _flat(values).items()}


def test_every_base_parameter_equals_the_saved_one(
    converted: tuple[str, dict[str, Any]], loaded: Any
) -> None:
    _, values = converted
    want, have = _flat(values), _flat(_base_params(loaded))
    assert set(have) == set(want) and len(want) == 14
    for name, v in want.items():
        np.testing.assert_array_equal(have[name], v, err_msg=name)
        assert have[name].dtype == np.float32
    # LoRA went on top of the loaded weights: the adapter still starts as a no-op, the forward pass runs.
    assert loaded.peft.lora_paths() and all(
        float(np.abs(np.asarray(x)).max()) == 0.0
        for (_, which), x in zip(
            loaded.peft.lora_paths(), jax.tree_util.tree_leaves(loaded.lora0), strict=True
        )
        if which == "b"
    )
    toks = np.asarray([[1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
    lp = np.asarray(
        loaded.next_token_logprobs(loaded.lora0, toks, np.arange(8, dtype=np.int32)[None], np.ones_like(toks))
    )
    assert np.isfinite(lp).all() and lp[0, 0] == 0.0 and (lp[0, 1:] < 0).all()


def test_cpu_sampler_serves_the_checkpoint_weights(
    converted: tuple[str, dict[str, Any]],
    loaded: Any,
    cpu_sampler: tuple[str, Any],
    gcs_emulator: Any,
    tmp_path: Path,
) -> None:
    """The sampler builds its policy from the same run config (seed 0, like every CPU sampler): the parity
    gate passes against the loaded trainer; against a sampler without the checkpoint it refuses."""
    from rljob.sampler.adapters import AdapterStore, AdapterWatcher, LoraEndpoint
    from rljob.sampler.main import cpu_policy as sampler_policy
    from rljob.trainer.data import SuccessorTask
    from rljob.trainer.export import publish_adapter
    from rljob.trainer.rollouts import ParityError, SamplerSource
    from rljob.trainer.sampler_client import SamplerClient

    path, values = converted
    bucket = f"gs://{gcs_emulator.new_bucket()}"
    rc = RunConfig.load(_config_with_checkpoint(tmp_path, bucket, path))
    served = sampler_policy(rc)
    assert served.spec.seed != loaded.spec.seed and served.spec.checkpoint == path
    for name, v in _flat(values).items():
        np.testing.assert_array_equal(_flat(_base_params(served))[name], v, err_msg=name)

    uri = f"{bucket}/adapters"
    publish_adapter(uri, 0, loaded.peft.to_peft(loaded.lora0), loaded.peft.config())

    def gate(url: str) -> tuple[list[dict[str, Any]], BaseException | None]:
        AdapterWatcher(AdapterStore(uri), LoraEndpoint(url), tmp_path / url[-5:], "job").poll_once()
        lines: list[dict[str, Any]] = []
        src = SamplerSource(
            SamplerClient([url], "job"),
            SuccessorTask(),
            steps=1,
            group_size=4,
            groups_per_batch=3,
            logprobs=jax.jit(loaded.next_token_logprobs),
            emit=lines.append,
        )
        try:
            src(0, loaded.lora0)
            return lines, None
        except ParityError as e:
            return lines, e
        finally:
            src.close()

    with serve_cpu_sampler(served) as (url, _):
        lines, err = gate(url)
    assert err is None and lines[0]["event"] == "parity", (lines, err)
    assert lines[0]["mean_abs_logprob_diff"] < 1e-5
    # The session's CPU sampler has the random seed-0 weights: the gate must refuse it.
    lines, err = gate(cpu_sampler[0])
    assert isinstance(err, ParityError) and lines[0]["mean_abs_logprob_diff"] > 1e-2


SHARDED = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from flax import nnx
    from rljob.trainer.base_checkpoint import save_converted_checkpoint
    from rljob.trainer.model import ModelSpec, Policy, build_model, maxtext_config, tiny_keys

    keys = tiny_keys(ici_fsdp_parallelism=4)
    cfg = maxtext_config(keys)
    shapes = nnx.state(nnx.eval_shape(lambda: build_model(cfg, 0)), nnx.Param).to_pure_dict()
    rng = np.random.default_rng(7)
    values = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32) * 0.1, shapes)
    path = save_converted_checkpoint(sys.argv[1], values, cfg)
    policy = Policy(ModelSpec(maxtext=keys, seed=5, checkpoint=path))
    got = nnx.to_pure_dict(policy.base.filter(nnx.Param))
    out = {"devices": jax.device_count(), "equal": True, "params": {}}
    for (kp, a), (_, v) in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_flatten_with_path(values)[0]
    ):
        name = "/".join(str(k.key) for k in kp)
        out["equal"] &= bool(np.array_equal(np.asarray(a), v))
        out["params"][name] = {
            "spec": [str(x) for x in a.sharding.spec],
            "shape": list(a.shape),
            "shard": list(a.addressable_shards[0].data.shape),
        }
    toks = np.ones((4, 8), np.int32)
    pos = np.tile(np.arange(8, dtype=np.int32), (4, 1))
    lp = jax.jit(policy.next_token_logprobs)(policy.lora0, toks, pos, toks)
    out["forward_finite"] = bool(np.isfinite(np.asarray(lp)).all())
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_restores_into_the_sharded_parameters(tmp_path: Path) -> None:
    """Four CPU devices, fsdp=4 (a subprocess: the device count is fixed at JAX start; a local directory):
    every weight comes back with the saved values, laid out as MaxText's logical rules shard it (the big
    kernels split four ways along fsdp), and the jitted forward pass with LoRA runs on them."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONSAFEPATH": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED, str(tmp_path / "tiny-qwen3")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4 and out["equal"] and out["forward_finite"], out
    params = out["params"]
    assert len(params) == 14
    split = {n for n, p in params.items() if "fsdp" in p["spec"]}
    big = {n for n in params if n.endswith(("kernel", "embedding"))}
    assert big <= split, sorted(big - split)
    for name in split:
        p = params[name]
        axis = p["spec"].index("fsdp")
        assert p["shard"][axis] * 4 == p["shape"][axis], (name, p)


# ------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("case", ["wrong_shape", "missing_weight", "no_such_path", "conversion_dir"])
def test_broken_checkpoints_are_refused_naming_the_field(
    case: str, converted: tuple[str, dict[str, Any]], loaded: Any, cpu_policy: Any, gcs_emulator: Any
) -> None:
    import copy

    from rljob.trainer.base_checkpoint import CheckpointError, check_checkpoint_path, restore_base_params

    path, values = converted
    if case == "wrong_shape":
        tree = copy.deepcopy(values)
        tree["decoder"]["logits_dense"]["kernel"] = np.zeros((64, 33), np.float32)
        path, expect = (
            _write_broken(gcs_emulator, cpu_policy, case, tree),
            [
                "decoder/logits_dense/kernel",
                "(64, 33)",
                "(64, 32)",
            ],
        )
    elif case == "missing_weight":
        tree = copy.deepcopy(values)
        del tree["decoder"]["layers"]["mlp"]["wo"]
        path, expect = (
            _write_broken(gcs_emulator, cpu_policy, case, tree),
            ["decoder/layers/mlp/wo/kernel", "missing"],
        )
    elif case == "no_such_path":
        path, expect = path.replace("tiny-qwen3", "no-such-model"), ["nothing at this path"]
    else:
        path = path.removesuffix("/0/items")
        expect = ["not a MaxText checkpoint step", f"{path}/0/items"]
    with pytest.raises(CheckpointError) as info:
        check_checkpoint_path(path)
        restore_base_params(path, loaded.base.filter(nnx.Param), loaded.cfg)
    msg = str(info.value)
    assert msg.startswith(f"spec.model.checkpoint: {path}: ") and "\n" not in msg, msg
    for part in expect:
        assert part in msg, msg


def test_trainer_entrypoint_exits_2_on_a_checkpoint_of_another_model(
    converted: tuple[str, dict[str, Any]], gcs_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """rljob-trainer --model tiny builds the 256-token tiny model; the checkpoint is the CPU loop's
    32-token one: refused, one line naming the field and the weights, no traceback."""
    from rljob.trainer.main import main

    cfg = _config_with_checkpoint(tmp_path, gcs_bucket, converted[0])
    rc = ["--config", str(cfg), "--model", "tiny", "--rollouts", "synthetic", "--steps", "1"]
    assert main(rc) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rljob-trainer: spec.model.checkpoint: {converted[0]}: "), err
    assert "token_embedder/embedding" in err[0] and "(256, 64)" in err[0], err


@pytest.mark.parametrize("entrypoint", ["trainer-loop", "sampler"])
def test_entrypoints_exit_2_on_a_missing_checkpoint(
    entrypoint: str,
    gcs_bucket: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rljob-trainer (the sampler loop, its default) and rljob-sampler --backend cpu refuse a checkpoint
    path with nothing there before building a model."""
    from rljob.common.credentials import token_env

    for k, v in token_env().items():  # the run's token, which the sampler requires
        monkeypatch.setenv(k, v)
    missing = f"{gcs_bucket}/no-such-model/0/items"
    cfg = str(_config_with_checkpoint(tmp_path, gcs_bucket, missing))
    if entrypoint == "sampler":
        from rljob.sampler.main import main as sampler_main

        code = sampler_main(["--config", cfg, "--backend", "cpu", "--no-watch", "--port", "0"])
    else:
        from rljob.trainer.main import main as trainer_main

        code = trainer_main(["--config", cfg, "--model", "tiny"])
    assert code == EXIT_BAD_CONFIG
    stderr = capsys.readouterr().err
    err = [ln for ln in stderr.strip().splitlines() if "spec.model.checkpoint" in ln]
    assert len(err) == 1 and f"spec.model.checkpoint: {missing}: nothing at this path" in err[0], stderr
    assert "Traceback" not in stderr
