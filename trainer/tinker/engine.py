"""The Tinker service's compute: LoRA training models over one base, on the loop mode's packed step.

One :class:`Engine` holds the base model (:class:`rljob.trainer.model.Policy`) and any number of
:class:`TrainingModel` s (up to ``max_models``): each its own LoRA parameters, Adam moments, gradient
buffer and step count. Every model has the service's LoRA shape (``spec.lora``: rank R, targets); a client
that asks for a rank r <= R gets factors whose rank slots r..R are zero and masked out of every update,
which is exactly a rank-r adapter (a zero row of A and a zero column of B get zero gradients and stay
zero), scaled alpha/R like every adapter of the service. ``train_attn`` / ``train_mlp`` = False masks
those projections the same way; ``train_unembed`` is not supported (the output head is frozen: the fused
log-prob head never forms the logits) and is ignored.

A request's datums (``model_input`` tokens x[0..N), ``target_tokens`` y[0..N) with y[i] = x[i+1] for
i < N-1, the next-token layout every Tinker loss uses) become one sequence x + [y[N-1]] each, packed by
:func:`rljob.trainer.packing.pack_rollouts` into micro-batches of the service's one compiled shape
``[rows, budget]`` and stacked by :func:`rljob.trainer.train_step.stack_micro_batches`, as the loop mode
packs rollouts: a client sends whatever lengths it has, the compiled programs never change shape.
Per token: ``weights`` (default 1), ``advantages``, the sampler's ``logprobs``.

Losses (sums over tokens, as Tinker defines them, https://tinker-docs.thinkingmachines.ai/losses):
cross_entropy ``-sum(w * logp)``; importance_sampling and ppo are
:func:`rljob.trainer.losses.policy_loss` (the loop mode's loss: ``-sum(w * ratio * A)``, PPO clipped
at ratio thresholds ``clip_low_threshold`` / ``clip_high_threshold``, default 0.8 / 1.2), so the log-ratio is
clamped to +-20 and a sampler log-prob <= -9000 (vLLM's NaN marker) drops its token, as in loop mode.

``forward_backward`` adds the gradient into the model's buffer; ``optim_step`` applies Adam with the
request's :class:`AdamHP` (torch.optim.AdamW's update, the SDK's definition: decoupled weight decay, bias
correction, gradient clipping by global norm when ``grad_clip_norm`` > 0), skips a non-finite update (as
the loop does) and clears the buffer. All three are jitted once per loss kind; hyper-parameters are
arguments, not constants.

Every method runs on the caller's thread; the server calls them from one worker thread only, through
rljob.trainer.tinker.collective (on a trainer of several processes, every process runs each call).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rljob.trainer.losses import LossConfig, all_finite, guard_update, policy_loss
from rljob.trainer.model import Policy
from rljob.trainer.packing import PackedBatch, PackingError, Rollout, pack_rollouts
from rljob.trainer.peft import HF_PROJ
from rljob.trainer.placement import put_global
from rljob.trainer.train_step import StepConfig, Trainer, stack_micro_batches

__all__ = [
    "ATTN_MODULES",
    "LOSS_FNS",
    "MLP_MODULES",
    "AdamHP",
    "DatumIn",
    "Engine",
    "LossSpec",
    "RequestError",
    "TrainingModel",
    "host",
]

LossKind = Literal["cross_entropy", "importance_sampling", "ppo"]
LOSS_FNS: tuple[LossKind, ...] = ("cross_entropy", "importance_sampling", "ppo")
ATTN_MODULES = frozenset(m for m, (parent, _) in HF_PROJ.items() if parent == "self_attn")
MLP_MODULES = frozenset(m for m, (parent, _) in HF_PROJ.items() if parent == "mlp")
# Loss inputs each loss reads (Tinker's names); anything else in a datum is refused, never ignored.
LOSS_INPUTS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset({"target_tokens", "weights"}),
    "importance_sampling": frozenset({"target_tokens", "weights", "logprobs", "advantages"}),
    "ppo": frozenset({"target_tokens", "weights", "logprobs", "advantages"}),
}
REQUIRED_INPUTS: dict[str, frozenset[str]] = {
    "cross_entropy": frozenset({"target_tokens"}),
    "importance_sampling": frozenset({"target_tokens", "logprobs", "advantages"}),
    "ppo": frozenset({"target_tokens", "logprobs", "advantages"}),
}
MAX_LOSS_VARIANTS = 16  # distinct PPO clip settings compiled at once (a bound on client-driven compiles)


class RequestError(ValueError):
    """A request the service refuses (the client's mistake): the message names the field."""


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A loss and its settings: static for the compiled programs (one compile per distinct value)."""

    kind: LossKind
    clip_low: float = 0.2  # PPO: ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2

    @classmethod
    def parse(cls, loss_fn: str, config: dict[str, float | str] | None) -> LossSpec:
        if loss_fn == "stable_reinforce":
            raise RequestError(
                "loss_fn: 'stable_reinforce' is not supported by this server: it trains on stability "
                "information the hosted service records while sampling, whose definition is not public; "
                f"train with {' or '.join(LOSS_FNS[1:])} (the Cookbook: Config.loss_fn, and "
                "AsyncConfig.loss_fn for async runs)"
            )
        if loss_fn not in LOSS_FNS:
            raise RequestError(
                f"loss_fn: {loss_fn!r} is not supported by this server (supported: {', '.join(LOSS_FNS)})"
            )
        cfg = dict(config or {})
        kind: LossKind = loss_fn
        if kind != "ppo":
            if cfg:
                raise RequestError(f"loss_fn_config: {loss_fn} takes no settings, got {sorted(cfg)}")
            return cls(kind)
        unknown = sorted(set(cfg) - {"clip_low_threshold", "clip_high_threshold"})
        if unknown:
            raise RequestError(
                f"loss_fn_config: unknown keys {unknown} (ppo takes clip_low_threshold, clip_high_threshold)"
            )
        try:
            low = float(cfg.get("clip_low_threshold", 0.8))
            high = float(cfg.get("clip_high_threshold", 1.2))
        except (TypeError, ValueError):
            raise RequestError("loss_fn_config: clip thresholds must be numbers") from None
        if not (0.0 <= low <= 1.0 <= high) or not np.isfinite(high):
            raise RequestError(
                f"loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low}, {high}"
            )
        return cls(kind, clip_low=1.0 - low, clip_high=high - 1.0)


@dataclasses.dataclass(frozen=True)
class AdamHP:
    """One optimizer step's Adam settings (the SDK's AdamParams)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def check(self) -> None:
        v = dataclasses.asdict(self)
        bad = [k for k, x in v.items() if not np.isfinite(x)]
        if bad:
            raise RequestError(f"adam_params.{bad[0]}: must be finite")
        if self.learning_rate < 0 or self.eps < 0 or self.weight_decay < 0:
            raise RequestError("adam_params: learning_rate, eps and weight_decay must be >= 0")
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise RequestError("adam_params: beta1 and beta2 must be in [0, 1)")

    def array(self) -> np.ndarray:
        return np.asarray(
            [self.learning_rate, self.beta1, self.beta2, self.eps, self.weight_decay, self.grad_clip_norm],
            np.float32,
        )


