"""One RL train step at full size on the TPU compiler: rljob's programs against tunix's RL learner step and
MaxText's own RL trainer step, for a catalog recipe's model, LoRA and trainer slice, on a machine without a
TPU.

Every arm is lowered and compiled by libtpu's compiler for the recipe's trainer topology
(``jax.experimental.topologies.get_topology_desc`` devices, as rljob.trainer.compilecheck and MaxText's
``train_compile`` describe it; docs/drill.md, "rljob drill --compile"), every parameter a ShapeDtypeStruct
with its NamedSharding, no weights. The RL batch is the same for every arm: ``groupSize x groupsPerBatch``
rollouts of the recipe, seeded, prompts uniform in 256..maxPromptTokens and completions log-uniform in
256..maxTokens (bench/train_step_vs_tunix.py's spread, at the recipe's limits).

  rljob   rljob.trainer.compilecheck's ``accumulate`` and ``apply`` programs at the plan's shapes
          (``[micro_batches, microBatchSize, tokenBudget]`` packed rows); a step is as many accumulate calls
          as the packed rows need, then one apply.
  tunix   tunix 0.1.7's RL actor step (``tunix.rl.trainer.Trainer``, what ``tunix.rl.rl_cluster.RLCluster``
          trains the actor with; its jitted body ``PeftTrainer._train_step``: ``nnx.value_and_grad`` of
          ``tunix.rl.algo_core.grpo_loss_fn`` over the LoRA parameters, then the optimizer update) on the
          same MaxText model and qwix LoRA, MaxText's output head on (tunix reads ``[B, T, V]`` logits),
          as tunix's GRPO learner feeds it by default: the batch split into ``--tunix-micro-batch`` rollouts
          per call (RLTrainingConfig.training_micro_batch_size), the prompt left-padded to maxPromptTokens
          and the completion right-padded to maxTokens (tunix pads to the rollout config's lengths).
  maxtext MaxText 0.2.5's RL trainer (``maxtext.trainers.post_train.rl.train_rl``): it builds tunix's
          RLCluster and GrpoLearner around the same tunix Trainer, the MaxText model wrapped by
          ``maxtext.integration.tunix.TunixMaxTextAdapter``; its jitted program is tunix's train step with
          MaxText's RL defaults (its config's micro-batch, algorithm and packing settings).

Where the recipe's mesh has a context axis, each peer is compiled twice: on the recipe's mesh and with the
context axis folded into fsdp (tunix splits whole rollouts over every mesh axis, so a context axis only
makes MaxText reshard them; the folded mesh is the one a tunix user would run). The last two lines compare
rljob with the best peer run that fits: ``rljob_over_best_peer_tokens_ratio`` (useful tokens per roofline
second, against the fastest) and ``rljob_over_best_peer_peak_hbm_ratio`` (peak HBM per device, against
the leanest).

Per arm and device: peak HBM bytes (argument + output - alias + temporaries + code + the state that stays
resident, as compilecheck counts it), FLOPs (the model's analytic count over the tokens the arm computes,
MaxText's ``calculate_tflops_training_per_device``; XLA counts a scanned loop's body once), bytes accessed
(XLA), the roofline seconds of one whole step (every call of it) and useful (non-pad) tokens per roofline
second. An arm that cannot be compiled (the compiler's out-of-memory, a partitioning error, a model that
cannot be built without weights) prints one line with the error's first line. Without libtpu: one line
saying skipped. Run (one compile at a time; minutes of CPU per program):
``.venv/bin/python bench/train_step_compiled.py [--recipe R1,R2] [--arms rljob,tunix,maxtext]`` (the
defaults: qwen3-8b-v5p and gpt-oss-20b-v5p, every arm; `make bench` runs it so).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _cpu_bench() -> Any:
    """bench/train_step_vs_tunix.py (bench/ is not a package): its rollout lengths and rollouts."""
    path = Path(__file__).resolve().with_name("train_step_vs_tunix.py")
    spec = importlib.util.spec_from_file_location("train_step_vs_tunix", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cpu_bench = _cpu_bench()

BENCH = "train_step_compiled"


def emit(metric: str, value: object, **kw: object) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, **kw}), flush=True)


def run_config(recipe: str) -> Any:
    import yaml
    from rljob.recipes.plan import parse_manifest, resolve

    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "sbs"},
        "spec": {"recipe": recipe, "storage": {"root": "gs://rljob-bench"}},
    }
    return resolve(parse_manifest(yaml.safe_dump(doc)))


@dataclasses.dataclass
class Batch:
    lengths: list[tuple[int, int]]
    max_prompt: int
    max_completion: int
    vocab: int

    @property
    def useful(self) -> int:
        return sum(p + c for p, c in self.lengths)


def rl_batch(rc: Any, seed: int) -> Batch:
    alg = rc.spec.algorithm
    n = int(alg.group_size) * int(alg.groups_per_batch)
    mp, mc = int(alg.max_prompt_tokens), int(alg.max_tokens)
    lengths = cpu_bench.rollout_lengths(n, 1, seed, max_prompt=mp, max_completion=mc)
    return Batch(lengths, mp, mc, 32_000)


def arm_context(rc: Any, batch: Batch) -> dict[str, Any]:
    return {
        "recipe": rc.spec.recipe,
        "model": str(rc.trainer.maxtext.get("model_name")),
        "type": rc.trainer.tpu.type_name,
        "slices": rc.trainer.slices,
        "rollouts": len(batch.lengths),
        "useful_tokens": batch.useful,
        "longest": max(p + c for p, c in batch.lengths),
        "lora": {"rank": rc.spec.lora.rank, "targets": list(rc.spec.lora.targets)},
    }


def summary(
    programs: dict[str, dict[str, Any]], calls: dict[str, int], useful: int, resident: int = 0
) -> dict[str, Any]:
    """The step's figures from its programs' compiled figures and how many times the step calls each."""
    peak = max(int(p["peak_bytes_per_device"]) for p in programs.values())
    seconds = sum(calls[n] * float(p["roofline_seconds"]) for n, p in programs.items())
    return {
        "peak_bytes_per_device": peak + resident,
        "fits": all(bool(p["fits"]) for p in programs.values()),
        "flops": sum(calls[n] * float(p["flops"]) for n, p in programs.items()),
        "bytes_accessed": sum(calls[n] * float(p["bytes_accessed"]) for n, p in programs.items()),
        "roofline_seconds": seconds,
        "useful_tokens_per_roofline_s": useful / seconds if seconds > 0 else 0.0,
        "calls": calls,
    }


def rljob_arm(rc: Any, batch: Batch) -> dict[str, Any]:
    from rljob.trainer import compilecheck
    from rljob.trainer.main import model_setup
    from rljob.trainer.packing import pack_rollouts

    _, step_cfg, _ = model_setup(rc, "config", None)
    rollouts = cpu_bench.make_rollouts(batch.lengths, batch.vocab, int(rc.spec.algorithm.group_size), 0)
    packed = pack_rollouts(rollouts, step_cfg.pack_config())
    rows = len(packed) * step_cfg.rows
    per_call = step_cfg.micro_batches
    calls = -(-len(packed) // per_call)
    report, _ = compilecheck.compile_run(rc, only={"accumulate", "apply"})
    progs = report["programs"]
    failed = {n: p for n, p in progs.items() if "roofline_seconds" not in p}
    out: dict[str, Any] = {
        "mesh": report["mesh"],
        "shape": report["shape"],
        "packed_rows": rows,
        "row_tokens": rows * step_cfg.budget,
        "programs": progs,
    }
    if failed:
        out["error"] = "; ".join(f"{n}: {p.get('error', 'does not fit')}" for n, p in failed.items())
        return out
    out.update(summary(progs, {"accumulate": calls, "apply": 1}, batch.useful))
    return out


def tunix_example(batch: Batch, rows: int, sharding: Any, reference: bool = False) -> Any:
    """Abstract ``tunix.rl.common.TrainExample`` of one call: ``rows`` rollouts, the prompt left-padded to
    maxPromptTokens and the completion right-padded to maxTokens (tunix's GRPO learner pads completions to
    the rollout config's ``max_tokens_to_generate``, prompts to its ``max_prompt_length``)."""
    import jax
    import jax.numpy as jnp
    from tunix.rl import common

    def sds(shape: tuple[int, ...], dtype: Any) -> Any:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding(len(shape)))  # type: ignore[no-untyped-call]

    p, c = batch.max_prompt, batch.max_completion
    return common.TrainExample(
        prompt_ids=sds((rows, p), "int32"),
        prompt_mask=sds((rows, p), "bool"),
        completion_ids=sds((rows, c), "int32"),
        completion_mask=sds((rows, c), "int32"),
        advantages=sds((rows,), "float32"),
        ref_per_token_logps=sds((rows, c), "float32") if reference else None,
        old_per_token_logps=sds((rows, c), "float32"),
    )


