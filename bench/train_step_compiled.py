"""One RL train step at full size on the TPU compiler: rljob's programs against tunix's RL learner step
(padded and packed) and MaxText's own RL trainer step, for a catalog recipe's model, LoRA and trainer slice,
on a machine without a TPU.

Every arm is lowered and compiled by libtpu's compiler for the recipe's trainer topology
(``jax.experimental.topologies.get_topology_desc`` devices, as rljob.trainer.compilecheck and MaxText's
``train_compile`` describe it; docs/drill.md, "rljob drill --compile"), every parameter a ShapeDtypeStruct
with its NamedSharding, no weights. Each arm's programs compile once (their shapes do not depend on the
rollouts' lengths); a step is then costed for each length trace (``--fill``) by how many calls of each
program it takes.

Arms (the same MaxText model, qwix LoRA on the recipe's targets, dtype and mesh):

  rljob         rljob.trainer.compilecheck's ``accumulate`` and ``apply`` programs at the plan's shapes
                (``[micro_batches, microBatchSize, tokenBudget]`` packed rows, first-fit decreasing); a step
                is as many accumulate calls as the packed rows need, then one apply.
  tunix_padded  tunix 0.1.7's RL actor step (``tunix.rl.trainer.Trainer``, what
                ``tunix.rl.rl_cluster.RLCluster`` trains the actor with; its jitted body
                ``PeftTrainer._train_step``: ``nnx.value_and_grad`` of ``tunix.rl.algo_core.grpo_loss_fn``
                over the LoRA parameters, then the optimizer update) through MaxText's
                ``TunixMaxTextAdapter`` (MaxText's output head on: tunix reads ``[B, T, V]`` logits), as its
                GRPO learner runs by default (``max_seq_token_per_tpu`` unset): ``--tunix-micro-batch``
                rollouts a call (RLTrainingConfig.training_micro_batch_size), the prompt left-padded to
                maxPromptTokens and the completion right-padded to maxTokens.
  tunix_packed  the same step on tunix's own packing (``max_seq_token_per_tpu`` = the recipe's tokenBudget:
                ``tunix.rl.utils.pack_sequences``, first fit in arrival order, segment ids and positions
                through the adapter): one ``[1, tokenBudget]`` row a call. tunix's limits, as 0.1.7 has
                them: a packed example is ONE row, so its batch axis cannot be split over the mesh
                (``tunix.sft.sharding_utils.get_sharding`` replicates an input whose batch does not divide
                the data axis: every device holds the whole row), and MaxText's Splash attention refuses a
                batch that does not split over data x fsdp; so it is compiled three ways and the best that
                compiles counts: on the recipe's keys (``tunix_packed``), with the fsdp axis made a tensor
                axis (``tunix_packed_tensor``) and with dot-product attention (``tunix_packed_dot``,
                :func:`packed_keys`). And the optimizer is stepped by ``optax.MultiSteps`` every
                ``gradient_accumulation_steps`` calls, a number fixed when the trainer is built while the
                packed rows per batch vary with the lengths (the bench builds it with the first trace's row
                count; the program does not depend on it, and each trace is costed as one update a batch,
                the peer's best case).
  maxtext       MaxText 0.2.5's RL trainer (``maxtext.trainers.post_train.rl.train_rl``): tunix's step on
                MaxText's RL config's trainer keys and GRPO settings (configs/post_train/rl.yml), every
                parameter trained (train_rl applies no LoRA), padded as tunix_padded.

Where the recipe's mesh has a context axis, each peer is also compiled with the context axis folded into
fsdp (tunix splits whole rollouts over the mesh; the folded mesh is the one a tunix user would run).

The same layout freedom for every arm: the frozen base weights are an argument of their own in the memory
layout the compiler picks (``Layout.AUTO``), as rljob's Trainer gives them (trainer/train_step.py); in the
peers the base is split out of the state tunix's ``nnx.jit`` passes (the LoRA factors and optimizer state
stay donated). The maxtext arm has no frozen weights (every weight is trained, donated and returned).

Equal tokens per device: by default tunix_padded takes as many rollouts a call as rljob's call has rows
(``microBatches x microBatchSize``), so each device holds the same tokens a call as rljob's; tunix_packed's
row is the recipe's tokenBudget, held whole by each device (above). Each step line says
``tokens_per_device_per_call``, and the peak-HBM ratio line says whether the arms compared hold the same
tokens per device.

Per arm, per program (one call, per device): peak HBM bytes (argument + output - alias + temporaries + code
+ the state that stays resident, as compilecheck counts it), FLOPs (the model's analytic count, MaxText's
``calculate_tflops_training_per_device``, over the tokens the call computes divided over the devices: the
same cost per computed token for every arm; for the packed peer's one row that is the work split over the
devices, its best case; ``xla_flops`` is XLA's own count, which counts a scanned loop's body once and the
log-prob head outside it in full: a check of how an arm splits its work, not a step's count), bytes
accessed (XLA), and the bytes the collectives move, an analytic estimate (FSDP: every sharded base weight
all-gathered once in the forward pass and once again in the backward pass, the bytes a device receives,
plus the gradients' reduce-scatter where every weight is trained; a tensor axis: six all-reduces of a
layer's activations, :func:`tensor_collective_bytes`; not read from XLA's cost analysis). The roofline of
a call is max(FLOPs / peak bf16 FLOP/s, bytes accessed / HBM bandwidth, collective bytes / ICI bandwidth)
per device, the chip's figures from rljob.recipes.generations (ICI: the generation page's inter-chip
interconnect bandwidth per chip); a step's roofline is the sum over its calls.

Length traces (``--fill``): ``loguniform`` (prompts uniform in 256..maxPromptTokens, completions
log-uniform in 256..maxTokens, bench/train_step_vs_tunix.py's spread at the recipe's limits) and fill
fractions F (prompts uniform as above, completions maxTokens x Beta(4m, 4(1-m)) with m set so that the mean
rollout is F of maxPromptTokens + maxTokens: F is how full a padded row is on average).

Lines (JSON: bench, metric, value, context): ``program`` per compiled program; ``step`` per arm and trace
(value: useful tokens per roofline second); per trace, rljob against the best peer arm that fits:
``rljob_over_best_peer_tokens_ratio`` (against the peer fastest on that trace) with what it is made of
(``computed_tokens_ratio`` x ``per_computed_token_cost_ratio`` = the ratio), and
``rljob_over_best_peer_peak_hbm_ratio`` (against the leanest peer that fits). An arm that cannot be
compiled prints ``not_compiled`` with the error's first line. Without libtpu: one line saying skipped.
Run (minutes of CPU per program):
``.venv/bin/python bench/train_step_compiled.py [--recipe R1,R2] [--arms rljob,tunix_padded,...]
[--fill loguniform,0.5,0.7,0.9]``; arms run in separate processes can be combined into the ratio lines with
``--ratios-from FILE...`` (their JSON lines).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


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
VOCAB = 32_000  # the token ids' range in the synthetic rollouts (the shapes do not depend on it)


def emit(metric: str, value: object, **kw: object) -> None:
    print(json.dumps({"bench": BENCH, "metric": metric, "value": value, **kw}), flush=True)


def run_config(recipe: str) -> Any:
    import yaml
    from rljob.recipes.api import API_VERSION, KIND
    from rljob.recipes.plan import parse_manifest, resolve

    doc = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "sbs"},
        "spec": {"recipe": recipe, "storage": {"root": "gs://rljob-bench"}},
    }
    return resolve(parse_manifest(yaml.safe_dump(doc)))


@dataclasses.dataclass
class Trace:
    """One batch of rollout lengths (prompt, completion) and its rollouts."""

    name: str
    lengths: list[tuple[int, int]]
    rollouts: list[Any]

    @property
    def useful(self) -> int:
        return sum(p + c for p, c in self.lengths)


def trace_lengths(
    n: int, max_prompt: int, max_completion: int, seed: int, fill: str
) -> list[tuple[int, int]]:
    """``n`` (prompt, completion) lengths: ``loguniform`` (train_step_vs_tunix's spread) or a fill fraction F:
    prompts uniform in 256..max_prompt, completions max_completion x Beta(4m, 4(1-m)), m such that the mean
    rollout is F x (max_prompt + max_completion)."""
    if fill == "loguniform":
        out: list[tuple[int, int]] = cpu_bench.rollout_lengths(
            n, 1, seed, max_prompt=max_prompt, max_completion=max_completion
        )
        return out
    f = float(fill)
    rng = np.random.default_rng(seed)
    low = min(256, max_prompt)
    prompts = rng.integers(low, max_prompt + 1, n)
    m = (f * (max_prompt + max_completion) - (low + max_prompt) / 2) / max_completion
    m = min(max(m, 0.02), 0.98)
    completions = np.ceil(max_completion * rng.beta(4 * m, 4 * (1 - m), n)).astype(int)
    return [(int(p), max(int(c), 1)) for p, c in zip(prompts, completions, strict=True)]


def traces(rc: Any, seed: int, fills: list[str]) -> list[Trace]:
    alg = rc.spec.algorithm
    n = int(alg.group_size) * int(alg.groups_per_batch)
    out = []
    for fill in fills:
        lengths = trace_lengths(n, int(alg.max_prompt_tokens), int(alg.max_tokens), seed, fill)
        rollouts = cpu_bench.make_rollouts(lengths, VOCAB, int(alg.group_size), seed)
        name = fill if fill == "loguniform" else f"fill {float(fill):g}"
        out.append(Trace(name, lengths, rollouts))
    return out


def recipe_context(rc: Any) -> dict[str, Any]:
    alg = rc.spec.algorithm
    return {
        "recipe": rc.spec.recipe,
        "model": str(rc.trainer.maxtext.get("model_name")),
        "type": rc.trainer.tpu.type_name,
        "slices": rc.trainer.slices,
        "rollouts": int(alg.group_size) * int(alg.groups_per_batch),
        "row_limit": int(alg.max_prompt_tokens) + int(alg.max_tokens),
        "lora": {"rank": rc.spec.lora.rank, "targets": list(rc.spec.lora.targets)},
    }


def trace_context(t: Trace) -> dict[str, Any]:
    return {
        "trace": t.name,
        "useful_tokens": t.useful,
        "mean_rollout": round(t.useful / len(t.lengths), 1),
        "longest": max(p + c for p, c in t.lengths),
    }


# ---------------------------------------------------------------------------------------------- roofline


@dataclasses.dataclass(frozen=True)
class Roof:
    """Per-device peak figures of the trainer's chip: FLOP/s, HBM bytes/s, ICI bytes/s."""

    flops: float
    hbm: float
    ici: float
    source: str


def roof(rc: Any) -> Roof:
    from rljob.recipes.generations import BY_ACCELERATOR

    g = BY_ACCELERATOR[rc.trainer.tpu.accelerator]
    d = g.devices_per_chip
    return Roof(
        g.peak_bf16_tflops * 1e12 / d,
        g.hbm_gb_per_s * 1e9 / d,
        g.ici_gbps_per_chip * 1e9 / 8 / d,
        g.spec_source,
    )


def gathered_bytes(tree: Any) -> int:
    """Bytes a device receives to hold every sharded leaf of ``tree`` in full (one all-gather of each)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        if jax.numpy.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            continue  # a random key (a layer's dropout state): replicated, never gathered
        size = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
        shard = (
            leaf.sharding.shard_shape(leaf.shape)
            if getattr(leaf, "sharding", None) is not None
            else leaf.shape
        )
        total += size - int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def tensor_collective_bytes(cfg: Any, call_tokens: int, tensor: int) -> float:
    """Bytes a device moves for a tensor-parallel step (Megatron's layout, as MaxText shards heads and MLP
    columns): two all-reduces of the ``[tokens, emb]`` activations a layer in the forward pass, two in its
    rematerialised forward and two in the backward pass, each ring all-reduce 2 (n - 1) / n of the array."""
    if tensor <= 1:
        return 0.0
    activation = call_tokens * int(cfg.emb_dim) * np.dtype(str(cfg.dtype)).itemsize
    return 6.0 * int(cfg.num_decoder_layers) * 2 * (tensor - 1) / tensor * activation


def call_roofline(fig: dict[str, Any], collective_bytes: float, r: Roof) -> dict[str, Any]:
    """One call's roofline terms (seconds, per device) and its time: the largest of them."""
    terms = {
        "compute": float(fig["flops"]) / r.flops,
        "memory": float(fig["bytes_accessed"]) / r.hbm,
        "collectives": collective_bytes / r.ici if r.ici > 0 else 0.0,
    }
    bound = max(terms, key=lambda k: terms[k])
    return {"seconds": terms[bound], "bound": bound, "terms_s": terms, "collective_bytes": collective_bytes}


@dataclasses.dataclass
class Compiled:
    """An arm's compiled programs, what one call of each costs, and how a trace maps to calls."""

    arm: str
    programs: dict[str, dict[str, Any]]  # compilecheck figures per program
    calls: Callable[[Trace], dict[str, int]]  # calls of each program a step of the trace makes
    computed: Callable[[Trace], int]  # the tokens a step of the trace computes (pad included)
    tokens_per_device_per_call: float
    collective_bytes: dict[str, float]  # per program, per call, per device
    context: dict[str, Any]


def step_figures(c: Compiled, t: Trace, r: Roof, resident: int = 0) -> dict[str, Any]:
    calls = c.calls(t)
    roofs = {n: call_roofline(c.programs[n], c.collective_bytes.get(n, 0.0), r) for n in calls}
    seconds = sum(calls[n] * roofs[n]["seconds"] for n in calls)
    computed = c.computed(t)
    return {
        "peak_bytes_per_device": max(int(p["peak_bytes_per_device"]) for p in c.programs.values()) + resident,
        "fits": all(bool(p["fits"]) for p in c.programs.values()),
        "calls": calls,
        "computed_tokens": computed,
        "fill": round(t.useful / computed, 4),
        "tokens_per_device_per_call": c.tokens_per_device_per_call,
        "call_roofline": roofs,
        "roofline_seconds": seconds,
        "roofline_s_per_computed_token": seconds / computed,
        "useful_tokens_per_roofline_s": t.useful / seconds if seconds > 0 else 0.0,
    }


# ---------------------------------------------------------------------------------------------- rljob


def rljob_arm(rc: Any, traces: list[Trace]) -> Compiled:
    from rljob.trainer import compilecheck
    from rljob.trainer.main import model_setup
    from rljob.trainer.packing import pack_rollouts

    _, step_cfg, _ = model_setup(rc, "config", None)
    held: dict[str, Any] = {}
    programs = compilecheck.programs

    def capture(policy: Any, trainer: Any, pack: Any) -> Any:  # the abstract base weights' shardings
        held["base"] = policy.base
        held["devices"] = int(policy.mesh.size)
        return programs(policy, trainer, pack)

    compilecheck.programs = capture
    try:
        report, _ = compilecheck.compile_run(rc, only={"accumulate", "apply"})
    finally:
        compilecheck.programs = programs
    progs = report["programs"]
    failed = {n: p for n, p in progs.items() if "roofline_seconds" not in p}
    if failed:
        raise RuntimeError("; ".join(f"{n}: {p.get('error', 'does not fit')}" for n, p in failed.items()))
    per_call = step_cfg.micro_batches
    call_tokens = step_cfg.micro_batches * step_cfg.rows * step_cfg.budget

    def packed_rows(t: Trace) -> int:
        return len(pack_rollouts(t.rollouts, step_cfg.pack_config()))

    def calls(t: Trace) -> dict[str, int]:
        return {"accumulate": -(-packed_rows(t) // per_call), "apply": 1}

    return Compiled(
        "rljob",
        progs,
        calls,
        lambda t: calls(t)["accumulate"] * call_tokens,
        call_tokens / held["devices"],
        {"accumulate": 2.0 * gathered_bytes(held["base"])},
        {"mesh": report["mesh"], "shape": report["shape"]},
    )


# ---------------------------------------------------------------------------------------------- tunix


def padded_example(max_prompt: int, max_completion: int, rows: int, sharding: Any, reference: bool) -> Any:
    """Abstract ``tunix.rl.common.TrainExample`` of one padded call: ``rows`` rollouts, the prompt
    left-padded to maxPromptTokens and the completion right-padded to maxTokens (tunix's GRPO learner pads
    completions to the rollout config's ``max_tokens_to_generate``, prompts to its ``max_prompt_length``)."""
    import jax
    import jax.numpy as jnp
    from tunix.rl import common

    def sds(shape: tuple[int, ...], dtype: Any) -> Any:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding(len(shape)))  # type: ignore[no-untyped-call]

    p, c = max_prompt, max_completion
    return common.TrainExample(
        prompt_ids=sds((rows, p), "int32"),
        prompt_mask=sds((rows, p), "bool"),
        completion_ids=sds((rows, c), "int32"),
        completion_mask=sds((rows, c), "int32"),
        advantages=sds((rows,), "float32"),
        ref_per_token_logps=sds((rows, c), "float32") if reference else None,
        old_per_token_logps=sds((rows, c), "float32"),
    )


def packed_examples(t: Trace, budget: int) -> list[Any]:
    """tunix's packed TrainExamples of a trace (``tunix.rl.utils.pack_sequences`` at ``budget``)."""
    out: list[Any] = cpu_bench.tunix_examples(t.rollouts, True, budget)
    return out


def tunix_program(
    rc: Any,
    keys: dict[str, Any],
    *,
    lora: bool,
    example: Callable[[Any, Any], Any],
    row_length: int,
    calls: int,
    name: str,
    algo_keys: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, Any], float]:
    """(compilecheck Program, context, collective bytes per call) of tunix's RL actor train step: the MaxText
    model for ``keys`` (MaxText's output head on) wrapped by MaxText's ``TunixMaxTextAdapter``, with rljob's
    qwix LoRA on the recipe's targets when ``lora`` (else every parameter trained, as MaxText's RL trainer
    does), ``tunix.rl.trainer.Trainer`` (AdamW, gradients accumulated over ``calls`` calls by
    optax.MultiSteps as tunix's learner sets ``gradient_accumulation_steps``) with
    ``tunix.rl.algo_core.grpo_loss_fn``; its jitted body ``PeftTrainer._train_step`` lowered over the state
    tunix's ``nnx.jit`` passes and donates, the frozen base weights split out as an argument in the
    compiler's layout (Layout.AUTO). ``example(mesh, algo)``: the abstract TrainExample of one call."""
    import flax.linen as nn
    import jax
    import maxtext
    import optax
    from flax import nnx
    from jax.experimental.layout import Format, Layout
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
        "max_target_length": row_length,
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
    # The frozen base weights (every Param but the LoRA factors) apart; none when every weight is trained.
    frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)) if lora else nnx.Nothing
    graphdef, base, state = nnx.split(abstract, frozen, ...)  # type: ignore[misc]
    base_s = logical_shardings(base, cfg, mesh)
    state_s = logical_shardings(state, cfg, mesh)
    base = jax.tree.map(_abstract, base, base_s)
    state = jax.tree.map(_abstract, state, state_s)
    ex = example(mesh, algo)
    ex_s = jax.tree.map(lambda x: x.sharding, ex)

    def step(base: Any, state: Any, ex: Any) -> Any:
        m, o = nnx.merge(graphdef, base, state)
        with nn.logical_axis_rules(cfg.logical_axis_rules):
            loss, _, gnorm = trainer._train_step(m, o, ex)
        _, _, new = nnx.split((m, o), frozen, ...)  # type: ignore[misc]
        return loss, gnorm, new

    fn = jax.jit(
        step,
        donate_argnums=1,
        in_shardings=(jax.tree.map(lambda s: Format(Layout.AUTO, s), base_s), state_s, ex_s),
        out_shardings=(None, None, state_s),
    )
    call_tokens = int(np.prod(ex.completion_ids.shape)) + int(np.prod(ex.prompt_ids.shape))
    n = len(devices)
    flops = compilecheck.model_flops(cfg, call_tokens / n, backward=True)
    tensor = int(mesh.shape.get("tensor", 1))
    # FSDP: the sharded weights all-gathered (forward, and again in the backward pass); on a tensor axis
    # the weights stay put and the activations are all-reduced instead (tensor_collective_bytes)
    weights = 0 if tensor > 1 else gathered_bytes(base if lora else nnx.filter_state(state, nnx.Param))
    collectives = 2.0 * weights + tensor_collective_bytes(cfg, call_tokens, tensor)
    if not lora:  # every weight's gradient too: MaxText's full training count (weights x 3), reduce-scattered
        flops = (
            float(maxtext_utils.calculate_tflops_training_per_device(cfg, log=False)[0])
            * 1e12
            * (call_tokens / n)
            / (float(cfg.per_device_batch_size) * float(cfg.max_target_length))
        )
        grad_bytes = np.dtype(str(cfg.grad_dtype)).itemsize if getattr(cfg, "grad_dtype", None) else 4
        collectives += weights * grad_bytes / np.dtype(str(cfg.weight_dtype)).itemsize
    program = compilecheck.Program(name, fn, (base, state, ex), 0, "", flops)
    split = [ax for ax in ex_s.completion_ids.spec if ax is not None]
    over = 1
    for ax in split:
        for a in ax if isinstance(ax, tuple) else (ax,):
            over *= int(mesh.shape[a])
    ctx = {
        "mesh": {str(k): int(v) for k, v in mesh.shape.items() if int(v) > 1},
        "call_shape": [
            int(ex.completion_ids.shape[0]),
            int(ex.prompt_ids.shape[-1] + ex.completion_ids.shape[-1]),
        ],
        "call_tokens": call_tokens,
        "tokens_per_device_per_call": call_tokens / over,
        "adapter": "maxtext.integration.tunix.TunixMaxTextAdapter",
        "trains": "the LoRA factors" if lora else "every parameter",
        "base_layout": "Layout.AUTO" if lora else "none frozen",
        "beta": float(algo.beta),
    }
    return program, ctx, collectives


