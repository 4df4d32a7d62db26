"""One RL train step, rljob's against tunix's own RL learner path, on the same tiny model and rollouts.

Both arms train the same tiny MaxText model (rljob.trainer.model.tiny_keys: qwen3 architecture, two
layers, float32, dot-product attention; the row length raised to the step's token budget) with the
same qwix LoRA (rank 8 on every projection, the same seeds) on the same RL-shaped rollouts: lengths
drawn like bench/packing_padding.py's (prompts 256..1,024, completions log-uniform 256..19,456), divided
by ``--scale`` so that a CPU runs them, with per-token old log-probs and group advantages. One train
step is one optimizer update over all the step's rollouts; nothing is sampled (both arms start from
rollouts).

  rljob         rljob.trainer.train_step.Trainer.train_on_batch: first-fit-decreasing packing into
                rows of the budget (pad_position end), the fused log-prob head (no [T, V] logits;
                the trainer's default tile and chunk, clamped by the head to these shapes),
                gradient accumulation over the packed rows in one compiled call, then AdamW.
  tunix_padded  tunix.rl.trainer.Trainer (the PeftTrainer subclass tunix's RL cluster trains the actor
                with) with tunix.rl.algo_core.grpo_loss_fn, as tunix's GRPO learner runs it by default
                (training_config.max_seq_token_per_tpu unset): one TrainExample of every rollout, the
                prompt left-padded to the longest prompt and the completion right-padded to the longest
                completion; log-probs by tunix.rl.common.compute_per_token_logps (full [B, T, V] logits).
  tunix_packed  the same trainer and loss on tunix's own packing (tunix.rl.utils.pack_sequences with
                max_seq_token_per_tpu = the budget, what the learner does when that is set): one
                [1, budget] row per packed example, one call each, the gradients summed over the rows by
                optax.MultiSteps (gradient_accumulation_steps = rows) into one update.

The model reaches tunix through MaxText's own adapter (maxtext.integration.tunix.TunixMaxTextAdapter)
when it can be built for the tiny model, else through a subclass that skips only its vLLM weight
mapping (the tiny model has no Hugging Face config); the bench says which. The LoRA factors get the
same sharding-metadata fix as in rljob's Policy (qwix copies the kernels' axis names onto them and
MaxText's layer scan refuses those under any trainer).

Metrics (JSON lines): useful_tokens_per_s per arm (prompt + completion tokens of the rollouts over the
wall time of the step after two warm-up steps; best of ``--repeats``, the arms' timed steps taken in
turn so that each sees the same machine load), temp_bytes per arm (the compiled
step's temporary memory, XLA memory_analysis; rljob: the larger of its accumulate and apply programs;
tunix: its train step program), and the ratios rljob over each tunix arm: rljob_over_tunix_tokens_ratio
(tokens/s) and rljob_over_tunix_temp_bytes_ratio. Run:
``.venv/bin/python bench/train_step_vs_tunix.py [--rollouts 16] [--scale 16] [--repeats 2] [--vocab 32768]``
(``--vocab``: the tiny model's vocabulary, by default 32,768 rather than its own 256, so that the log-prob
head weighs as it does on a real model, where tunix's [B, T, V] logits are its largest temporaries; the
full-size side-by-side on the TPU compiler is bench/train_step_compiled.py).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np


def emit(metric: str, value: object, **kw: object) -> None:
    print(json.dumps({"bench": "train_step_vs_tunix", "metric": metric, "value": value, **kw}), flush=True)


def rollout_lengths(
    n: int, scale: int, seed: int, max_prompt: int = 1024, max_completion: int = 19_456
) -> list[tuple[int, int]]:
    """``n`` (prompt, completion) lengths: prompts uniform in 256..max_prompt, completions log-uniform in
    256..max_completion, divided by ``scale``."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(256, max_prompt + 1, n) // scale
    completions = np.exp(rng.uniform(np.log(256), np.log(max_completion), n)).astype(int) // scale
    return [(max(int(p), 1), max(int(c), 1)) for p, c in zip(prompts, completions, strict=True)]


