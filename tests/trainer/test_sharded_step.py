"""The compiled train step on a mesh: four CPU devices, fsdp=4, fsdp=2 x tensor=2 and context=2 x tensor=2,
against one device.

On TPU the trainer always runs on many devices with the spec's mesh; every other training test runs on
one CPU device. Here a subprocess (the device count is fixed when JAX starts) forces four CPU devices,
builds the tiny policy with each mesh and runs three optimizer steps on a fixed packed batch through
``Trainer.train_on_packed`` (two accumulate calls a step, the second with an all-pad micro-batch; the
fused log-prob head with tiles and vocabulary chunks that divide nothing; GRPO loss; LoRA-only AdamW).
The same steps run on one device in this process. Asserted:

- loss, gradient norm and the updated LoRA parameters agree with one device within float32
  reassociation (the sharded step sums the same terms in another order: cross-device reductions of the
  gradient, the loss and the norms);
- the base parameters lie as MaxText's logical axis rules say (kernels and embedding split over fsdp,
  the attention heads and MLP width over tensor), the LoRA parameters and optimizer state on the same
  mesh (replicated: the factors are small and keep only the scan axis name), the batch's rows split over
  fsdp; checked on the arrays and on the compiled step's own input shardings;
- the work is split by rows: the compiled step all-gathers weights, not the activations of all rows
  nor all rows' tokens for the log-prob head, which runs per device on its rows (one exception, XLA's
  choice for MaxText's embedding lookup: the token ids and the looked-up embeddings);
- the log-prob head: no all-gather of the [H, V] head anywhere in the compiled step; its layout for the
  head (columns over every device) is made once per call, outside the loop over micro-batches, and in
  the loop only quarter-head blocks move (collective-permute); each device scores a quarter of the
  micro-batch's tokens against a quarter of the vocabulary at a time, so the tokens x vocabulary work
  splits four ways on every mesh, the context axis included (no context rank scores another's tokens);
- each compiled function compiles once over the three steps (backend compile events by function name);
- the accumulation buffer and the train state are donated (the arguments' buffers are deleted after a
  call, and the compiled module aliases them to its outputs);
- the base parameters are bit-for-bit unchanged (frozen);
- over the context axis the policy feeds MaxText its load-balanced token order (and reads the hidden
  states back in the rows' order, or the comparison with one device fails).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.jax, pytest.mark.slow]

MESHES: dict[str, dict[str, int]] = {
    "fsdp4": {"ici_fsdp_parallelism": 4},
    "fsdp2_tensor2": {"ici_fsdp_parallelism": 2, "ici_tensor_parallelism": 2},
    "context2_tensor2": {"ici_context_parallelism": 2, "ici_tensor_parallelism": 2},
}
STEPS = 3
ROWS, BUDGET = 4, 80
LR = 1e-2
# Float32 reassociation: the sharded step adds the same per-token terms in another order (per-device
# partial sums, then all-reduces of the gradient, loss and norms), a few float32 ulps (~1e-7) per sum.
# Measured against one device (the three meshes, three steps): loss, gradient norm, ratio, weight
# <= 3.6e-7 relative; LoRA parameters <= 7.8e-6 relative (L2 per leaf). Adam amplifies the noise of
# gradient entries near zero (its first update is lr * g / (|g| + eps), whatever g's size), so single
# entries differ by up to 1.8e-5 ~ 2e-3 * lr, already after the first step and not growing. Bounds:
RTOL = 1e-5  # metrics
LORA_RTOL = 3e-5  # ||lora - lora_ref|| / ||lora_ref|| per leaf
LORA_ATOL = 1e-2 * LR  # any entry: 1% of one Adam step


def _flat(tree: Any) -> dict[str, np.ndarray]:
    import jax

    def value(x: Any) -> np.ndarray:
        # A copy: a numpy view of a CPU buffer would keep JAX from donating it.
        return np.array(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)

    return {jax.tree_util.keystr(kp): value(v) for kp, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _start_lora(policy: Any) -> Any:
    """A LoRA with both factors non-zero (qwix starts lora_b at 0, hiding lora_a's gradient), the same
    values on every mesh (numpy, fixed seed)."""
    import jax

    rng = np.random.default_rng(11)
    return jax.tree.map(lambda x: (0.05 * rng.standard_normal(x.shape)).astype(np.float32), policy.lora0)


def _packed(policy: Any, trainer: Any) -> list[Any]:
    from rljob.trainer.packing import pack_rollouts
    from rljob.trainer.runtime import synthetic_rollouts

    rollouts, _ = synthetic_rollouts(
        0, seed=3, vocab_size=policy.vocab_size, groups=8, group_size=4, max_prompt=10, max_completion=20
    )
    return pack_rollouts(rollouts, trainer.cfg.pack_config())


def run_steps(policy: Any) -> dict[str, Any]:
    """Three optimizer steps on the fixed batch with ``policy`` (on whatever mesh it was built), and what
    the test checks about them; arrays as numpy."""
    import jax
    from rljob.trainer.train_step import StepConfig, Trainer, stack_micro_batches

    compiles: dict[str, int] = {}

    def on_event(event: str, _duration: float, **kw: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            name = str(kw.get("fun_name", "")).removeprefix("jit(").removesuffix(")")
            compiles[name] = compiles.get(name, 0) + 1

    jax.monitoring.register_event_duration_secs_listener(on_event)
    trainer = Trainer(
        policy,
        StepConfig(
            budget=BUDGET,
            rows=ROWS,
            micro_batches=2,
            segment_align=16,
            learning_rate=LR,
            token_tile=48,
            vocab_chunk=96,
        ),
    )
    packed = _packed(policy, trainer)
    base_before = _flat(policy.base)
    state = trainer.init_state(_start_lora(policy))
    metrics, loras = [], []
    try:
        for _ in range(STEPS):
            state, m = trainer.train_on_packed(state, packed)
            metrics.append(m)
            loras.append(_flat(state.lora))
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)

    # One accumulate and one apply call by hand, the shapes of the steps above: donation and the compiled
    # step's input shardings.
    call = stack_micro_batches(packed, trainer.cfg.micro_batches)[0]
    batch = trainer.device_batch(call)
    acc = trainer.zero_acc(state.lora)
    args = (acc, state.lora, policy.base, batch)
    compiled = trainer.compiled_accumulate(acc, state.lora, batch)
    acc_leaves = jax.tree.leaves(acc)
    acc2 = trainer.accumulate(*args)
    acc_donated = all(x.is_deleted() for x in acc_leaves)
    state_leaves = jax.tree.leaves(state)
    state, _ = trainer.apply(state, acc2)
    state_donated = all(x.is_deleted() for x in state_leaves)

    def spec(s: Any) -> list[list[str] | None]:
        """Mesh axes per dimension (a PartitionSpec writes one axis as a name, several as a tuple); one
        device's compiled step may report a SingleDeviceSharding (no spec)."""
        return [None if a is None else [a] if isinstance(a, str) else list(a) for a in getattr(s, "spec", ())]

    in_acc, in_lora, in_base, in_batch = compiled.input_shardings[0]
    hlo = compiled.as_text()
    head_calls = _head_shard_maps(jax.make_jaxpr(trainer._accumulate)(*args).jaxpr, policy.hidden_size)
    base_arrays = _flat(policy.base)
    return {
        "devices": jax.device_count(),
        "mesh": {k: int(v) for k, v in policy.mesh.shape.items() if v > 1},
        "reorder_cp": policy.reorder_cp,
        "metrics": metrics,
        "loras": loras,
        "base_frozen": all(np.array_equal(base_before[k], base_arrays[k]) for k in base_before),
        "compiles": {k: compiles.get(k, 0) for k in ("_accumulate", "_apply")},
        "acc_donated": acc_donated,
        "state_donated": state_donated,
        "hlo_aliases": hlo.count("may-alias") + hlo.count("must-alias"),
        "head_calls": head_calls,
        "vocab": policy.vocab_size,
        "hidden": policy.hidden_size,
        # [result shape, the op it came from] of every collective-permute and all-to-all.
        "permutes": [
            [[int(d) for d in m[1].split(",") if d], m[2] or ""]
            for m in re.finditer(r"= \w+\[([\d,]*)\]\S* collective-permute\(.*?(?:op_name=\"([^\"]*)\")", hlo)
        ],
        # [dtype, result shape, gathered dimension, the op it came from] of every all-gather.
        "all_gathers": [
            [m[1], [int(d) for d in m[2].split(",") if d], int(m[3]), m[4] or ""]
            for m in re.finditer(
                r"= (\w+)\[([\d,]*)\]\S* all-gather\(.*dimensions=\{(\d+)\}(?:.*op_name=\"([^\"]*)\")?", hlo
            )
        ],
        "base_arrays": {
            jax.tree_util.keystr(kp): {
                "spec": spec(x.sharding),
                "mesh_ok": getattr(x.sharding, "mesh", None) == policy.mesh,
                "shape": list(x.shape),
                "shard": list(x.addressable_shards[0].data.shape),
            }
            for kp, x in jax.tree_util.tree_flatten_with_path(policy.base)[0]
            if x.ndim >= 2
        },
        "base_compiled": {
            jax.tree_util.keystr(kp): spec(s)
            for kp, s in jax.tree_util.tree_flatten_with_path(in_base)[0]
            if spec(s)
        },
        "lora_replicated": all(
            getattr(x.sharding, "mesh", None) == policy.mesh and x.sharding.is_fully_replicated
            for x in jax.tree.leaves((state.lora, state.opt_state))
        ),
        "lora_compiled_replicated": all(s.is_fully_replicated for s in jax.tree.leaves((in_acc, in_lora))),
        "batch": {
            k: {"spec": spec(v.sharding), "shard": list(v.addressable_shards[0].data.shape)}
            for k, v in batch.items()
        },
        "batch_compiled": {k: spec(s) for k, s in in_batch.items()},
    }


def _head_shard_maps(jaxpr: Any, hidden: int) -> list[dict[str, Any]]:
    """Every shard_map of the log-prob head in a traced step (forward and backward of each micro-batch's
    head: the policy's and, with a KL penalty, the reference's): the per-device shapes of its hidden
    states and head block, and the ring (mesh axes the blocks travel along)."""
    found: list[dict[str, Any]] = []

    def walk(j: Any) -> None:
        for e in j.eqns:
            if e.primitive.name == "shard_map":
                shapes = [list(v.aval.shape) for v in e.params["jaxpr"].invars]
                if len(shapes) >= 2 and shapes[0][-1:] == [hidden] and len(shapes[1]) == 2:
                    mesh = e.params["mesh"]
                    ring = 1
                    for entry in e.params["in_specs"][0][:-1]:
                        for a in (entry,) if isinstance(entry, str) else tuple(entry or ()):
                            ring *= int(mesh.shape[a])
                    found.append({"hidden": shapes[0], "block": shapes[1], "ring": ring})
            for p in e.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr)
    return found