def batch_sharding(mesh: Any, rows: int) -> Callable[[int], Any]:
    """tunix's input sharding (``tunix.sft.sharding_utils.get_sharding``): the batch over the mesh's axes
    when it divides them, else replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    axes = tuple(str(k) for k, v in mesh.shape.items() if int(v) > 1)
    size = int(np.prod([int(mesh.shape[a]) for a in axes])) if axes else 1

    def sharding(ndim: int) -> Any:
        if not axes or rows % size:
            return NamedSharding(mesh, P())  # type: ignore[no-untyped-call]
        return NamedSharding(mesh, P(axes, *([None] * (ndim - 1))))  # type: ignore[no-untyped-call]

    return sharding


def compiled_peer(
    rc: Any,
    arm: str,
    keys: dict[str, Any],
    *,
    lora: bool,
    example: Callable[[Any, Any], Any],
    row_length: int,
    calls: Callable[[Trace], int],
    call_tokens_of: int,
    grad_steps: int,
    algo_keys: dict[str, Any] | None = None,
) -> Compiled:
    from rljob.trainer import compilecheck

    name = f"{arm}_train_step"
    program, ctx, collectives = tunix_program(
        rc,
        keys,
        lora=lora,
        example=example,
        row_length=row_length,
        calls=grad_steps,
        name=name,
        algo_keys=algo_keys,
    )
    chip = compilecheck.CHIPS[compilecheck.generation(rc)]
    fig = compilecheck.compile_one(program, chip)
    if "roofline_seconds" not in fig:
        raise RuntimeError(
            f"{name}: {fig.get('error', 'does not fit')} (peak {fig.get('peak_bytes_per_device')})"
        )
    return Compiled(
        arm,
        {name: fig},
        lambda t: {name: calls(t)},
        lambda t: calls(t) * call_tokens_of,
        float(ctx.pop("tokens_per_device_per_call")),
        {name: collectives},
        ctx,
    )


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


def padded_peer(
    rc: Any,
    arm: str,
    keys: dict[str, Any],
    rows: int,
    trs: list[Trace],
    *,
    lora: bool,
    algo: dict[str, Any] | None,
) -> Compiled:
    alg = rc.spec.algorithm
    mp, mc = int(alg.max_prompt_tokens), int(alg.max_tokens)

    def calls(t: Trace) -> int:
        return -(-len(t.lengths) // rows)

    def example(mesh: Any, algo_cfg: Any) -> Any:
        return padded_example(mp, mc, rows, batch_sharding(mesh, rows), float(algo_cfg.beta) > 0)

    return compiled_peer(
        rc,
        arm,
        keys,
        lora=lora,
        example=example,
        row_length=mp + mc,
        calls=calls,
        call_tokens_of=rows * (mp + mc),
        grad_steps=calls(trs[0]),
        algo_keys=algo,
    )


def tunix_padded_arm(rc: Any, trs: list[Trace], rows: int, fold_context: bool = False) -> Compiled:
    """tunix's RL learner step on the recipe's MaxText keys and LoRA, padded."""
    keys = peer_keys(dict(rc.trainer.maxtext), fold_context)
    return padded_peer(rc, "tunix_padded", keys, rows, trs, lora=True, algo=None)


def packed_keys(keys: dict[str, Any], variant: str) -> dict[str, Any]:
    """The MaxText keys of a tunix_packed variant. A packed call is one row, and MaxText's Splash attention
    asserts that the batch splits over the data and fsdp axes ("Batch dimension should be shardable among
    the devices in data and fsdp axis"), so on an fsdp mesh the packed path needs another configuration:
    ``tensor``: the fsdp axis turned into a tensor axis (the row's work split by heads and MLP columns, the
    batch axis 1); ``dot``: dot-product attention on the recipe's mesh (MaxText's RL config's attention)."""
    out = dict(keys)
    if variant == "tensor":
        for scope in ("ici", "dcn"):
            fsdp = int(out.get(f"{scope}_fsdp_parallelism", 1) or 1)
            out[f"{scope}_tensor_parallelism"] = int(out.get(f"{scope}_tensor_parallelism", 1) or 1) * fsdp
            out[f"{scope}_fsdp_parallelism"] = 1
    elif variant == "dot":
        out["attention"] = "dot_product"
    return out


def tunix_packed_arm(
    rc: Any, trs: list[Trace], rows: int, fold_context: bool = False, variant: str = ""
) -> Compiled:
    """tunix's RL learner step on its own packing (max_seq_token_per_tpu = the recipe's tokenBudget), on
    the recipe's keys or a :func:`packed_keys` variant."""
    import jax

    budget = int(rc.spec.packing.token_budget)
    keys = packed_keys(peer_keys(dict(rc.trainer.maxtext), fold_context), variant)
    counts = {t.name: len(packed_examples(t, budget)) for t in trs}
    first = packed_examples(trs[0], budget)[0]

    def example(mesh: Any, algo_cfg: Any) -> Any:
        sharding = batch_sharding(mesh, 1)
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x.ndim)),  # type: ignore[no-untyped-call]
            first,
        )

    out = compiled_peer(
        rc,
        f"tunix_packed{'_' + variant if variant else ''}",
        keys,
        lora=True,
        example=example,
        row_length=budget,
        calls=lambda t: counts[t.name],
        call_tokens_of=budget,
        grad_steps=counts[trs[0].name],
    )
    out.context["attention"] = keys.get("attention")
    return out


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


