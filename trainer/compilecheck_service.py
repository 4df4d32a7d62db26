"""The Tinker service's TPU programs for the compile stage (rljob.trainer.compilecheck): a run config with
``spec.service`` serves the Tinker API (rljob.trainer.tinker) instead of running the loop, so its programs
are :class:`rljob.trainer.tinker.engine.Engine`'s, built over the abstract policy as the loop's are:

- ``forward.<loss>``: ``Engine._forward``, a request's packed ``[micro_batches, rows, tokenBudget]`` call
  scored under one adapter, per loss the service accepts (``LOSS_FNS``: the loss is static, one program
  each); ``forward.cross_entropy`` is also the prompt-logprob program (``Engine.prompt_logprobs``: the
  service answers a sampling request's ``prompt_logprobs`` on the trainer's chips);
- ``forward_backward.<loss>``: ``Engine._fwd_bwd``, the same call with the gradient added to the model's
  buffer (PPO at its default clip thresholds: another clip setting is the same program's shape);
- ``optim_step``: ``Engine._apply``, one model's Adam update.

Every program runs beside what the service keeps in HBM for ``spec.service.maxTrainingClients`` models at
once: per model its adapter, Adam's two moments, its gradient buffer (held from ``forward_backward`` to
``optim_step``), its update mask (float32) and step count
(:class:`~rljob.trainer.tinker.engine.TrainingModel`), plus the base weights, the base model's zero
adapter (``Policy.lora0``) and the prompt-logprob adapter cache (rljob.trainer.tinker.collective: up to
max(2, maxTrainingClients) adapter copies). A program's
``resident_bytes`` is all of that, by arithmetic over the shards, less what is its own argument, so its
peak is the service's at its full model count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljob.recipes.runconfig import RunConfig
from rljob.trainer.compilecheck import (
    GIB,
    Chip,
    Program,
    model_flops,
    refusal,
    shard_bytes,
)

__all__ = ["ServiceState", "largest_count", "service_programs", "service_refusal", "service_state"]


@dataclasses.dataclass(frozen=True)
class ServiceState:
    """Per-device bytes of the service's HBM state (module docstring)."""

    models: int  # spec.service.maxTrainingClients
    base: int  # the base weights
    zero_adapter: int  # Policy.lora0 (the base model's adapter, its initial dtype)
    adapter: int  # one training model's adapter as optim_step returns it (steady_adapter)
    mask: int  # one update mask (float32, the adapter's shapes)
    count: int  # one Adam step count (int32, replicated)
    cache: int  # prompt-logprob adapters cached: max(2, models)

    @property
    def model(self) -> int:
        """One training model: adapter, two moments, gradient buffer, mask, count."""
        return 4 * self.adapter + self.mask + self.count

    @property
    def total(self) -> int:
        return self.base + self.zero_adapter + self.models * self.model + self.cache * self.adapter

    def at(self, models: int) -> ServiceState:
        return dataclasses.replace(self, models=models, cache=max(2, models))

    def report(self) -> dict[str, int]:
        return {
            "max_training_clients": self.models,
            "adapter_bytes_per_device": self.adapter,
            "model_bytes_per_device": self.model,
            "prompt_logprob_cache_adapters": self.cache,
            "state_bytes_per_device": self.total,
        }


def _like(tree: Any, dtype: Any) -> Any:
    """ShapeDtypeStructs of ``tree``'s shapes and shardings in ``dtype`` (a dtype, or a tree of arrays
    whose dtypes to take)."""
    import jax

    def one(x: Any, d: Any) -> Any:
        return jax.ShapeDtypeStruct(x.shape, getattr(d, "dtype", d), sharding=x.sharding)  # type: ignore[no-untyped-call]

    if hasattr(dtype, "dtype") or isinstance(dtype, type):
        return jax.tree.map(lambda x: one(x, dtype), tree)
    return jax.tree.map(one, tree, dtype)


def steady_adapter(engine: Any) -> Any:
    """A training model's adapter as ``optim_step`` leaves it (and so its moments and gradient buffer):
    ``Engine._apply``'s output dtypes, with the adapter's shardings. The Adam step keeps the adapter's own
    dtype; taken from the step rather than assumed, so a step that changed it (a bfloat16 adapter promoted
    to float32 by float32 arithmetic) is compiled and counted as the service would then run it."""
    import jax
    import jax.numpy as jnp

    lora = engine.policy.lora0
    rep = engine.replicated
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)  # type: ignore[no-untyped-call]
    hp = jax.ShapeDtypeStruct((6,), jnp.float32, sharding=rep)  # type: ignore[no-untyped-call]
    out = jax.eval_shape(engine._apply, lora, lora, lora, count, lora, _like(lora, jnp.float32), hp)
    return _like(lora, out[0])