@dataclasses.dataclass(frozen=True)
class DatumIn:
    """One datum as the service reads it (host arrays)."""

    tokens: np.ndarray  # [N] int: model_input
    targets: np.ndarray  # [N] int
    weights: np.ndarray | None = None  # [N] float
    advantages: np.ndarray | None = None
    logprobs: np.ndarray | None = None


@dataclasses.dataclass
class TrainingModel:
    """One training client's adapter and optimizer state (device arrays)."""

    model_id: str
    base_model: str
    rank: int
    seed: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    lora: Any
    mu: Any
    nu: Any
    count: Any  # int32 device scalar: applied Adam updates (bias correction)
    mask: Any
    step: int = 0  # optim_step calls
    skipped: int = 0
    grads: Any = None  # accumulated since the last optim_step (None: nothing accumulated)
    pending: int = 0  # forward_backward calls since the last optim_step

    def config(self) -> dict[str, Any]:
        """What re-creates this model (kept with its checkpoints)."""
        return {
            "model_id": self.model_id,
            "base_model": self.base_model,
            "rank": self.rank,
            "seed": self.seed,
            "train_attn": self.train_attn,
            "train_mlp": self.train_mlp,
            "train_unembed": self.train_unembed,
        }


def _per_token(x: np.ndarray | None, where: str, n: int, default: float) -> np.ndarray:
    """A per-target-token input of a datum as float32 [n] (``default`` where the datum has none)."""
    if x is None:
        return np.full(n, default, np.float32)
    if x.shape != (n,):
        raise RequestError(f"{where}: shape {list(x.shape)}, expected [{n}]")
    if not np.isfinite(x).all() and "logprobs" not in where:
        raise RequestError(f"{where}: values must be finite")
    return x.astype(np.float32)


