"""The compiled train step: packed micro-batches, fused log-prob head, GRPO loss, LoRA-only optax update.

One step takes a step's rollouts, packs them (rljob.trainer.packing) into micro-batches of one shape
``[rows, budget]`` and stacks ``micro_batches`` of them into one compiled call:

- :meth:`Trainer.accumulate` (compiled once, the gradient buffer donated) runs ``lax.scan`` over the stacked
  micro-batches and adds each micro-batch's gradient into the buffer; a step that packs into more
  micro-batches than one call holds calls it again with the same shape (padding micro-batches are
  all-pad and contribute exactly zero), so every run compiles each function once;
- :meth:`Trainer.apply` (jit, the train state donated) runs the AdamW update at the step's learning
  rate (:func:`learning_rate_at`: warm-up, then constant, linear or cosine) on the LoRA parameters
  only (the base weights are not an argument), and skips the update, keeping parameters and
  optimizer state, when the loss, a gradient or an update is non-finite; skips are counted. Its
  outputs reuse the donated state buffers.

Per-token loss weights are fixed on the host for the whole step (``loss_mask / tokens in the step``,
or a packed ``loss_weight`` field), so the loss and its gradient do not depend on the layout:
packed == unpacked, one micro-batch == many.

On the policy's mesh (the spec's MaxText ``ici_*``/``dcn_*`` keys): the base parameters lie as MaxText's
logical axis rules shard them, the LoRA parameters, optimizer state and gradient buffer as their logical
names say (replicated but for the scan axis), and each call's batch is one global array with its rows
split over the batch axes (data, fsdp, ...) as MaxText's input data sharding says (:func:`batch_sharding`).
Both functions are compiled with these shardings for their arguments and results, so a step's output
state feeds the next step without a reshard or a second compilation. tests/trainer/test_sharded_step.py
checks a four-device run against one device.

  trainer = Trainer(policy, StepConfig(...))
  state = trainer.init_state()
  state, metrics = trainer.train_on_batch(state, rollouts)     # rollouts: list[packing.Rollout]
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rljob.recipes import models
from rljob.trainer.logprobs import DEFAULT_TOKEN_TILE, DEFAULT_VOCAB_CHUNK
from rljob.trainer.losses import LossConfig, all_finite, guard_update, policy_loss
from rljob.trainer.model import LoraState, Policy
from rljob.trainer.packing import (
    DEFAULT_KERNEL_BLOCKS,
    PackConfig,
    PackedBatch,
    Rollout,
    pack_rollouts,
    padding_fraction,
)
from rljob.trainer.placement import abstract, lay_out, put_global

__all__ = [
    "BATCH_FIELDS",
    "StepConfig",
    "TrainState",
    "Trainer",
    "batch_dtype",
    "batch_sharding",
    "learning_rate_at",
    "stack_micro_batches",
]

BATCH_FIELDS = ("tokens", "segment_ids", "positions", "weights", "advantages", "old_logprobs")
_INT_FIELDS = ("tokens", "segment_ids", "positions")


def batch_dtype(field: str) -> Any:
    """The dtype of one of :data:`BATCH_FIELDS` on the device: int32 ids and positions, float32 else."""
    return jnp.dtype(jnp.int32 if field in _INT_FIELDS else jnp.float32)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Shapes and hyper-parameters of the compiled step (all static for a run)."""

    budget: int  # tokens per packed row
    rows: int = 1  # rows per micro-batch
    micro_batches: int = 1  # micro-batches per compiled accumulate call
    learning_rate: float = 1e-4
    max_grad_norm: float = 1.0  # MaxText gradient_clipping_threshold (0: no clipping)
    weight_decay: float = 0.0  # MaxText adam_weight_decay
    # The learning rate per step (learning_rate_at): spec.algorithm.warmupSteps, .learningRateSchedule
    # and .steps (the step the decay reaches 0 after; 0: no decay).
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | linear | cosine
    total_steps: int = 0
    # AdamW (MaxText adam_b1, adam_b2, adam_eps, adam_eps_root, mu_dtype) and the gradient buffer's dtype
    # (grad_dtype); None: the parameters' dtype.
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    adam_eps_root: float = 0.0
    mu_dtype: str | None = None
    grad_dtype: str | None = None
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    token_tile: int = DEFAULT_TOKEN_TILE  # spec.trainer.logprobs.tokenTile
    vocab_chunk: int = DEFAULT_VOCAB_CHUNK  # spec.trainer.logprobs.vocabChunk
    pad_position: str = "end"
    pad_align: int = 4096
    segment_align: int = 64
    # pad_position "balanced": the attention tile model (recipes.maxtext_keys.attention_tile_model)
    context_ranks: int = 1
    kernel_blocks: tuple[tuple[int, int], ...] = DEFAULT_KERNEL_BLOCKS
    dual_chunk_swap: bool = True
    # rollouts per packed row (None: as many as fit); spec.packing.maxSegmentsPerRow
    max_segments: int | None = None

    def pack_config(self) -> PackConfig:
        kw: dict[str, Any] = {}
        if self.pad_position in ("start", "balanced"):
            kw["pad_align"] = self.pad_align
        if self.pad_position == "balanced":
            kw.update(
                context_ranks=self.context_ranks,
                kernel_blocks=self.kernel_blocks,
                dual_chunk_swap=self.dual_chunk_swap,
            )
        return PackConfig(
            budget=self.budget,
            rows=self.rows,
            segment_align=self.segment_align,
            pad_position=self.pad_position,  # type: ignore[arg-type]
            max_segments=self.max_segments,
            **kw,
        )


