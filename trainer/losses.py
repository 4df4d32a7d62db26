"""GRPO losses in JAX: group advantages, importance-sampling / PPO-clipped policy losses, k3 KL
penalty, NaN-sentinel containment and non-finite-update detection.

Every per-token function takes arrays of any shape (``[B, T]`` packed rows or ``[T]`` single
sequences) with a per-token ``weight`` that is both the mask and the normalization: the loss is
``sum(weight * per_token_loss)``. Build weights with :func:`token_weights` on the host per rollout
(before packing, so the weight moves with its token) or in-graph from a packed batch's
``loss_mask`` and ``rollout_index``; because every weight is fixed per token, the loss and its
gradients do not depend on the layout (packed or not, how many micro-batches), which is what makes
packed == unpacked testable. Gradient accumulation over micro-batches is then a plain sum.

Sampler log-probs may carry NaN / -inf / <= ``sentinel`` values (vLLM marks unscored tokens that
way): :func:`sanitize_logprobs` zeroes their weight and replaces the value by 0 with ``where`` (not
by multiplying), so no NaN enters the graph; :func:`policy_loss` applies it to ``old_logprobs`` and
``ref_logprobs`` itself.

  group_advantages(rewards[N], group_size, normalization) -> GroupAdvantages(advantages, valid, skipped)
  token_weights(mask, rollout_index, num_rollouts, mode) -> weights            (in-graph)
  rollout_loss_weights(completion_masks, mode) -> per-rollout weight arrays     (host, numpy)
  policy_loss(logprobs, old_logprobs, advantages, weight, cfg, ref_logprobs=None, segments=None)
      -> (loss, metrics)
  sequence_log_ratio(log_ratio, live, segments) -> each token's sequence-mean log-ratio (GSPO)
  overlong_penalty(lengths, max_tokens, buffer, penalty) -> reward shaping per completion (DAPO)
  all_finite(tree) -> bool array; guard_update(ok, new, old) -> new if ok else old
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

__all__ = [
    "NAN_SENTINEL",
    "AdvantageNormalization",
    "GroupAdvantages",
    "LossConfig",
    "Mode",
    "RatioLevel",
    "all_finite",
    "group_advantages",
    "guard_update",
    "k3_kl",
    "overlong_penalty",
    "policy_loss",
    "rollout_loss_weights",
    "sanitize_logprobs",
    "sequence_log_ratio",
    "token_weights",
]

NAN_SENTINEL = -9000.0
"""Log-probs at or below this are sampler sentinels (vLLM's NaN marker is about -9999)."""

_LOG_RATIO_CLAMP = 20.0


class GroupAdvantages(NamedTuple):
    advantages: jax.Array  # [N] float32, 0 for rollouts of skipped groups
    valid: jax.Array  # [N] bool, False for rollouts of groups with no signal
    groups_skipped: jax.Array  # int32 scalar: groups whose rewards are all equal


AdvantageNormalization = Literal["mean", "std"]


def group_advantages(
    rewards: jax.Array,
    group_size: int,
    *,
    normalization: AdvantageNormalization = "mean",
    eps: float = 1e-6,
) -> GroupAdvantages:
    """GRPO advantages per group of ``group_size`` consecutive rollouts of one prompt
    (``spec.algorithm.advantageNormalization``): ``mean``: reward minus the group's mean; ``std``: that
    divided by the group's standard deviation (+ ``eps``). A group whose rewards are all equal carries no
    signal: its advantages are 0, ``valid`` is False and it is counted in ``groups_skipped``; the loop
    leaves its rollouts out of the step (not packed, not in the token mean)."""
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1 or group_size <= 0 or r.shape[0] % group_size:
        raise ValueError(
            f"algorithm.groupSize: {r.shape[0]} rewards do not split into groups of {group_size}"
        )
    if normalization not in ("mean", "std"):
        raise ValueError(f"algorithm.advantageNormalization: 'mean' or 'std', got {normalization!r}")
    g = r.reshape(-1, group_size)
    mean = g.mean(axis=1, keepdims=True)
    centered = g - mean
    flat = (g.max(axis=1) == g.min(axis=1))[:, None]
    if normalization == "std":
        centered = centered / (g.std(axis=1, keepdims=True) + eps)
    adv = jnp.where(flat, 0.0, centered)
    return GroupAdvantages(
        adv.reshape(-1), jnp.broadcast_to(~flat, g.shape).reshape(-1), flat.sum().astype(jnp.int32)
    )


def sanitize_logprobs(
    logprobs: jax.Array, weight: jax.Array, sentinel: float = NAN_SENTINEL
) -> tuple[jax.Array, jax.Array]:
    """(values, weight) with sentinel / non-finite entries set to 0 in both."""
    bad = ~jnp.isfinite(logprobs) | (logprobs <= sentinel)
    return jnp.where(bad, 0.0, logprobs), jnp.where(bad, 0.0, weight)


Mode = Literal["token", "sequence"]


def token_weights(
    mask: jax.Array, rollout_index: jax.Array, num_rollouts: int, mode: Mode = "token"
) -> jax.Array:
    """Per-token weights from a mask and each token's rollout index (-1 = padding).

    ``token``: ``mask / sum(mask)`` over everything given (one global token mean).
    ``sequence``: each rollout's tokens share ``1 / num_rollouts_with_tokens`` (mean over a sequence's
    tokens, then over sequences). Pass ALL of a step's tokens (e.g. stacked micro-batches) so the
    normalization is global; or compute per rollout on the host and pack as a per-token field.
    """
    m = jnp.asarray(mask, jnp.float32)
    if mode == "token":
        return m / jnp.maximum(m.sum(), 1.0)
    if mode != "sequence":
        raise ValueError(f"loss weights mode: 'token' or 'sequence', got {mode!r}")
    idx = jnp.where(rollout_index >= 0, rollout_index, num_rollouts).reshape(-1)
    counts = jax.ops.segment_sum(m.reshape(-1), idx, num_segments=num_rollouts + 1)[:num_rollouts]
    n_seq = jnp.maximum((counts > 0).sum(), 1)
    per_tok = jnp.where(idx < num_rollouts, 1.0 / jnp.maximum(jnp.append(counts, 1.0)[idx], 1.0), 0.0)
    return (m.reshape(-1) * per_tok / n_seq).reshape(m.shape)


def rollout_loss_weights(
    completion_masks: list[npt.ArrayLike], mode: Mode = "token"
) -> list[npt.NDArray[np.float32]]:
    """Host-side :func:`token_weights` per rollout (one array per completion), to be packed as a
    per-token field (e.g. ``per_token["loss_weight"]``) so each weight travels with its token."""
    masks = [np.asarray(m, np.float32) for m in completion_masks]
    if mode == "token":
        total = max(float(sum(m.sum() for m in masks)), 1.0)
        return [m / np.float32(total) for m in masks]
    if mode != "sequence":
        raise ValueError(f"loss weights mode: 'token' or 'sequence', got {mode!r}")
    n_seq = max(sum(1 for m in masks if m.sum() > 0), 1)
    return [m / np.float32(max(float(m.sum()), 1.0) * n_seq) for m in masks]


def overlong_penalty(
    lengths: npt.ArrayLike, max_tokens: int, buffer: int, penalty: float = 1.0
) -> npt.NDArray[np.float32]:
    """DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13), added to each
    completion's reward: 0 up to ``max_tokens - buffer`` tokens, then falling linearly to ``-penalty`` at
    ``max_tokens`` (``-penalty`` beyond it). ``buffer`` 0: no shaping (all zeros)."""
    n = np.asarray(lengths, np.float32)
    if buffer <= 0:
        return np.zeros_like(n)
    if buffer > max_tokens:
        raise ValueError(f"algorithm.overlongBuffer: {buffer} exceeds maxTokens {max_tokens}")
    start = max_tokens - buffer
    return (-penalty * np.clip((n - start) / buffer, 0.0, 1.0)).astype(np.float32)


RatioLevel = Literal["token", "sequence"]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """``kind``: importance_sampling (ratio * A, unclipped) or ppo (clipped surrogate);
    ``clip_low``/``clip_high``: PPO ratio bounds 1 - low, 1 + high (DAPO's clip-higher: high > low);
    ``ratio``: token (each token's own ratio, GRPO/PPO) or sequence (GSPO: every token of a sequence
    takes exp of the mean of its sequence's token log-ratios, https://arxiv.org/abs/2507.18071);
    ``kl_coef``: k3 KL weight. The RL loop builds it from spec.algorithm, the Tinker service from a
    request's loss_fn_config: both run :func:`policy_loss`."""

    kind: Literal["importance_sampling", "ppo"] = "importance_sampling"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    ratio: RatioLevel = "token"
    sentinel: float = NAN_SENTINEL

    def __post_init__(self) -> None:
        if self.kind not in ("importance_sampling", "ppo"):
            raise ValueError(f"algorithm.loss: 'importance_sampling' or 'ppo', got {self.kind!r}")
        if self.ratio not in ("token", "sequence"):
            raise ValueError(f"algorithm.importanceRatio: 'token' or 'sequence', got {self.ratio!r}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(
                f"LossConfig clip_low, clip_high: must be >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.kl_coef < 0:
            raise ValueError(f"algorithm.klPenaltyCoef: must be >= 0, got {self.kl_coef}")


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = jnp.clip(ref_logprobs - logprobs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return jnp.exp(d) - d - 1.0


def sequence_log_ratio(log_ratio: jax.Array, live: jax.Array, segments: jax.Array) -> jax.Array:
    """Each token's sequence-mean log-ratio: the mean of ``log_ratio`` over the live tokens of its
    sequence, a sequence being the tokens of one row (last axis) with the same segment id (packed rows:
    rljob.trainer.packing's segment_ids; a ``[T]`` input is one row). The gradient flows to every token
    of the sequence, 1 / (its live tokens) each: GSPO's sequence-level importance ratio is the exp of it."""
    shape = log_ratio.shape
    t = shape[-1]
    rows = max(1, log_ratio.size // t)
    seg = jnp.clip(jnp.asarray(segments, jnp.int32).reshape(rows, t), 0, t)
    key = (jnp.arange(rows, dtype=jnp.int32)[:, None] * (t + 1) + seg).reshape(-1)
    lv = jnp.asarray(live, jnp.float32).reshape(-1)
    n = rows * (t + 1)
    sums = jax.ops.segment_sum(log_ratio.reshape(-1) * lv, key, num_segments=n)
    counts = jax.ops.segment_sum(lv, key, num_segments=n)
    return (sums / jnp.maximum(counts, 1.0))[key].reshape(shape)


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    weight: jax.Array,
    cfg: LossConfig,
    ref_logprobs: jax.Array | None = None,
    segments: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted sum of the per-token policy loss (+ kl_coef * k3 KL when ``ref_logprobs`` given).

    ratio = exp(logprobs - old_logprobs), the log-ratio clamped to +-20 before the exp; with
    ``cfg.ratio`` sequence, exp of the sequence's mean log-ratio (:func:`sequence_log_ratio`, which needs
    ``segments``: each token's sequence id in its row).
    importance_sampling: -ratio * A. ppo: -min(ratio * A, clip(ratio, 1-low, 1+high) * A).
    Tokens whose old (or ref) log-prob is a sentinel get weight 0; zero-weight tokens never pass a
    NaN to the gradient (``where``, not multiplication). Metrics are weight-averaged.
    """
    old, w = sanitize_logprobs(old_logprobs, weight, cfg.sentinel)
    live = w != 0
    lp = jnp.where(live, logprobs, 0.0)
    old = jnp.where(live, old, 0.0)
    log_ratio = jnp.clip(lp - old, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if cfg.ratio == "sequence":
        if segments is None:
            raise ValueError("policy_loss: a sequence-level ratio needs the tokens' segment ids")
        log_ratio = sequence_log_ratio(log_ratio, live, segments)
    ratio = jnp.exp(log_ratio)
    adv = jnp.where(live, advantages, 0.0)
    if cfg.kind == "ppo":
        clipped = jnp.clip(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        per_tok = -jnp.minimum(ratio * adv, clipped * adv)
        clip_frac = jnp.where(live, (ratio * adv > clipped * adv).astype(jnp.float32), 0.0)
    else:
        per_tok = -ratio * adv
        clip_frac = jnp.zeros_like(per_tok)
    metrics: dict[str, Any] = {}
    if ref_logprobs is not None and cfg.kl_coef > 0:
        ref, w = sanitize_logprobs(ref_logprobs, w, cfg.sentinel)
        live = w != 0
        kl = jnp.where(live, k3_kl(jnp.where(live, lp, 0.0), ref), 0.0)
        per_tok = per_tok + cfg.kl_coef * kl
        metrics["kl"] = (w * kl).sum()
    per_tok = jnp.where(live, per_tok, 0.0)
    loss = (w * per_tok).sum()
    metrics.update(
        loss=loss,
        ratio=(w * jnp.where(live, ratio, 0.0)).sum(),
        clip_fraction=(w * clip_frac).sum(),
        tokens=live.sum().astype(jnp.int32),
        weight=w.sum(),
    )
    return loss, metrics


def all_finite(tree: Any) -> jax.Array:
    """True when every leaf of ``tree`` (gradients, updates, loss) is finite everywhere."""
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def guard_update(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok`` else ``old``, leaf by leaf (params, optimizer state, step counters), so a
    step with a non-finite update is skipped inside the compiled step; count skips with
    ``skipped + (~ok).astype(int32)``."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