def tunix_program(
    rc: Any,
    batch: Batch,
    keys: dict[str, Any],
    *,
    lora: bool,
    rows: int,
    calls: int,
    name: str,
    algo_keys: dict[str, Any] | None = None,
) -> tuple[Any, Any, dict[str, Any]]:
    """(compilecheck Program, MaxText config, context) of tunix's RL actor train step: the MaxText model for
    ``keys`` (MaxText's output head on) wrapped by MaxText's ``TunixMaxTextAdapter``, with rljob's qwix LoRA
    on the recipe's targets when ``lora`` (else every parameter trained, as MaxText's RL trainer does),
    ``tunix.rl.trainer.Trainer`` (AdamW, gradients accumulated over ``calls`` calls by optax.MultiSteps as
    tunix's learner sets ``gradient_accumulation_steps``) with ``tunix.rl.algo_core.grpo_loss_fn``; its
    jitted body ``PeftTrainer._train_step`` lowered over the model and optimizer state as arguments (the
    state tunix's ``nnx.jit`` passes and donates)."""
    from pathlib import Path

    import flax.linen as nn
    import jax
    import maxtext
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from maxtext.configs import pyconfig
    from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter
    from maxtext.utils import maxtext_utils
    from rljob.recipes import tpu
    from rljob.trainer import compilecheck
    from rljob.trainer.base_checkpoint import logical_shardings
    from rljob.trainer.lora import lora_sharding_meta
    from rljob.trainer.main import model_setup
    from rljob.trainer.model import _RUNTIME_KEYS, _abstract, _create_fn, _with_lora
    from tunix.rl import algo_core
    from tunix.rl import trainer as rl_trainer
    from tunix.rl.grpo.grpo_learner import GRPOConfig
    from tunix.sft import peft_trainer

    spec, step_cfg, _ = model_setup(rc, "config", None)
    merged = {
        **keys,
        **_RUNTIME_KEYS,
        "num_vocab_tiling": 1,  # tunix reads the logits
        "max_target_length": batch.max_prompt + batch.max_completion,
        "compile_topology": tpu.maxtext_type(rc.trainer.tpu),
        "compile_topology_num_slices": rc.trainer.slices,
    }
    cfg = pyconfig.initialize(["", str(Path(maxtext.__file__).parent / "configs" / "base.yml")], **merged)
    devices = compilecheck.topology_devices(rc)
    mesh = maxtext_utils.get_mesh_from_config(cfg, devices)
    settings = {"beta": 0.0, "epsilon": 0.2} | (algo_keys or {})  # the recipe's: no KL penalty
    algo = GRPOConfig(num_generations=int(rc.spec.algorithm.group_size), **settings)
    algo.temperature = 1.0  # GRPOLearner sets it from the rollout config
    tx = optax.chain(optax.clip_by_global_norm(step_cfg.max_grad_norm), optax.adamw(step_cfg.learning_rate))
    held: dict[str, Any] = {}

    def create() -> Any:
        with nn.logical_axis_rules(cfg.logical_axis_rules):
            model = _create_fn(cfg, mesh, spec.seed)()
        if lora:
            model = _with_lora(model, spec, cfg)
            nnx.pop(model, nnx.Intermediate)
            # rljob's Policy's metadata fix of the LoRA factors (rljob.trainer.lora.lora_sharding_meta)
            graphdef, lstate, rest = nnx.split(model, nnx.LoRAParam, ...)  # type: ignore[misc]
            lstate = jax.tree.map(lora_sharding_meta, lstate, is_leaf=lambda x: isinstance(x, nnx.Variable))
            model = nnx.merge(graphdef, lstate, rest)
        adapter = TunixMaxTextAdapter(model, use_no_op_mappings=True, pad_id=0)
        trainer = rl_trainer.Trainer(
            adapter,
            tx,
            peft_trainer.TrainingConfig(
                eval_every_n_steps=10**9, max_steps=10**6, gradient_accumulation_steps=calls
            ),
            custom_checkpoint_metadata_fn=dict,
        )
        trainer.with_loss_fn(algo_core.grpo_loss_fn, has_aux=True)
        trainer.with_gen_model_input_fn(
            lambda ex: {"train_example": ex, "algo_config": algo, "pad_id": 0, "eos_id": 1}
        )
        held["trainer"] = trainer
        return trainer.model, trainer.optimizer

    with nn.logical_axis_rules(cfg.logical_axis_rules):
        abstract = nnx.eval_shape(create)
    trainer = held["trainer"]
    graphdef, state = nnx.split(abstract)
    shardings = logical_shardings(state, cfg, mesh)
    state = jax.tree.map(_abstract, state, shardings)  # rljob's abstract Policy's arrays
    axes = tuple(str(k) for k, v in mesh.shape.items() if int(v) > 1)

    def batch_sharding(ndim: int) -> Any:
        return NamedSharding(mesh, P(axes or None, *([None] * (ndim - 1))))  # type: ignore[no-untyped-call]

    example = tunix_example(batch, rows, batch_sharding, reference=float(algo.beta) > 0)

    def step(state: Any, ex: Any) -> Any:
        m, o = nnx.merge(graphdef, state)
        with nn.logical_axis_rules(cfg.logical_axis_rules):
            loss, _, gnorm = trainer._train_step(m, o, ex)
        return loss, gnorm, nnx.state((m, o))

    fn = jax.jit(step, donate_argnums=0, out_shardings=(None, None, shardings))
    tokens = rows * (batch.max_prompt + batch.max_completion)
    n = len(devices)
    flops = compilecheck.model_flops(cfg, tokens / n, backward=True)
    if not lora:  # every weight's gradient too: MaxText's full training count (weights x 3)
        flops = (
            float(maxtext_utils.calculate_tflops_training_per_device(cfg, log=False)[0])
            * 1e12
            * (tokens / n)
            / (float(cfg.per_device_batch_size) * float(cfg.max_target_length))
        )
    program = compilecheck.Program(name, fn, (state, example), 0, "", flops)
    ctx = {
        "mesh": {str(k): int(v) for k, v in mesh.shape.items() if int(v) > 1},
        "call_shape": [rows, batch.max_prompt + batch.max_completion],
        "row_tokens": calls * tokens,
        "adapter": "maxtext.integration.tunix.TunixMaxTextAdapter",
        "trains": "the LoRA factors" if lora else "every parameter",
        "beta": float(algo.beta),
    }
    return program, cfg, ctx


