"""The RL loop's options in the spec: the loss options and sampling parameters of spec.algorithm and
spec.evaluation. Fills what derives from other fields (spec.evaluation.samples and .temperature) and
returns every problem, one `spec.path: message` line each (rljob.recipes.plan calls it; the trainer and
the samplers read the resolved values: rljob.trainer.loop, rljob.trainer.rollouts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rljob.recipes.api import EvaluationSpec, RLJobSpec

Sets = Callable[..., bool]
"""Whether the recipe, its profile or the manifest sets the field at a camelCase path under spec."""

# What the loop reads and the Tinker service leaves to its clients (their loss_fn, loss_fn_config and
# sampling parameters): set in service mode, it would do nothing.
_LOOP_ONLY = (
    ("algorithm", "clipLow"),
    ("algorithm", "clipHigh"),
    ("algorithm", "importanceRatio"),
    ("algorithm", "lossNormalization"),
    ("algorithm", "overlongBuffer"),
    ("algorithm", "overlongPenalty"),
    ("algorithm", "sampling"),
    ("evaluation",),
    ("lora", "initFrom"),
)


def problems(spec: RLJobSpec, sets: Sets) -> list[str]:
    """Checks spec.algorithm's loop options and fills spec.evaluation; every problem found."""
    alg = spec.algorithm
    assert alg is not None and alg.max_tokens and alg.group_size and alg.sampling is not None
    out: list[str] = []
    if spec.service is not None:
        out += [
            f"spec.{'.'.join(path)}: the Tinker service (spec.service) trains and samples as each client's "
            "requests say (loss_fn, loss_fn_config, sampling parameters); remove it"
            for path in _LOOP_ONLY
            if sets(*path)
        ]
    if alg.loss != "ppo":
        out += [
            f"spec.algorithm.{name}: only loss ppo clips the ratio; with {alg.loss} it would do nothing (set "
            "spec.algorithm.loss: ppo, or remove it)"
            for name in ("clipLow", "clipHigh")
            if sets("algorithm", name)
        ]
    assert alg.overlong_buffer is not None
    if alg.overlong_buffer > alg.max_tokens:
        out.append(
            f"spec.algorithm.overlongBuffer: {alg.overlong_buffer} exceeds maxTokens {alg.max_tokens}: the "
            "shaping would start before the completion's first token"
        )
    if not alg.overlong_buffer and sets("algorithm", "overlongPenalty"):
        out.append(
            "spec.algorithm.overlongPenalty: read only with spec.algorithm.overlongBuffer above 0; alone it "
            "would do nothing"
        )
    if alg.sampling.top_k == 1 and alg.group_size > 1:
        out.append(
            f"spec.algorithm.sampling.topK: 1 samples greedily: the {alg.group_size} completions of a prompt "
            "(groupSize) would be the same and carry no signal for GRPO"
        )
    out += _evaluation(spec.evaluation)
    return out


def _evaluation(ev: EvaluationSpec | None) -> list[str]:
    """spec.evaluation: fills samples (max(passK, majK)) and temperature (0 with one sample, else 1)."""
    assert ev is not None and ev.pass_k is not None and ev.maj_k is not None
    out: list[str] = []
    need = max(ev.pass_k, ev.maj_k)
    if ev.samples is None:
        ev.samples = need
    elif ev.samples < need:
        out.append(
            f"spec.evaluation.samples: {ev.samples} is below max(passK, majK) = {need}: pass@k and maj@k "
            "need k samples of each prompt"
        )
    if ev.temperature is None:
        ev.temperature = 0.0 if ev.samples == 1 else 1.0
    elif ev.temperature == 0 and ev.samples > 1:
        out.append(
            f"spec.evaluation.temperature: 0 is greedy: the {ev.samples} samples of a prompt would be the "
            "same (set a temperature above 0, or one sample)"
        )
    return out


def summary(spec: Any) -> list[str]:
    """The loop options of a resolved spec (RunConfig.spec) as `rljob plan` shows them, under its
    "algorithm:" line; none in service mode (the clients choose)."""
    if spec.service is not None:
        return []
    alg, ev = spec.algorithm, spec.evaluation
    loss = f"  loss: {alg.importance_ratio}-level ratio"
    if alg.loss == "ppo":
        loss += f" clipped to [{1 - alg.clip_low:g}, {1 + alg.clip_high:g}]"
    loss += f", {alg.loss_normalization}-level normalization, advantages {alg.advantage_normalization}"
    if alg.overlong_buffer:
        start = alg.max_tokens - alg.overlong_buffer
        loss += (
            f", overlong shaping: -{alg.overlong_penalty:g} x (length - {start}) / {alg.overlong_buffer} "
            f"past {start} tokens"
        )
    smp = alg.sampling
    sampling = (
        f"  sampling: temperature {smp.temperature:g}, top-p {smp.top_p:g}, top-k "
        f"{smp.top_k or 'off'}, stop {list(smp.stop) or 'none'}, max tokens {alg.max_tokens}"
    )
    if not ev.every:
        evaluation = "  evaluation: off (spec.evaluation.every 0)"
    else:
        how = "greedy" if ev.temperature == 0 else f"temperature {ev.temperature:g}"
        evaluation = (
            f"  evaluation: every {ev.every} steps on the {spec.dataset.eval_size} held-out prompts, "
            f"{ev.samples} sample(s) each ({how}): pass@{ev.pass_k}"
            + (f", maj@{ev.maj_k}" if ev.maj_k else "")
        )
    out = [loss, sampling, evaluation]
    if spec.lora.init_from:
        out.append(f"  warm start: LoRA from {spec.lora.init_from} (published as adapter v0)")
    return out


__all__ = ["problems", "summary"]