def learning_rate_at(cfg: StepConfig, step: jax.Array | int) -> jax.Array:
    """The learning rate of optimizer step ``step`` (0-based; TrainState.step, skipped steps included):
    ``learning_rate x (step + 1) / (warmup_steps + 1)`` during the warm-up, then constant, or decaying
    linearly or along a half cosine (optax linear_schedule / cosine_decay_schedule) from
    ``learning_rate`` at step ``warmup_steps`` towards 0 after the last step (``total_steps - 1``), so
    that no step trains at rate 0."""
    s = jnp.asarray(step, jnp.float32)
    lr = jnp.float32(cfg.learning_rate)
    warm = cfg.warmup_steps
    if cfg.lr_schedule == "constant" or cfg.total_steps <= warm:
        after = lr
    else:
        span = cfg.total_steps - warm
        decay = (
            optax.linear_schedule(cfg.learning_rate, 0.0, span)
            if cfg.lr_schedule == "linear"
            else optax.cosine_decay_schedule(cfg.learning_rate, span)
        )
        after = jnp.asarray(decay(jnp.maximum(s - warm, 0.0)), jnp.float32)
    if warm <= 0:
        return after
    return jnp.where(s < warm, lr * (s + 1.0) / (warm + 1.0), after)


def model_problem(cfg: StepConfig, decoder_block: str) -> str | None:
    """Why ``cfg`` cannot train a model of ``decoder_block``, or None. A decoder with gated delta net
    layers (rljob.recipes.models.RECURRENT_DECODER_BLOCKS) trains one rollout per row with the padding at
    the end; the plan resolves spec.packing so (spec.packing.maxSegmentsPerRow 1, padPosition end) and
    the step follows it, so this only catches a step config that did not come from the plan."""
    if not models.recurrent(decoder_block):
        return None
    if cfg.max_segments == 1 and cfg.pad_position == "end":
        return None
    return (
        f"spec.packing.maxSegmentsPerRow: the {decoder_block} decoder has gated delta net layers and trains "
        f"one rollout per row with padPosition end; the step has max_segments {cfg.max_segments}, "
        f"pad_position {cfg.pad_position}"
    )


class TrainState(NamedTuple):
    lora: LoraState
    opt_state: Any
    step: jax.Array  # int32: optimizer steps taken (skipped ones included)
    skipped: jax.Array  # int32: steps whose update was non-finite and not applied