def _subprocess_main(out: str) -> None:
    from rljob.trainer.model import ModelSpec, Policy, tiny_keys

    results = {}
    for name, keys in MESHES.items():
        t0 = time.monotonic()
        policy = Policy(ModelSpec(maxtext=tiny_keys(**keys), lora_rank=8, lora_alpha=16.0))
        results[name] = run_steps(policy)
        results[name]["seconds"] = time.monotonic() - t0
    Path(out).write_text(json.dumps(results, default=_jsonable))


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return {"__array__": x.tolist(), "dtype": str(x.dtype)}
    raise TypeError(type(x))


def _unjson(x: Any) -> Any:
    if isinstance(x, dict):
        if "__array__" in x:
            return np.asarray(x["__array__"], x["dtype"])
        return {k: _unjson(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_unjson(v) for v in x]
    return x


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sharded")
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
        "PYTHONSAFEPATH": "1",
    }
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp / "out.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _unjson(json.loads((tmp / "out.json").read_text()))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def single(tiny_policy: Any) -> dict[str, Any]:
    """The same steps on one device (the session's tiny policy: the same keys, seed and rank)."""
    return run_steps(tiny_policy)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sharded_steps_compute_what_one_device_computes(
    mesh: str, sharded: dict[str, Any], single: dict[str, Any]
) -> None:
    got = sharded[mesh]
    assert got["devices"] == 4 and single["devices"] == 1
    assert got["mesh"] == {
        k.removeprefix("ici_").removesuffix("_parallelism"): v for k, v in MESHES[mesh].items()
    }
    # MaxText's default context_parallel_load_balance: over a context axis the rows go to the model in
    # its load-balanced order and come back (tests/trainer/test_context_order.py says why); the step
    # below computes what one device computes only if the hidden states are put back in the rows' order.
    assert got["reorder_cp"] == got["mesh"].get("context", 1) and single["reorder_cp"] == 1
    worst: dict[str, float] = {}
    for step, (m, ref) in enumerate(zip(got["metrics"], single["metrics"], strict=True)):
        assert m["update_skipped"] == ref["update_skipped"] == 0
        assert m["accumulate_calls"] == ref["accumulate_calls"] == 2, m
        assert m["tokens"] == ref["tokens"] > 0
        for key in ("loss", "grad_norm", "ratio", "weight"):
            worst[key] = max(worst.get(key, 0.0), abs(m[key] - ref[key]) / max(abs(ref[key]), 1e-30))
        for name, want in single["loras"][step].items():
            have = got["loras"][step][name]
            rel = float(np.linalg.norm(have - want) / np.linalg.norm(want))
            worst["lora_rel"] = max(worst.get("lora_rel", 0.0), rel)
            worst["lora_abs"] = max(worst.get("lora_abs", 0.0), float(np.abs(have - want).max()))
    print(mesh, "max difference from one device", worst)
    lora = {"lora_rel": LORA_RTOL, "lora_abs": LORA_ATOL}
    assert all(v <= lora.get(k, RTOL) for k, v in worst.items()), worst
    # Every LoRA leaf moved over the steps (by ~lr an entry): the comparison is not of two copies.
    for name, last in got["loras"][-1].items():
        assert float(np.abs(last - got["loras"][0][name]).max()) > LR, name