def maxtext_arm(rc: Any, trs: list[Trace], rows: int, fold_context: bool = False) -> Compiled:
    """MaxText 0.2.5's RL trainer step: tunix's actor step (its train_rl builds tunix's RLCluster and
    GrpoLearner) on MaxText's RL config's trainer keys and GRPO settings (configs/post_train/rl.yml:
    grpo_beta, grpo_epsilon, loss_algo, loss_agg_mode); every parameter trained (train_rl applies no LoRA:
    its actor is model_creation_utils.from_pretrained's model in TunixMaxTextAdapter)."""
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
    out = padded_peer(rc, "maxtext", keys, rows, trs, lora=False, algo=algo)
    out.context["maxtext_rl_keys"] = {k: keys[k] for k in MAXTEXT_RL_KEYS if k in keys}
    return out


PEERS: dict[str, Callable[..., Compiled]] = {
    "tunix_padded": tunix_padded_arm,
    "tunix_packed": tunix_packed_arm,
    "tunix_packed_tensor": functools.partial(tunix_packed_arm, variant="tensor"),
    "tunix_packed_dot": functools.partial(tunix_packed_arm, variant="dot"),
    "maxtext": maxtext_arm,
}


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--recipe",
        default="qwen3-8b-v5p,gpt-oss-20b-v5p",
        help="catalog recipes, comma-separated (default: the dense and the MoE recipe the comparison is of)",
    )
    ap.add_argument("--arms", default=",".join(["rljob", *PEERS]))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fill",
        default="loguniform,0.5,0.7,0.9",
        help="length traces: 'loguniform' and/or fill fractions (the mean rollout over the padded row)",
    )
    ap.add_argument(
        "--tunix-micro-batch",
        type=int,
        default=0,
        help="rollouts per padded peer call (default: rljob's rows per call, the same tokens per device)",
    )
    ap.add_argument(
        "--ratios-from",
        nargs="*",
        default=None,
        help="JSON-lines files of earlier runs (arms run apart): print only their ratio lines",
    )
    a = ap.parse_args(argv)
    if a.ratios_from is not None:
        steps = [
            json.loads(line)
            for f in a.ratios_from
            for line in Path(f).read_text().splitlines()
            if line.strip()
        ]
        ratios_from_lines([s for s in steps if s.get("metric") == "step"])
        return 0
    if importlib.util.find_spec("libtpu") is None:
        emit("skipped", "libtpu is not installed (the compile extra: pip install -e '.[compile]')")
        return 0
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for recipe in a.recipe.split(","):
        run_recipe(recipe, a.arms.split(","), a.seed, a.fill.split(","), a.tunix_micro_batch)
    return 0