def stack_micro_batches(packed: list[PackedBatch], micro_batches: int) -> list[dict[str, np.ndarray]]:
    """Host arrays ``[micro_batches, rows, budget]`` per field, in as many calls as needed.

    Weights: a packed ``loss_weight`` field times the loss mask if present, else the loss mask divided
    by the step's total of masked tokens (one global token mean over the step). Advantages: a packed
    per-token ``advantages`` field if present (the Tinker service's per-token advantages), else each
    rollout's scalar advantage on its completion tokens."""
    if not packed:
        raise ValueError("no micro-batches to stack")
    total = float(sum(b.loss_mask.sum() for b in packed))

    def arrays(b: PackedBatch) -> dict[str, np.ndarray]:
        if "old_logprobs" not in b.fields:
            raise ValueError("rollouts: per_token['old_logprobs'] (the sampler's log-probs) is required")
        if "loss_weight" in b.fields:
            w = b.loss_mask * b.fields["loss_weight"]
        else:
            w = b.loss_mask / max(total, 1.0)
        out = {
            "tokens": b.tokens,
            "segment_ids": b.segment_ids,
            "positions": b.positions,
            "weights": w.astype(np.float32),
            "advantages": b.fields.get("advantages", b.advantages),
            "old_logprobs": b.fields["old_logprobs"],
        }
        return out

    per = [arrays(b) for b in packed]
    empty = {k: np.zeros_like(v) for k, v in per[0].items()}
    calls = []
    for start in range(0, len(per), micro_batches):
        chunk = per[start : start + micro_batches]
        chunk += [empty] * (micro_batches - len(chunk))
        calls.append({k: np.stack([c[k] for c in chunk]) for k in BATCH_FIELDS})
    return calls


def batch_sharding(policy: Policy, rows: int, budget: int) -> NamedSharding:
    """How the stacked micro-batches ``[micro_batches, rows, budget]`` lie on the policy's mesh: rows and
    tokens as :meth:`Policy.batch_axes` splits them (MaxText's input data sharding), the micro-batch
    axis whole on every device."""
    return NamedSharding(policy.mesh, P(None, *policy.batch_axes(rows, budget)))  # type: ignore[no-untyped-call]