def host(x: Any) -> Any:
    """A (tree of) device array(s) on the host, whole: ``jax.device_get`` where this process holds every
    shard, else ``process_allgather`` (a collective: every process calls it, as every operation here)."""

    def one(a: Any) -> np.ndarray:
        if not isinstance(a, jax.Array) or a.is_fully_addressable or a.sharding.is_fully_replicated:
            return np.asarray(jax.device_get(a))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(a, tiled=True))

    return jax.tree.map(one, x)


class Engine:
    """Compiled forward / forward_backward / Adam over many LoRA models of one base (module docstring)."""

    def __init__(self, policy: Policy, step_cfg: StepConfig, *, max_models: int) -> None:
        self.policy = policy
        self.cfg = step_cfg
        self.max_models = max_models
        # The loop mode's step object: its shardings, packed layout and device placement are reused.
        self.trainer = Trainer(policy, step_cfg)
        self.pack_cfg = step_cfg.pack_config()
        self.replicated = NamedSharding(policy.mesh, P())  # type: ignore[no-untyped-call]
        self.models: dict[str, TrainingModel] = {}
        lora_s = policy.lora_sharding
        base_s = jax.tree.map(lambda x: x.sharding, policy.base)
        bs, rep = self.trainer.batch_sharding, self.replicated
        self._forward = jax.jit(
            self._forward_fn,
            static_argnums=(3,),
            in_shardings=(lora_s, base_s, bs),
            out_shardings=(rep, bs),
        )
        self._fwd_bwd = jax.jit(
            self._fwd_bwd_fn,
            static_argnums=(4,),
            donate_argnums=(0,),
            in_shardings=(lora_s, lora_s, base_s, bs),
            out_shardings=(lora_s, rep, bs),
        )
        self._apply = jax.jit(
            self._apply_fn,
            donate_argnums=(0, 1, 2),
            in_shardings=(lora_s, lora_s, lora_s, rep, lora_s, lora_s, rep),
            out_shardings=(lora_s, lora_s, lora_s, rep, rep),
        )
        self._loss_variants: set[LossSpec] = set()
        self.max_rank = policy.spec.lora_rank
        self.max_tokens = step_cfg.budget - 1  # x + [y[N-1]] fills at most one row

    # ------------------------------------------------------------------ compiled parts

    def _micro(
        self, lora: Any, mb: dict[str, jax.Array], base: Any, loss: LossSpec
    ) -> tuple[jax.Array, jax.Array]:
        lp = self.trainer.micro_logprobs(lora, mb, base)  # the loop's own log-prob call
        w = mb["weights"]
        if loss.kind == "cross_entropy":
            value = -jnp.where(w != 0, w * lp, 0.0).sum()
        else:
            cfg = LossConfig(kind=loss.kind, clip_low=loss.clip_low, clip_high=loss.clip_high)
            value, _ = policy_loss(lp, mb["old_logprobs"], mb["advantages"], w, cfg)
        return value, lp

    def _forward_fn(
        self, lora: Any, base: Any, batch: dict[str, jax.Array], loss: LossSpec
    ) -> tuple[jax.Array, jax.Array]:
        def body(total: jax.Array, mb: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
            value, lp = self._micro(lora, mb, base, loss)
            return total + value, lp

        return jax.lax.scan(body, jnp.float32(0), batch)

    def _fwd_bwd_fn(
        self, grads: Any, lora: Any, base: Any, batch: dict[str, jax.Array], loss: LossSpec
    ) -> tuple[Any, jax.Array, jax.Array]:
        grad_fn = jax.value_and_grad(self._micro, has_aux=True)

        def body(
            carry: tuple[Any, jax.Array], mb: dict[str, jax.Array]
        ) -> tuple[tuple[Any, jax.Array], jax.Array]:
            g_acc, total = carry
            (value, lp), g = grad_fn(lora, mb, base, loss)
            return (jax.tree.map(jnp.add, g_acc, g), total + value), lp

        (grads, total), lps = jax.lax.scan(body, (grads, jnp.float32(0)), batch)
        return grads, total, lps

    @staticmethod
    def _apply_fn(
        lora: Any, mu: Any, nu: Any, count: jax.Array, grads: Any, mask: Any, hp: jax.Array
    ) -> tuple[Any, Any, Any, jax.Array, dict[str, jax.Array]]:
        lr, b1, b2, eps, wd, clip = (hp[i] for i in range(6))
        g = jax.tree.map(lambda x, m: x * m, grads, mask)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g)))
        # torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is < 1.
        scale = jnp.where(clip > 0, jnp.minimum(1.0, clip / (norm + 1e-6)), 1.0)
        g = jax.tree.map(lambda x: x * scale, g)
        t = (count + 1).astype(jnp.float32)
        new_mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, mu, g)
        new_nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * x * x, nu, g)
        bc1 = 1 - jnp.power(b1, t)
        bc2 = 1 - jnp.power(b2, t)

        def update(p: jax.Array, m: jax.Array, v: jax.Array, k: jax.Array) -> jax.Array:
            p = p * (1 - lr * wd)  # decoupled weight decay (AdamW)
            new = p - (lr / bc1) * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + eps)
            return jnp.where(k != 0, new, p)

        new_lora = jax.tree.map(update, lora, new_mu, new_nu, mask)
        # Back to the state's own dtypes, as the loop's optax update keeps them (optax.apply_updates casts to
        # the parameters' dtype, Adam's moments are kept in it): the float32 hyper-parameters would promote
        # a bfloat16 adapter to float32, which MaxText's layer scan then refuses (its carry's dtype changes).
        new_lora, new_mu, new_nu = (
            jax.tree.map(lambda n, o: n.astype(o.dtype), new, old)
            for new, old in ((new_lora, lora), (new_mu, mu), (new_nu, nu))
        )
        ok = all_finite((g, new_lora, norm))
        out_lora = guard_update(ok, new_lora, lora)
        out_mu = guard_update(ok, new_mu, mu)
        out_nu = guard_update(ok, new_nu, nu)
        metrics = {"grad_norm": norm, "update_skipped": (~ok).astype(jnp.int32)}
        return out_lora, out_mu, out_nu, count + ok.astype(jnp.int32), metrics

    # ------------------------------------------------------------------ models

    def _put(self, tree: Any) -> Any:
        return jax.tree.map(put_global, tree, self.policy.lora_sharding)

    def init_lora(self, rank: int, seed: int, train_attn: bool, train_mlp: bool) -> tuple[Any, Any]:
        """(LoRA parameters, update mask) of a new adapter: A drawn like qwix draws it (he_uniform per
        layer) from ``seed``, B zero; rank slots >= ``rank`` and untrained projections zero and masked."""
        if any(leaf.experts for leaf in self.policy.peft.layout):
            # the masks below assume [in, r] / [r, out] matrices per layer (rljob.trainer.expert_lora)
            raise ValueError("spec.lora.targets: experts: the Tinker service trains no routed-expert LoRA")
        init = jax.nn.initializers.he_uniform()
        key = jax.random.key(seed)
        leaves, treedef = jax.tree_util.tree_flatten(self.policy.lora0)
        paths = self.policy.peft.lora_paths()
        lora_out, mask_out = [], []
        for i, (leaf, (module, which)) in enumerate(zip(leaves, paths, strict=True)):
            arr = leaf  # its shape and dtype only: no transfer (shards may lie on other processes)
            trained = (module in ATTN_MODULES and train_attn) or (module in MLP_MODULES and train_mlp)
            mask = np.zeros(arr.shape, np.float32)
            if trained:
                if which == "a":  # [in..., L, r] with the layers on axis 1: rank is the last axis
                    mask[..., :rank] = 1.0
                else:  # [r, L, out...]: rank is axis 0
                    mask[:rank] = 1.0
            if which == "a":  # one [in, r] matrix per layer, stacked as the leaf's layout says
                leaf = self.policy.peft.layout[i]
                keys = jax.random.split(jax.random.fold_in(key, i), len(leaf.layers))
                drawn = np.asarray(jax.vmap(lambda k, s=leaf.matrix_shape: init(k, s, jnp.float32))(keys))
                value = leaf.stack(list(drawn))
            else:
                value = np.zeros(arr.shape, np.float32)
            lora_out.append((value * mask).astype(arr.dtype))
            mask_out.append(mask)
        lora = jax.tree_util.tree_unflatten(treedef, lora_out)
        mask = jax.tree_util.tree_unflatten(treedef, mask_out)
        return self._put(lora), self._put(mask)

    def create(
        self,
        model_id: str,
        *,
        base_model: str,
        rank: int,
        seed: int | None = None,
        train_attn: bool = True,
        train_mlp: bool = True,
        train_unembed: bool = True,
    ) -> TrainingModel:
        if model_id in self.models:
            raise RequestError(f"model_id: {model_id} exists")
        if len(self.models) >= self.max_models:
            raise RequestError(
                f"this service holds at most {self.max_models} training clients "
                "(spec.service.maxTrainingClients); "
                "unload one first"
            )
        if not 1 <= rank <= self.max_rank:
            raise RequestError(
                f"lora_config.rank: {rank}; this service trains ranks 1..{self.max_rank} (spec.lora.rank)"
            )
        if not (train_attn or train_mlp):
            raise RequestError(
                "lora_config: train_attn or train_mlp must be true (the output head is frozen)"
            )
        seed = secrets.randbits(31) if seed is None else int(seed)
        lora, mask = self.init_lora(rank, seed, train_attn, train_mlp)
        zeros = self._put(jax.tree.map(jnp.zeros_like, lora))
        model = TrainingModel(
            model_id=model_id,
            base_model=base_model,
            rank=rank,
            seed=seed,
            train_attn=train_attn,
            train_mlp=train_mlp,
            train_unembed=train_unembed,
            lora=lora,
            mu=zeros,
            nu=self._put(jax.tree.map(jnp.zeros_like, lora)),
            count=put_global(jnp.int32(0), self.replicated),
            mask=mask,
        )
        self.models[model_id] = model
        return model

    def create_from_config(self, model_id: str, cfg: dict[str, Any]) -> TrainingModel:
        """A model shaped like ``cfg`` (TrainingModel.config() of a checkpoint), under ``model_id``."""
        return self.create(
            model_id,
            base_model=str(cfg["base_model"]),
            rank=int(cfg["rank"]),
            seed=int(cfg["seed"]),
            train_attn=bool(cfg["train_attn"]),
            train_mlp=bool(cfg["train_mlp"]),
            train_unembed=bool(cfg["train_unembed"]),
        )

    def model(self, model_id: str) -> TrainingModel:
        m = self.models.get(model_id)
        if m is None:
            raise RequestError(f"model_id: no training client {model_id} on this service")
        return m

    def unload(self, model_id: str) -> None:
        self.models.pop(model_id, None)

    # ------------------------------------------------------------------ state (checkpoints)

    def state_tree(self, m: TrainingModel) -> dict[str, Any]:
        return {"lora": m.lora, "mu": m.mu, "nu": m.nu, "count": m.count}

    def abstract_state(self) -> dict[str, Any]:
        lora = self.policy.lora0
        return {"lora": lora, "mu": lora, "nu": lora, "count": put_global(jnp.int32(0), self.replicated)}

    def set_state(self, m: TrainingModel, tree: dict[str, Any], *, optimizer: bool) -> None:
        m.lora = self._put(tree["lora"])
        if optimizer:
            m.mu, m.nu = self._put(tree["mu"]), self._put(tree["nu"])
            m.count = put_global(jnp.asarray(tree["count"], jnp.int32), self.replicated)
        else:
            m.mu = self._put(jax.tree.map(jnp.zeros_like, m.lora))
            m.nu = self._put(jax.tree.map(jnp.zeros_like, m.lora))
            m.count = put_global(jnp.int32(0), self.replicated)
        m.grads, m.pending = None, 0

    # ------------------------------------------------------------------ requests

    def _rollouts(self, data: Sequence[DatumIn], loss: LossSpec) -> list[Rollout]:
        out = []
        for i, d in enumerate(data):
            n = int(d.tokens.size)
            if n == 0:
                raise RequestError(f"data[{i}].model_input: empty")
            if d.targets.shape != (n,):
                raise RequestError(
                    f"data[{i}].loss_fn_inputs.target_tokens: shape {list(d.targets.shape)}, "
                    f"model_input has {n} tokens"
                )
            if n > self.max_tokens:
                raise RequestError(
                    f"data[{i}].model_input: {n} tokens; this service trains at most {self.max_tokens} per "
                    f"datum (spec.packing.tokenBudget {self.cfg.budget} minus one)"
                )
            if n > 1 and not np.array_equal(d.targets[:-1], d.tokens[1:]):
                bad = int(np.flatnonzero(d.targets[:-1] != d.tokens[1:])[0])
                raise RequestError(
                    f"data[{i}].loss_fn_inputs.target_tokens[{bad}]: this server needs next-token targets "
                    f"(target_tokens[i] == model_input[i + 1]); got {int(d.targets[bad])} vs "
                    f"{int(d.tokens[bad + 1])}"
                )
            vocab = self.policy.vocab_size
            seq = np.append(d.tokens, d.targets[-1]).astype(np.int64)
            if seq.min() < 0 or seq.max() >= vocab:
                raise RequestError(f"data[{i}]: token ids must lie in [0, {vocab})")

            per_token = {
                "loss_weight": _per_token(d.weights, f"data[{i}].loss_fn_inputs.weights", n, 1.0),
                "advantages": _per_token(d.advantages, f"data[{i}].loss_fn_inputs.advantages", n, 0.0),
                "old_logprobs": _per_token(d.logprobs, f"data[{i}].loss_fn_inputs.logprobs", n, 0.0),
            }
            out.append(Rollout(seq[:1].astype(np.int32), seq[1:].astype(np.int32), per_token=per_token))
        return out

    def _pack(
        self, data: Sequence[DatumIn], loss: LossSpec
    ) -> tuple[list[PackedBatch], list[dict[str, np.ndarray]]]:
        if not data:
            raise RequestError("data: empty")
        try:
            packed = pack_rollouts(self._rollouts(data, loss), self.pack_cfg)
        except PackingError as e:
            raise RequestError(str(e)) from None
        # Only a request whose data passed may add a compiled variant: a refused one leaves the set as it was.
        if loss.kind == "ppo" and loss not in self._loss_variants:
            if len(self._loss_variants) >= MAX_LOSS_VARIANTS:
                raise RequestError(f"loss_fn_config: at most {MAX_LOSS_VARIANTS} distinct PPO clip settings")
            self._loss_variants.add(loss)
        return packed, stack_micro_batches(packed, self.cfg.micro_batches)

    def _unpack(self, packed: list[PackedBatch], lps: list[np.ndarray], count: int) -> list[np.ndarray]:
        """Per datum, the log-probs of its targets (from the calls' [micro_batches, rows, budget] outputs)."""
        rows = [b for call in lps for b in call]  # one [rows, budget] array per packed micro-batch
        out: list[np.ndarray | None] = [None] * count
        for batch, lp in zip(packed, rows, strict=False):
            for i in np.unique(batch.rollout_index[batch.rollout_index >= 0]):
                # The segment's first token (x[0]) scores nothing; the rest score y[0..N).
                out[int(i)] = lp[batch.rollout_index == i][1:].astype(np.float32)
        assert all(o is not None for o in out)
        return out  # type: ignore[return-value]

    def forward(
        self, model_id: str | None, data: Sequence[DatumIn], loss: LossSpec, *, backward: bool
    ) -> tuple[float, list[np.ndarray]]:
        """Sum of the loss over ``data`` and each datum's target log-probs; with ``backward`` the gradient
        is added to the model's buffer. ``model_id`` None: the base model (forward only)."""
        if model_id is None:
            if backward:
                raise RequestError("model_id: forward_backward needs a training client")
            lora = self.policy.lora0
        else:
            m = self.model(model_id)
            lora = m.lora
        packed, calls = self._pack(data, loss)
        total = 0.0
        lps = []
        for call in calls:
            batch = self.trainer.device_batch(call)
            if backward:
                if m.grads is None:
                    m.grads = self._put(jax.tree.map(jnp.zeros_like, m.lora))
                m.grads, value, lp = self._fwd_bwd(m.grads, lora, self.policy.base, batch, loss)
            else:
                value, lp = self._forward(lora, self.policy.base, batch, loss)
            total += float(value)
            lps.append(host(lp))
        if backward:
            m.pending += 1
        return total, self._unpack(packed, lps, len(data))

    def optim_step(self, model_id: str, hp: AdamHP) -> dict[str, float]:
        hp.check()
        m = self.model(model_id)
        grads = m.grads if m.grads is not None else self._put(jax.tree.map(jnp.zeros_like, m.lora))
        hp_arr = put_global(jnp.asarray(hp.array()), self.replicated)
        m.lora, m.mu, m.nu, m.count, metrics = self._apply(m.lora, m.mu, m.nu, m.count, grads, m.mask, hp_arr)
        out = {k: float(v) for k, v in host(metrics).items()}
        m.step += 1
        m.skipped += int(out["update_skipped"])
        m.grads, m.pending = None, 0
        return out

    def prompt_logprobs(self, lora: Any, tokens: np.ndarray) -> np.ndarray:
        """log p(tokens[i] | tokens[<i]) for i >= 1 under ``lora`` ([len-1]), on the training chips."""
        datum = DatumIn(tokens=tokens[:-1], targets=tokens[1:])
        _, lps = self.forward_with(lora, [datum])
        return lps[0]

    def forward_with(self, lora: Any, data: Sequence[DatumIn]) -> tuple[float, list[np.ndarray]]:
        loss = LossSpec("cross_entropy")
        packed, calls = self._pack(data, loss)
        lps, total = [], 0.0
        for call in calls:
            value, lp = self._forward(lora, self.policy.base, self.trainer.device_batch(call), loss)
            total += float(value)
            lps.append(host(lp))
        return total, self._unpack(packed, lps, len(data))

    def peft(self, lora: Any) -> dict[str, np.ndarray]:
        """The adapter in the PEFT layout the samplers load (rank R: unused slots are zero)."""
        return self.policy.peft.to_peft(host(lora))