def tunix_like_arm(
    rc: Any,
    batch: Batch,
    keys: dict[str, Any],
    *,
    lora: bool,
    rows: int,
    name: str,
    algo_keys: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from rljob.trainer import compilecheck

    calls = -(-len(batch.lengths) // rows)
    program, _, ctx = tunix_program(
        rc, batch, keys, lora=lora, rows=rows, calls=calls, name=name, algo_keys=algo_keys
    )
    chip = compilecheck.CHIPS[compilecheck.generation(rc)]
    fig = compilecheck.compile_one(program, chip)
    out: dict[str, Any] = {**ctx, "programs": {name: fig}}
    if "roofline_seconds" not in fig:
        out["error"] = f"{name}: {fig.get('error', 'does not fit')}"
        return out
    out.update(summary({name: fig}, {name: calls}, batch.useful))
    return out


def peer_keys(keys: dict[str, Any], fold_context: bool) -> dict[str, Any]:
    """The recipe's MaxText keys for a peer arm; ``fold_context``: its context axis folded into fsdp (the
    same devices). tunix splits a call's rollouts over every mesh axis (its batch is whole rows), so a
    context axis only makes MaxText reshard each row's activations over it: a peer is also compiled on the
    mesh it would run best on, and the better of the two counts."""
    out = dict(keys)
    if fold_context:
        for scope in ("ici", "dcn"):
            ctx = int(out.get(f"{scope}_context_parallelism", 1) or 1)
            if ctx > 1:
                out[f"{scope}_fsdp_parallelism"] = int(out.get(f"{scope}_fsdp_parallelism", 1) or 1) * ctx
                out[f"{scope}_context_parallelism"] = 1
    return out


def folds_context(rc: Any) -> bool:
    keys = rc.trainer.maxtext
    return any(int(keys.get(f"{s}_context_parallelism", 1) or 1) > 1 for s in ("ici", "dcn"))


def tunix_arm(rc: Any, batch: Batch, rows: int, fold_context: bool = False) -> dict[str, Any]:
    """tunix's RL learner step on the recipe's MaxText keys and LoRA."""
    keys = peer_keys(dict(rc.trainer.maxtext), fold_context)
    return tunix_like_arm(rc, batch, keys, lora=True, rows=rows, name="tunix_train_step")


# The trainer keys of MaxText's RL config (configs/post_train/rl.yml) that change the actor's train step.
MAXTEXT_RL_KEYS = (
    "weight_dtype",
    "attention",
    "remat_policy",
    "decoder_layer_input",
    "query_proj",
    "key_proj",
    "value_proj",
)


def maxtext_arm(rc: Any, batch: Batch, rows: int, fold_context: bool = False) -> dict[str, Any]:
    """MaxText 0.2.5's RL trainer step: tunix's actor step (its train_rl builds tunix's RLCluster and
    GrpoLearner) on MaxText's RL config's trainer keys and GRPO settings (configs/post_train/rl.yml:
    grpo_beta, grpo_epsilon, loss_algo, loss_agg_mode); every parameter trained (train_rl applies no LoRA:
    its actor is model_creation_utils.from_pretrained's model in TunixMaxTextAdapter)."""
    from pathlib import Path

    import maxtext
    import yaml

    rl_yml = yaml.safe_load((Path(maxtext.__file__).parent / "configs" / "post_train" / "rl.yml").read_text())
    keys = peer_keys(
        {**rc.trainer.maxtext, **{k: rl_yml[k] for k in MAXTEXT_RL_KEYS if k in rl_yml}}, fold_context
    )
    rl = rl_yml["rl"]
    algo = {
        "beta": float(rl["grpo_beta"]),
        "epsilon": float(rl["grpo_epsilon"]),
        "loss_algo": rl["loss_algo"],
        "loss_agg_mode": rl["loss_agg_mode"],
    }
    out = tunix_like_arm(rc, batch, keys, lora=False, rows=rows, name="maxtext_rl_train_step", algo_keys=algo)
    out["maxtext_rl_keys"] = {k: keys[k] for k in MAXTEXT_RL_KEYS if k in keys}
    return out


ARMS = {"rljob": rljob_arm}
PEERS = {"tunix": tunix_arm, "maxtext": maxtext_arm}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--recipe",
        default="qwen3-8b-v5p,gpt-oss-20b-v5p",
        help="catalog recipes, comma-separated (default: the dense and the MoE recipe the comparison is of)",
    )
    ap.add_argument("--arms", default=",".join([*ARMS, *PEERS]))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tunix-micro-batch",
        type=int,
        default=0,
        help="rollouts per tunix train call (default: one group, groupSize rollouts: tunix's smallest, "
        "train_micro_batch_size 1 prompt x its generations)",
    )
    a = ap.parse_args(argv)
    if importlib.util.find_spec("libtpu") is None:
        emit("skipped", "libtpu is not installed (the compile extra: pip install -e '.[compile]')")
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for recipe in a.recipe.split(","):
        run_recipe(recipe, a.arms.split(","), a.seed, a.tunix_micro_batch)
    return 0