def service_state(engine: Any, models: int) -> ServiceState:
    import jax.numpy as jnp

    lora0 = engine.policy.lora0
    return ServiceState(
        models=models,
        base=shard_bytes(engine.policy.base),
        zero_adapter=shard_bytes(lora0),
        adapter=shard_bytes(steady_adapter(engine)),
        mask=shard_bytes(_like(lora0, jnp.float32)),
        count=4,
        cache=max(2, models),
    )


def service_programs(engine: Any, state: ServiceState) -> list[Program]:
    """The Engine's programs with abstract arguments of the service's one packed shape."""
    import jax
    import jax.numpy as jnp
    from rljob.trainer.tinker.engine import LOSS_FNS, LossSpec

    policy, cfg = engine.policy, engine.cfg
    lora = steady_adapter(engine)  # ShapeDtypeStructs with the adapter's sharding (the abstract policy's)
    mask = _like(policy.lora0, jnp.float32)
    rep = engine.replicated
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)  # type: ignore[no-untyped-call]
    hp = jax.ShapeDtypeStruct((6,), jnp.float32, sharding=rep)  # type: ignore[no-untyped-call]
    _, _, batch = engine.trainer.step_arguments()
    base = policy.base
    per_mb = cfg.rows * cfg.budget / int(policy.mesh.size)
    rows = "spec.packing.tokenBudget, spec.trainer.microBatchSize"
    fields = f"spec.service.maxTrainingClients {state.models}, {rows}, spec.trainer.tpu"
    out: list[Program] = []
    for kind in LOSS_FNS:
        loss = LossSpec(kind)
        fwd = _Static(engine._forward, loss)
        out.append(
            Program(
                f"forward.{kind}",
                fwd,
                (lora, base, batch),
                state.total - state.base - state.adapter,
                fields,
                cfg.micro_batches * model_flops(policy.cfg, per_mb, backward=False),
                state_args=2,
            )
        )
    for kind in LOSS_FNS:
        loss = LossSpec(kind)
        out.append(
            Program(
                f"forward_backward.{kind}",
                _Static(engine._fwd_bwd, loss),
                (lora, lora, base, batch),
                state.total - state.base - 2 * state.adapter,
                fields,
                cfg.micro_batches * model_flops(policy.cfg, per_mb, backward=True),
                state_args=3,
            )
        )
    out.append(
        Program(
            "optim_step",
            engine._apply,
            (lora, lora, lora, count, lora, mask, hp),
            state.total - state.model,
            f"spec.service.maxTrainingClients {state.models}, spec.trainer.tpu",
        )
    )
    return out


class _Static:
    """A jitted Engine program with its static loss bound: ``lower(*args)`` as Program.fn needs."""

    def __init__(self, fn: Any, loss: Any) -> None:
        self.fn, self.loss = fn, loss

    def lower(self, *args: Any) -> Any:
        return self.fn.lower(*args, self.loss)


def largest_count(state: ServiceState, peak: int, capacity: int) -> int:
    """The most training models whose state, beside a program of ``peak`` bytes at ``state.models``
    models, fits ``capacity`` (0: not even one)."""
    fixed = peak - state.total  # the program's own temporaries and what its state does not change
    best = 0
    # Each model adds its own state and (past two) one more cached prompt-logprob adapter: linear, so solve.
    for n in (1, 2):
        if fixed + state.at(n).total <= capacity:
            best = n
    if best == 2:
        # From two models on, each adds its state and one cached adapter: total(n) = at(2) + (n - 2) x that.
        per = state.model + state.adapter
        best = max(2, (capacity - fixed - (state.at(2).total - 2 * per)) // per)
    return int(best)


def service_refusal(
    name: str, fig: dict[str, Any], p: Program, rc: RunConfig, chip: Chip, state: ServiceState
) -> str:
    """One line: the program, its peak with every model's state, and a model count that fits (else the
    packing or the slice, as the loop's programs are refused)."""
    peak = fig.get("peak_bytes_per_device")
    cap = chip.device_limit
    if peak and not fig.get("indivisible") and not fig.get("kernel_memory"):
        fit = largest_count(state, int(peak), cap)
        if 0 < fit < state.models:
            return (
                f"spec.service.maxTrainingClients: {state.models} training clients' adapters, Adam moments, "
                f"gradient buffers and masks ({state.model / GIB:.2f} GiB per device each) with {name} need "
                f"{peak / GIB:.1f} GiB per device of a {rc.trainer.tpu.type_name} device's {cap / GIB:.1f} "
                f"GiB usable HBM; at most {fit} fit (or lower spec.packing.tokenBudget, or a larger "
                "spec.trainer.tpu)"
            )
    return refusal(name, fig, p, rc, chip)