def run_recipe(recipe: str, arms: list[str], seed: int, fills: list[str], micro_batch: int) -> None:
    """Every arm's programs for one recipe, its step per trace (JSON lines), then rljob's ratios."""
    from rljob.trainer.main import model_setup

    rc = run_config(recipe)
    r = roof(rc)
    trs = traces(rc, seed, fills)
    _, step_cfg, _ = model_setup(rc, "config", None)
    rows = micro_batch or step_cfg.micro_batches * step_cfg.rows
    ctx = recipe_context(rc) | {
        "roofline": "max(FLOPs / peak bf16, bytes accessed / HBM bandwidth, collective bytes / ICI "
        "bandwidth) per call and device, summed over the step's calls",
        "chip_per_device": {
            "flop_s": r.flops,
            "hbm_bytes_s": r.hbm,
            "ici_bytes_s": r.ici,
            "source": r.source,
        },
    }
    runs = [(n, False) for n in arms]
    if folds_context(rc):  # each peer also on the mesh it runs best on (peer_keys)
        runs += [(n, True) for n in arms if n in PEERS]
    lines: list[dict[str, Any]] = []
    for name, fold in runs:
        t0 = time.monotonic()
        label = f"{name}{' (context folded)' if fold else ''}"
        try:
            c = rljob_arm(rc, trs) if name == "rljob" else PEERS[name](rc, trs, rows, fold_context=fold)
        except Exception as e:
            first = str(e).strip().splitlines()[0][:400] if str(e).strip() else ""
            emit(
                "not_compiled",
                f"{type(e).__name__}: {first}",
                arm=label,
                where=traceback.format_exc().splitlines()[-3].strip(),
                seconds=round(time.monotonic() - t0, 1),
                **ctx,
            )
            continue
        for pname, fig in c.programs.items():
            emit(
                "program",
                fig.get("peak_bytes_per_device"),
                arm=label,
                program=pname,
                **fig,
                **c.context,
                **ctx,
            )
        for t in trs:
            fig = step_figures(c, t, r)
            line = {"arm": label, **fig, **c.context, **ctx, **trace_context(t)}
            emit("step", fig["useful_tokens_per_roofline_s"], **line)
            lines.append({"metric": "step", "value": fig["useful_tokens_per_roofline_s"], **line})
    ratios_from_lines(lines)