def run_recipe(recipe: str, arms: list[str], seed: int, tunix_micro_batch: int) -> None:
    """Every arm's step for one recipe (JSON lines), then rljob's ratios to the best peer."""
    rc = run_config(recipe)
    batch = rl_batch(rc, seed)
    tunix_micro_batch = tunix_micro_batch or int(rc.spec.algorithm.group_size)
    ctx = arm_context(rc, batch)
    runs = [(n, False) for n in arms]
    if folds_context(rc):  # each peer also on the mesh it runs best on (peer_keys)
        runs += [(n, True) for n in arms if n in PEERS]
    steps: dict[str, dict[str, Any]] = {}
    for name, fold in runs:
        t0 = time.monotonic()
        try:
            fig = (
                ARMS[name](rc, batch)
                if name == "rljob"
                else PEERS[name](rc, batch, tunix_micro_batch, fold_context=fold)
            )
        except Exception as e:
            first = str(e).strip().splitlines()[0][:400] if str(e).strip() else ""
            fig = {
                "error": f"{type(e).__name__}: {first}",
                "where": traceback.format_exc().splitlines()[-3].strip(),
            }
        fig["seconds"] = round(time.monotonic() - t0, 1)
        if fold:
            fig["mesh_note"] = "the recipe's context axis folded into fsdp"
        if "error" in fig:
            emit("not_compiled", fig.pop("error"), arm=name, **fig, **ctx)
            continue
        emit("step", fig["useful_tokens_per_roofline_s"], arm=name, **fig, **ctx)
        steps[f"{name}{' (context folded)' if fold else ''}"] = fig
    emit_ratios(steps, ctx)


def emit_ratios(steps: dict[str, dict[str, Any]], ctx: dict[str, Any]) -> None:
    """rljob against the best peer run that fits: useful tokens per roofline second (higher is better) and
    peak HBM per device (lower is better), each against the peer run best at it."""
    mine = steps.get("rljob")
    peers = {k: v for k, v in steps.items() if k != "rljob" and v.get("fits")}
    if mine is None or not peers:
        return
    fastest = max(peers, key=lambda k: float(peers[k]["useful_tokens_per_roofline_s"]))
    leanest = min(peers, key=lambda k: int(peers[k]["peak_bytes_per_device"]))
    emit(
        "rljob_over_best_peer_tokens_ratio",
        float(mine["useful_tokens_per_roofline_s"]) / float(peers[fastest]["useful_tokens_per_roofline_s"]),
        peer=fastest,
        **ctx,
    )
    emit(
        "rljob_over_best_peer_peak_hbm_ratio",
        int(mine["peak_bytes_per_device"]) / int(peers[leanest]["peak_bytes_per_device"]),
        peer=leanest,
        **ctx,
    )


if __name__ == "__main__":
    sys.exit(main())