def make_rollouts(lengths: list[tuple[int, int]], vocab: int, group: int, seed: int) -> list[Any]:
    from rljob.trainer.packing import Rollout

    rng = np.random.default_rng(seed + 1)
    rewards = rng.integers(0, 2, len(lengths)).astype(np.float32)
    out = []
    for i, (p, c) in enumerate(lengths):
        g = rewards[(i // group) * group : (i // group + 1) * group]
        adv = float(rewards[i] - g.mean())
        out.append(
            Rollout(
                rng.integers(2, vocab, p),
                rng.integers(2, vocab, c),
                advantage=adv,
                per_token={"old_logprobs": (rng.normal(size=c) * 0.1 - np.log(vocab)).astype(np.float32)},
            )
        )
    return out


def _temp_bytes(mem: Any) -> int:
    """The temporary bytes of a compiled step's memory analysis (None on backends without one)."""
    assert mem is not None, "the backend gave no memory analysis"
    return int(mem.temp_size_in_bytes)


def _setup_peak() -> int:
    """The allocator's peak before an arm's warm-up steps (0 on the CPU, which keeps no statistics): what
    building its model reached, told apart from its steps' (rljob.trainer.chip_memory.step_peak)."""
    import jax
    from rljob.trainer import chip_memory

    return chip_memory.allocator_stats(jax.devices()[0]).get("peak_bytes_in_use", 0)


def rljob_arm(keys: dict[str, Any], rollouts: list[Any], budget: int) -> dict[str, Any]:
    import jax
    from rljob.trainer.losses import LossConfig
    from rljob.trainer.model import ModelSpec, Policy
    from rljob.trainer.packing import pack_rollouts
    from rljob.trainer.train_step import StepConfig, Trainer, stack_micro_batches

    policy = Policy(ModelSpec(maxtext=keys, lora_rank=8, lora_alpha=16.0))
    probe = StepConfig(budget=budget, rows=1)
    rows = len(pack_rollouts(rollouts, probe.pack_config()))
    cfg = StepConfig(
        budget=budget,
        rows=1,
        micro_batches=rows,
        learning_rate=1e-5,
        loss=LossConfig(kind="ppo", clip_low=0.2, clip_high=0.2),
    )
    trainer = Trainer(policy, cfg)
    state = trainer.init_state()
    setup_peak = _setup_peak()
    for _ in range(2):  # compiles (two warm-up steps, as for tunix)
        state, _ = trainer.train_on_batch(state, rollouts)
    held = {"state": state}
    # The compiler's own memory figures (the chip bench adds them to the bytes the process holds).
    call = stack_micro_batches(pack_rollouts(rollouts, cfg.pack_config()), cfg.micro_batches)[0]
    acc = trainer.zero_acc(state.lora)
    batch = trainer.device_batch(call)
    acc_mem = trainer.compiled_accumulate(acc, state.lora, batch).memory_analysis()
    apply_mem = trainer.apply.lower(state, acc).compile().memory_analysis()
    temp = float(max(_temp_bytes(acc_mem), _temp_bytes(apply_mem)))

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        new, metrics = trainer.train_on_batch(held["state"], rollouts)
        jax.block_until_ready(new)  # type: ignore[no-untyped-call]
        held["state"] = new
        return time.perf_counter() - t0, float(metrics["loss"])

    def pack_seconds() -> float:  # the step's host-side packing alone (median of 3)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            pack_rollouts(rollouts, cfg.pack_config())
            times.append(time.perf_counter() - t0)
        return sorted(times)[1]

    return {
        "step": step,
        "pack_seconds": pack_seconds,
        "temp_bytes": temp,
        "setup_peak_bytes": setup_peak,
        "rows": float(rows),
        "row_tokens": float(rows * budget),
    }


def tunix_model(keys: dict[str, Any], sample_tokens: int = 8) -> tuple[Any, str]:
    """The tiny MaxText model with the same LoRA, as tunix calls it, and which adapter was used.
    ``sample_tokens``: the length of the sample call qwix makes to create the factors (Splash attention
    refuses a row shorter than its 128-lane block, so a TPU run with ``attention: flash`` passes 512)."""
    from pathlib import Path

    import jax
    import maxtext
    import qwix
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.integration.tunix.tunix_adapter import TunixMaxTextAdapter
    from rljob.trainer.lora import lora_sharding_meta
    from rljob.trainer.model import _RUNTIME_KEYS, _sample_inputs, build_model

    merged = {**keys, **_RUNTIME_KEYS, "num_vocab_tiling": 1}  # tunix reads the logits
    cfg = pyconfig.initialize(["", str(Path(maxtext.__file__).parent / "configs" / "base.yml")], **merged)
    model = build_model(cfg, 0)
    provider = qwix.LoraProvider(module_path=r".*/(key|out|query|value|wi_0|wi_1|wo)", rank=8, alpha=16.0)
    toks, pos, seg = _sample_inputs(sample_tokens)
    lora = qwix.apply_lora_to_model(
        model, provider, toks, pos, decoder_segment_ids=seg, enable_dropout=False, rngs=nnx.Rngs(1000)
    )
    nnx.pop(lora, nnx.Intermediate)
    # qwix copies the kernels' logical axis names onto the LoRA factors and MaxText's layer scan then
    # refuses them; the same metadata fix as rljob's Policy (rljob.trainer.lora.lora_sharding_meta).
    graphdef, lora_state, rest = nnx.split(lora, nnx.LoRAParam, ...)  # type: ignore[misc]  # nnx types the split as variadic
    lora_state = jax.tree.map(lora_sharding_meta, lora_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    lora = nnx.merge(graphdef, lora_state, rest)
    try:
        return TunixMaxTextAdapter(lora, use_no_op_mappings=True), "TunixMaxTextAdapter"
    except Exception as e:
        reason = f"{type(e).__name__}: {e}"

    class Adapter(TunixMaxTextAdapter):  # type: ignore[misc]
        def __init__(self, base: Any) -> None:
            nnx.Module.__init__(self)
            self.base = base
            self.use_no_op_mappings = True
            self._pad_id = None

    return Adapter(lora), f"TunixMaxTextAdapter without its vLLM mapping ({reason.splitlines()[0][:120]})"


def tunix_examples(
    rollouts: list[Any],
    packed: bool,
    budget: int,
    micro_batch: int | None = None,
    align: int = 1,
    row_align: int = 1,
) -> list[Any]:
    """tunix's TrainExamples of ``rollouts``: padded (one example, or ``micro_batch`` rollouts each, as its
    RLTrainingConfig.training_micro_batch_size splits them), or packed to ``budget`` tokens a row. The
    prompts are padded to the longest prompt and the completions to the longest completion, each rounded up
    to ``align`` (tunix pads to its configured max_prompt_length and total_generation_steps; with Splash
    attention on a TPU those must be multiples of its 128-token block), and the completions further so that a
    padded row (prompt and completion) is a multiple of ``row_align`` (MaxText's Splash query block, 512)."""
    import jax
    import jax.numpy as jnp
    from tunix.rl import common
    from tunix.rl import utils as rl_utils

    pl = -(-max(int(np.size(r.prompt_ids)) for r in rollouts) // align) * align
    cl = -(-max(int(np.size(r.completion_ids)) for r in rollouts) // align) * align
    cl = -(-(pl + cl) // row_align) * row_align - pl
    b = len(rollouts)
    p_ids = np.zeros((b, pl), np.int32)
    c_ids = np.zeros((b, cl), np.int32)
    c_mask = np.zeros((b, cl), np.int32)
    old = np.zeros((b, cl), np.float32)
    for i, r in enumerate(rollouts):
        p, c = np.asarray(r.prompt_ids), np.asarray(r.completion_ids)
        p_ids[i, pl - p.size :] = p  # tunix left-pads prompts
        c_ids[i, : c.size] = c
        c_mask[i, : c.size] = 1
        old[i, : c.size] = r.per_token["old_logprobs"]
    example = common.TrainExample(
        prompt_ids=jnp.asarray(p_ids),
        prompt_mask=jnp.asarray(p_ids != 0),
        completion_ids=jnp.asarray(c_ids),
        completion_mask=jnp.asarray(c_mask),
        advantages=jnp.asarray([r.advantage for r in rollouts], jnp.float32),
        ref_per_token_logps=None,
        old_per_token_logps=jnp.asarray(old),
    )
    if not packed:
        if not micro_batch:
            return [example]
        return [
            jax.tree.map(lambda x, i=i: x[i : i + micro_batch], example) for i in range(0, b, micro_batch)
        ]
    out: list[Any] = []
    for group in rl_utils.pack_sequences(iter([[example]]), budget, pad_id=0):
        out.extend(group)
    return out


def tunix_arm(
    keys: dict[str, Any],
    rollouts: list[Any],
    budget: int,
    packed: bool,
    micro_batch: int | None = None,
    align: int = 1,
    sample_tokens: int = 8,
    row_align: int = 1,
) -> dict[str, Any]:
    import jax
    import optax
    from flax import nnx
    from tunix.rl import algo_core
    from tunix.rl import trainer as rl_trainer
    from tunix.rl.grpo.grpo_learner import GRPOConfig
    from tunix.sft import peft_trainer

    examples = tunix_examples(rollouts, packed, budget, micro_batch, align, row_align)
    model, adapter = tunix_model(keys, sample_tokens)
    algo = GRPOConfig(num_generations=4, beta=0.0, epsilon=0.2)
    algo.temperature = 1.0  # GRPOLearner sets it from the rollout config
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))
    trainer = rl_trainer.Trainer(
        model,
        opt,
        peft_trainer.TrainingConfig(
            eval_every_n_steps=10**9, max_steps=10**6, gradient_accumulation_steps=len(examples)
        ),
        custom_checkpoint_metadata_fn=dict,
    )
    trainer.with_loss_fn(algo_core.grpo_loss_fn, has_aux=True)
    trainer.with_gen_model_input_fn(
        lambda ex: {"train_example": ex, "algo_config": algo, "pad_id": 0, "eos_id": 1}
    )
    train_step, _ = trainer.jit_train_and_eval_step()

    def one_step() -> Any:
        out = None
        for ex in examples:
            out = train_step(ex)
        return out

    # Two warm-up steps: tunix's step compiles again after the first update, once the optimizer state
    # carries its shardings (PeftTrainer._shard_optimizer says as much)
    setup_peak = _setup_peak()
    for _ in range(2):
        jax.block_until_ready(one_step())  # type: ignore[no-untyped-call]

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = one_step()
        jax.block_until_ready(out)  # type: ignore[no-untyped-call]
        return time.perf_counter() - t0, float(out[0])

    # As rljob_arm: the compiler's figures.
    graphdef, split_state = nnx.split((trainer.model, trainer.optimizer))

    def pure(state: Any, ex: Any) -> Any:
        m, o = nnx.merge(graphdef, state)
        loss, _, gnorm = trainer._train_step(m, o, ex)
        return loss, gnorm, nnx.state((m, o))

    temp = float(_temp_bytes(jax.jit(pure).lower(split_state, examples[0]).compile().memory_analysis()))
    shape = tuple(int(x) for x in examples[0].completion_ids.shape)
    return {
        "step": step,
        "temp_bytes": temp,
        "setup_peak_bytes": setup_peak,
        "calls": float(len(examples)),
        "row_tokens": float(
            sum(int(np.prod(e.completion_ids.shape)) + int(np.prod(e.prompt_ids.shape)) for e in examples)
        ),
        "adapter": adapter,
        "example_shape": list(shape),
    }


def arm_fields(m: dict[str, Any]) -> dict[str, Any]:
    """What an arm's output line carries besides its tokens/s: its figures, not its callables (``step``,
    ``pack_seconds``) nor what has a line of its own (``seconds``, ``temp_bytes``)."""
    return {k: v for k, v in m.items() if k not in ("seconds", "temp_bytes") and not callable(v)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=32_768, help="the tiny model's vocabulary (its own: 256)")
    a = ap.parse_args()
    from rljob.trainer.model import tiny_keys
    from rljob.trainer.packing import align_up

    lengths = rollout_lengths(a.rollouts, a.scale, a.seed)
    budget = align_up(19_456 // a.scale + 1024 // a.scale, 128)
    keys = tiny_keys(max_target_length=budget, vocab_size=a.vocab)
    rollouts = make_rollouts(lengths, int(keys["vocab_size"]), a.group, a.seed)
    useful = sum(p + c for p, c in lengths)
    ctx = {
        "rollouts": a.rollouts,
        "scale": a.scale,
        "budget": budget,
        "useful_tokens": useful,
        "longest": max(p + c for p, c in lengths),
        "model": f"tiny qwen3 (2 layers, 64 wide, vocab {a.vocab}, float32)",
        "backend": "cpu",
    }
    arms: dict[str, dict[str, Any]] = {}
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "rljob": lambda: rljob_arm(keys, rollouts, budget),
        "tunix_padded": lambda: tunix_arm(keys, rollouts, budget, packed=False),
        "tunix_packed": lambda: tunix_arm(keys, rollouts, budget, packed=True),
    }

    def failed(name: str, e: Exception) -> None:
        emit(
            "arm_failed",
            f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
            arm=name,
            where=traceback.format_exc().splitlines()[-3].strip(),
            **ctx,
        )

    for name, run in runners.items():
        try:
            arms[name] = run()
        except Exception as e:
            failed(name, e)
    # The timed steps round-robin over the arms, so that every arm sees the same machine load.
    for _ in range(a.repeats):
        for name, m in list(arms.items()):
            try:
                seconds, loss = m["step"]()
            except Exception as e:
                failed(name, e)
                del arms[name]
                continue
            m["seconds"], m["loss"] = min(m.get("seconds", float("inf")), seconds), loss
    for name, m in arms.items():
        extra = arm_fields(m)
        emit(
            "useful_tokens_per_s",
            round(useful / m["seconds"], 1),
            arm=name,
            step_s=round(m["seconds"], 4),
            **extra,
            **ctx,
        )
        emit("temp_bytes", m["temp_bytes"], arm=name, **ctx)
    if "rljob" in arms:
        for name in ("tunix_padded", "tunix_packed"):
            if name not in arms:
                continue
            r, t = arms["rljob"], arms[name]
            emit(
                "rljob_over_tunix_tokens_ratio", round(t["seconds"] / r["seconds"], 3), tunix_arm=name, **ctx
            )
            emit(
                "rljob_over_tunix_temp_bytes_ratio",
                round(r["temp_bytes"] / t["temp_bytes"], 3),
                tunix_arm=name,
                **ctx,
            )


if __name__ == "__main__":
    main()