def ratios_from_lines(lines: list[dict[str, Any]]) -> None:
    """Per recipe and trace, rljob against the best peer arm that fits: useful tokens per roofline second
    (higher is better) against the fastest, with what the ratio is made of, and peak HBM per device (lower
    is better) against the leanest."""
    keys = sorted({(ln["recipe"], ln["trace"]) for ln in lines})
    for recipe, trace in keys:
        here = {ln["arm"]: ln for ln in lines if ln["recipe"] == recipe and ln["trace"] == trace}
        mine = here.get("rljob")
        peers = {k: v for k, v in here.items() if k != "rljob" and v.get("fits")}
        if mine is None or not peers:
            continue
        ctx = {"recipe": recipe, "trace": trace, "useful_tokens": mine["useful_tokens"]}
        fastest = max(peers, key=lambda k: float(peers[k]["useful_tokens_per_roofline_s"]))
        leanest = min(peers, key=lambda k: int(peers[k]["peak_bytes_per_device"]))
        p = peers[fastest]
        computed = float(p["computed_tokens"]) / float(mine["computed_tokens"])
        per_token = float(p["roofline_s_per_computed_token"]) / float(mine["roofline_s_per_computed_token"])
        emit(
            "rljob_over_best_peer_tokens_ratio",
            float(mine["useful_tokens_per_roofline_s"]) / float(p["useful_tokens_per_roofline_s"]),
            peer=fastest,
            made_of={
                "computed_tokens_ratio": computed,
                "per_computed_token_cost_ratio": per_token,
                "note": "peer computed tokens / rljob's x peer roofline seconds per computed token / rljob's",
                "rljob_bounds": {n: v["bound"] for n, v in mine["call_roofline"].items()},
                "peer_bounds": {n: v["bound"] for n, v in p["call_roofline"].items()},
            },
            peers={k: v["useful_tokens_per_roofline_s"] for k, v in peers.items()},
            **ctx,
        )
        q = peers[leanest]
        emit(
            "rljob_over_best_peer_peak_hbm_ratio",
            int(mine["peak_bytes_per_device"]) / int(q["peak_bytes_per_device"]),
            peer=leanest,
            tokens_per_device_per_call={
                "rljob": mine["tokens_per_device_per_call"],
                leanest: q["tokens_per_device_per_call"],
            },
            equal_tokens_per_device=float(mine["tokens_per_device_per_call"])
            == float(q["tokens_per_device_per_call"]),
            peers={k: v["peak_bytes_per_device"] for k, v in peers.items()},
            **ctx,
        )


if __name__ == "__main__":
    sys.exit(main())