class Trainer:
    """Compiled accumulate/apply functions of one run (see the module docstring)."""

    def __init__(self, policy: Policy, cfg: StepConfig) -> None:
        self.policy = policy
        problem = model_problem(cfg, policy.spec.decoder_block)
        if problem is not None:
            raise ValueError(problem)
        self.cfg = cfg
        self.with_ref = cfg.loss.kl_coef > 0
        if cfg.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"spec.algorithm.learningRateSchedule: unknown schedule {cfg.lr_schedule!r}")
        # AdamW as optax.adamw chains it (scale_by_adam, add_decayed_weights, scale_by_learning_rate),
        # the last part in _apply: the rate follows the step count of the train state
        # (learning_rate_at), which counts every step, those without an update included.
        self.optimizer = optax.chain(
            optax.clip_by_global_norm(cfg.max_grad_norm) if cfg.max_grad_norm > 0 else optax.identity(),
            optax.scale_by_adam(
                b1=cfg.adam_b1,
                b2=cfg.adam_b2,
                eps=cfg.adam_eps,
                eps_root=cfg.adam_eps_root,
                mu_dtype=jnp.dtype(cfg.mu_dtype) if cfg.mu_dtype else None,
            ),
            optax.add_decayed_weights(cfg.weight_decay),
        )
        self.grad_dtype = jnp.dtype(cfg.grad_dtype) if cfg.grad_dtype else None
        # Shardings of the compiled functions' arguments and results, fixed for the run (so each compiles
        # once): base and LoRA parameters as the policy lays them out (MaxText's logical axis rules), the
        # optimizer state like the LoRA parameters, the batch per batch_sharding, scalars replicated.
        self.replicated = NamedSharding(policy.mesh, P())  # type: ignore[no-untyped-call]
        self.batch_sharding = batch_sharding(policy, cfg.rows, cfg.budget)
        lora_s = policy.lora_sharding
        opt_s = optax.tree_map_params(
            self.optimizer,
            lambda _, s: s,
            jax.eval_shape(self.optimizer.init, policy.lora0),
            lora_s,
            transform_non_params=lambda _: self.replicated,
        )
        self.state_sharding = TrainState(lora_s, opt_s, self.replicated, self.replicated)  # type: ignore[arg-type]
        self.acc_sharding = (lora_s, self.replicated)
        # The frozen base weights in the memory layout the compiler picks for this program (Layout.AUTO):
        # MaxText stacks a scanned layer's weights with the layer axis inside (param_scan_axis 1), and in
        # the default layout XLA copies every stacked weight into a layer-major one on each call to slice
        # a layer (on gpt-oss-20b's v5p-16 mesh, 4.9 GB of routed-expert weights a device). The step
        # compiles once with the abstract base and puts the base in the layouts it chose
        # (:meth:`compiled_accumulate`; docs/drill.md, "rljob drill --compile").
        base_auto = jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), policy.base)
        self.accumulate_program = jax.jit(
            self._accumulate,
            donate_argnums=(0,),
            in_shardings=(self.acc_sharding, lora_s, base_auto, self.batch_sharding),
            out_shardings=self.acc_sharding,
        )
        self._accumulate_compiled: Any = None
        self.apply = jax.jit(
            self._apply,
            donate_argnums=(0,),
            in_shardings=(self.state_sharding, self.acc_sharding),
            out_shardings=(self.state_sharding, self.replicated),
        )

    # ------------------------------------------------------------------ state

    def init_state(self, lora: LoraState | None = None) -> TrainState:
        lora = self.policy.lora0 if lora is None else lora
        lora = jax.tree.map(jnp.array, lora)  # own copies: the step donates its inputs
        state = TrainState(lora, self.optimizer.init(lora), jnp.int32(0), jnp.int32(0))
        out: TrainState = jax.tree.map(put_global, state, self.state_sharding)
        return out

    def abstract_state(self) -> TrainState:
        out: TrainState = jax.eval_shape(self.init_state)
        return out

    def step_arguments(self) -> tuple[Any, LoraState, dict[str, Any]]:
        """:attr:`accumulate_program`'s arguments but the base weights, abstract: the gradient buffer, the
        adapter and one call's ``[micro_batches, rows, budget]`` batch as ShapeDtypeStructs placed by this
        step's shardings. :meth:`lay_out_base` compiles with them and the compile stage
        (rljob.trainer.compilecheck) lowers with them, so both ask JAX's cache for one program."""
        cfg = self.cfg
        lora = abstract(jax.eval_shape(self.init_state, self.policy.lora0), self.state_sharding).lora
        acc = abstract(jax.eval_shape(self.zero_acc, self.policy.lora0), self.acc_sharding)
        shape = (cfg.micro_batches, cfg.rows, cfg.budget)
        batch = {
            k: jax.ShapeDtypeStruct(shape, batch_dtype(k), sharding=self.batch_sharding)  # type: ignore[no-untyped-call]
            for k in BATCH_FIELDS
        }
        return acc, lora, batch

    def lay_out_base(self) -> Any:
        """Compile :attr:`accumulate_program` (or load it from JAX's cache) and put the policy's base weights
        in the layouts it chose (:meth:`compiled_accumulate`), before anything else reads them: every
        program that reads the base (the parity gate's scoring) then compiles for those layouts, whether it
        runs before the first step or after it, and the compile stage compiles it so (one program, a cache
        hit either way). Returns the compiled program."""
        return self.compiled_accumulate(*self.step_arguments())

    # ------------------------------------------------------------------ compiled parts

    def micro_logprobs(
        self, lora: LoraState, mb: dict[str, jax.Array], base: Any = None, head: jax.Array | None = None
    ) -> jax.Array:
        """[rows, budget] next-token log-probs of one micro-batch (the fused head, this step's tiles).

        ``head``: :meth:`Policy.head_operand` for this shape (computed here when not given)."""
        return self.policy.next_token_logprobs(
            lora,
            mb["tokens"],
            mb["positions"],
            mb["segment_ids"],
            token_tile=self.cfg.token_tile,
            vocab_chunk=self.cfg.vocab_chunk,
            base=base,
            head=head,
        )

    def micro_loss(
        self, lora: LoraState, mb: dict[str, jax.Array], base: Any = None, head: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Loss of one micro-batch ``[rows, budget]`` (weights are step-global, so losses add up).

        ``head``: :meth:`Policy.head_operand` for this shape, computed once per call outside the loop
        over micro-batches. With a KL penalty the reference log-probs are the base policy's (the adapter
        off: every LoRA factor 0), one more forward pass of the same packed rows, no gradient."""
        lp = self.micro_logprobs(lora, mb, base, head)
        ref = None
        if self.with_ref:
            ref = jax.lax.stop_gradient(self.micro_logprobs(self.policy.zero_lora(lora), mb, base, head))
        return policy_loss(
            lp,
            mb["old_logprobs"],
            mb["advantages"],
            mb["weights"],
            self.cfg.loss,
            ref_logprobs=ref,
            segments=mb["segment_ids"],
        )

    def _accumulate(
        self, acc: tuple[Any, dict[str, jax.Array]], lora: LoraState, base: Any, batch: dict[str, jax.Array]
    ) -> tuple[Any, dict[str, jax.Array]]:
        grad_fn = jax.value_and_grad(self.micro_loss, has_aux=True)
        # The head laid out for the log-prob head once per call: inside the loop only its vocabulary
        # blocks move (no per-micro-batch all-gather of [H, V]).
        head = self.policy.head_operand(lora, self.cfg.rows, self.cfg.budget, base)

        def body(carry: tuple[Any, dict[str, jax.Array]], mb: dict[str, jax.Array]) -> tuple[Any, None]:
            g_acc, m_acc = carry
            (_, metrics), grads = grad_fn(lora, mb, base, head)
            g_acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), g_acc, grads)
            m_acc = {k: m_acc[k] + metrics[k].astype(m_acc[k].dtype) for k in m_acc}
            return (g_acc, m_acc), None

        out, _ = jax.lax.scan(body, acc, batch)
        return out

    def zero_acc(self, lora: LoraState) -> tuple[Any, dict[str, jax.Array]]:
        metrics = {
            "loss": jnp.float32(0),
            "ratio": jnp.float32(0),
            "clip_fraction": jnp.float32(0),
            "tokens": jnp.int32(0),
            "weight": jnp.float32(0),
        }
        if self.with_ref:
            metrics["kl"] = jnp.float32(0)
        grads = jax.tree.map(
            lambda x, s: put_global(jnp.zeros_like(x, dtype=self.grad_dtype), s),
            lora,
            self.policy.lora_sharding,
        )
        return grads, {k: put_global(v, self.replicated) for k, v in metrics.items()}

    def _apply(
        self, state: TrainState, acc: tuple[Any, dict[str, jax.Array]]
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        grads, metrics = acc
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.lora)
        rate = learning_rate_at(self.cfg, state.step)
        updates = jax.tree.map(lambda u: (-rate * u).astype(u.dtype), updates)
        lora = optax.apply_updates(state.lora, updates)
        ok = all_finite((grads, updates, metrics["loss"]))
        # No token carried a loss weight (every group of the step had equal rewards, or nothing was
        # packed): nothing to learn from, so no update (AdamW would still decay and move on its
        # moments); the step counts, parameters and optimizer state stay.
        signal = metrics["weight"] > 0
        new = TrainState(
            lora=guard_update(ok & signal, lora, state.lora),
            opt_state=guard_update(ok & signal, opt_state, state.opt_state),
            step=state.step + 1,
            skipped=state.skipped + (~ok & signal).astype(jnp.int32),
        )
        out = dict(metrics)
        out["grad_norm"] = optax.global_norm(grads)
        out["learning_rate"] = rate
        out["update_skipped"] = (~ok & signal).astype(jnp.int32)
        out["no_signal"] = (~signal).astype(jnp.int32)
        return new, out

    # ------------------------------------------------------------------ host API

    def train_on_packed(
        self, state: TrainState, packed: list[PackedBatch]
    ) -> tuple[TrainState, dict[str, float]]:
        acc = self.zero_acc(state.lora)
        # No micro-batch (every group of the step carried no signal): no accumulate call; apply sees a
        # zero weight and leaves the parameters as they are (metrics no_signal = 1).
        calls = stack_micro_batches(packed, self.cfg.micro_batches) if packed else []
        for call in calls:
            batch = self.device_batch(call)
            acc = self.accumulate(acc, state.lora, self.policy.base, batch)
        state, metrics = self.apply(state, acc)
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out["micro_batches"] = float(len(packed))
        out["accumulate_calls"] = float(len(calls))
        return state, out

    def accumulate(
        self, acc: tuple[Any, dict[str, jax.Array]], lora: LoraState, base: Any, batch: dict[str, jax.Array]
    ) -> tuple[Any, dict[str, jax.Array]]:
        """One accumulate call (the gradient buffer ``acc`` donated) through :meth:`compiled_accumulate`;
        ``base`` in other layouts than the compiled program's is put in them first (the policy's own base
        already is)."""
        policy_base = base is self.policy.base
        compiled = self.compiled_accumulate(acc, lora, batch)
        if policy_base:  # laid out by the first compile: the policy's base now, not a second copy of it
            base = self.policy.base
        out: tuple[Any, dict[str, jax.Array]] = compiled(
            acc, lora, lay_out(base, compiled.input_formats[0][2]), batch
        )
        return out

    def compiled_accumulate(self, acc: Any, lora: LoraState, batch: dict[str, jax.Array]) -> Any:
        """:attr:`accumulate_program` compiled for this run's shapes, on the first call: the base weights
        enter it abstract (the compiler picks their layouts), and the policy's base is then put in those
        layouts (:func:`rljob.trainer.placement.lay_out`), once; every other program that reads it (the
        parity scoring, the Tinker engine's) compiles for the layouts its arrays have."""
        if self._accumulate_compiled is None:
            base = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),  # type: ignore[no-untyped-call]
                self.policy.base,
            )
            compiled = self.accumulate_program.lower(acc, lora, base, batch).compile()
            # The policy's base is handed over: each weight whose layout changes is released once copied.
            self.policy.base = lay_out(self.policy.base, compiled.input_formats[0][2], release=True)
            self._accumulate_compiled = compiled
        return self._accumulate_compiled

    def device_batch(self, call: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """One call's host arrays as global arrays laid out per :attr:`batch_sharding` (every process
        holds the whole batch and supplies its own devices' shards)."""

        def put(host: np.ndarray) -> jax.Array:
            return jax.make_array_from_callback(host.shape, self.batch_sharding, lambda index: host[index])

        return {k: put(v) for k, v in call.items()}

    def train_on_batch(
        self, state: TrainState, rollouts: list[Rollout]
    ) -> tuple[TrainState, dict[str, float]]:
        """One optimizer step on ``rollouts`` (advantages and per_token['old_logprobs'] set; optional
        per_token['loss_weight']). No rollouts: a step without an update (``no_signal`` 1). The input
        state is donated: use the returned one."""
        if not rollouts:
            return self.train_on_packed(state, [])
        packed = pack_rollouts(rollouts, self.cfg.pack_config())
        state, metrics = self.train_on_packed(state, packed)
        metrics["padding_fraction"] = padding_fraction(packed)  # share of the packed slots that are padding
        return state, metrics