@pytest.mark.parametrize("mesh", list(MESHES))
def test_sharded_steps_lay_out_compile_once_and_donate(mesh: str, sharded: dict[str, Any]) -> None:
    got = sharded[mesh]
    axes = got["mesh"]
    # Base: every kernel and the embedding split over fsdp, or over context where fsdp is 1 (MaxText's
    # logical rules: "embed" over fsdp and context); with tensor=2 the heads / MLP width too. Each shard
    # is that fraction of the array.
    for name, p in got["base_arrays"].items():
        if not name.endswith(("['kernel']", "['embedding']")):
            continue
        used = [a for entry in p["spec"] if entry for a in entry]
        assert ("fsdp" if "fsdp" in axes else "context") in used, (name, p)
        split = 1
        for a in used:
            split *= axes.get(a, 1)
        assert int(np.prod(p["shape"])) == split * int(np.prod(p["shard"])), (name, p)
        assert p["mesh_ok"]
        assert got["base_compiled"][name] == p["spec"], (name, got["base_compiled"].get(name))
    if "tensor" in axes:
        assert any("tensor" in str(p["spec"]) for p in got["base_arrays"].values())
    # LoRA parameters, optimizer state and accumulator: on the mesh, replicated.
    assert got["lora_replicated"] and got["lora_compiled_replicated"]
    # Batch [micro_batches, rows, budget]: rows over fsdp, tokens over context, as the compiled step
    # takes it.
    rows = ["fsdp"] if "fsdp" in axes else None
    toks = ["context"] if "context" in axes else None
    for field, b in got["batch"].items():
        shard = [2, ROWS // axes.get("fsdp", 1), BUDGET // axes.get("context", 1)]
        assert b["spec"][1:] == [rows, toks][: len(b["spec"]) - 1] and b["shard"] == shard, (field, b)
        assert got["batch_compiled"][field] == b["spec"], field
    # Every device computes only its rows: the compiled step all-gathers weights (FSDP), not the
    # activations of all rows (MaxText's activation constraints are traced under its logical axis rules;
    # without them they pin every activation replicated and each device computes every row) nor all
    # rows' tokens for the log-prob head. One exception, XLA's choice for MaxText's embedding lookup
    # from a table split over vocab and embed: the token ids and the looked-up rows (op ".../gather").
    batch_gathers = [
        g
        for g in got["all_gathers"]
        if g[2] == 0
        and g[1][:1] in ([ROWS], [ROWS * BUDGET])
        and g[0] != "s32"
        and not g[3].endswith("/gather")
    ]
    assert got["all_gathers"] and (rows is None or not batch_gathers), batch_gathers
    assert got["compiles"] == {"_accumulate": 1, "_apply": 1}, got["compiles"]
    assert got["acc_donated"] and got["state_donated"] and got["hlo_aliases"] > 0
    assert got["base_frozen"]
    print(mesh, f"{got['seconds']:.1f} s (build + 3 steps + checks)")


@pytest.mark.parametrize("mesh", list(MESHES))
def test_log_prob_head_splits_four_ways_and_never_gathers_the_head(
    mesh: str, sharded: dict[str, Any]
) -> None:
    """The compiled step's log-prob head on four devices: no all-gather of the [H, V] head anywhere (the
    old head gathered it whole on every device in every micro-batch); in the loop over micro-batches only
    blocks of a quarter of the head move (collective-permute); and every device scores a different
    quarter of the tokens x vocabulary work, the context axis included (each context rank its own
    tokens), read off the per-device shapes of the head's shard_map in the traced step."""
    got = sharded[mesh]
    h, v = got["hidden"], got["vocab"]
    quarter = [h, v // 4]  # the tiny vocabulary (256) splits over four devices without padding
    gathered_head = [g for g in got["all_gathers"] if sorted(g[1]) == sorted([h, v])]
    assert not gathered_head, gathered_head
    ring_moves = [p for p in got["permutes"] if p[0] == quarter and "/while/" in p[1] and "ppermute" in p[1]]
    assert ring_moves, got["permutes"]
    # forward and backward of the head, per micro-batch step of the loop (traced once)
    assert len(got["head_calls"]) == 2, got["head_calls"]
    for call in got["head_calls"]:
        b, t, hh = call["hidden"]
        assert hh == h and call["block"] == quarter, call  # a quarter of the head on each device
        # tokens this device scores x vocabulary columns it scores them against (its block and the
        # blocks passed to it around the ring): a quarter of the micro-batch's ROWS x BUDGET x V
        assert 4 * b * t * call["block"][1] * call["ring"] == ROWS * BUDGET * v, (call, mesh)
        if "context" in got["mesh"]:
            assert t == BUDGET // got["mesh"]["context"], call  # each context rank its own tokens
    print(mesh, "head per device:", got["head_calls"][0], "ring moves:", len(ring_moves))


def test_one_device_compiles_once_and_donates(single: dict[str, Any]) -> None:
    assert single["compiles"] == {"_accumulate": 1, "_apply": 1}, single["compiles"]
    assert single["acc_donated"] and single["state_donated"] and single["base_frozen"]


if __name__ == "__main__":
    _subprocess_main(sys.argv[1])
