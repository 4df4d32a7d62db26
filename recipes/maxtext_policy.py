"""Which MaxText keys rljob applies: every key the plan accepts is read by something, or refused.

rljob's trainer does not run MaxText's training program: it builds MaxText's model (rljob.trainer.model:
``pyconfig.initialize`` with the final key dict, ``models.Transformer``, MaxText's mesh and logical axis
rules) and runs its own step (rljob.trainer.train_step), loop (rljob.trainer.runtime) and checkpoints.
So a key MaxText's own trainer reads (its optimizer, schedule, data pipeline, checkpointing, profiler,
logging) would do nothing here unless rljob's trainer reads it. Each key of a MaxText version is one of:

- ``derived``: set by rljob from a spec field (rljob.recipes.trainer_keys.DERIVED_KEYS); a manifest may not
  set it;
- ``trainer``: read by rljob's trainer (:data:`TRAINER_KEYS` names where), with MaxText's meaning;
- ``model``: read by the MaxText model code the trainer builds (``model_reads`` of the committed key list,
  from a scan of that version's source by hack/gen_maxtext_keys.py, which names the file);
- ``refused``: nothing rljob runs reads it; the plan refuses it with the reason and what to set instead.

`rljob plan` therefore never shows as in effect a key that nothing reads (tests/recipes/test_maxtext_policy.py
enumerates every key of the version).
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal

from rljob.recipes.maxtext_keys import KeySet, number

Kind = Literal["derived", "trainer", "model", "refused"]

_OPT = "trainer/train_step.py Trainer.__init__: optax.adamw on the LoRA parameters"
# Keys rljob's trainer reads, with where (MaxText's meaning; rljob's default where the key is unset).
TRAINER_KEYS: Final[dict[str, str]] = {
    "opt_type": f"{_OPT} (adamw only)",
    "adam_b1": f"{_OPT}, b1 (unset: 0.9)",
    "adam_b2": f"{_OPT}, b2 (unset: 0.999)",
    "adam_eps": f"{_OPT}, eps (unset: 1e-8)",
    "adam_eps_root": f"{_OPT}, eps_root (unset: 0)",
    "adam_weight_decay": f"{_OPT}, weight_decay (unset: 0)",
    "mu_dtype": f"{_OPT}, mu_dtype: the first moment's dtype (unset: the parameters')",
    "gradient_clipping_threshold": "trainer/train_step.py Trainer.__init__: optax.clip_by_global_norm "
    "(0: no clipping; unset: 1.0)",
    "grad_dtype": "trainer/train_step.py Trainer.zero_acc / _accumulate: the gradient buffer's dtype "
    "(unset: the parameters')",
    "gradient_accumulation_steps": "trainer/train_step.py StepConfig.micro_batches: micro-batches scanned "
    "per compiled accumulate call; every micro-batch of a step is accumulated before its one optimizer "
    "update (unset: 4)",
    "checkpoint_period": "trainer/runtime.py RunSettings.checkpoint_every: an orbax checkpoint every N "
    "steps and at the last (unset: every step)",
    "profiler": "trainer/profiling.py: xplane traces of profiler_steps steps after "
    "skip_first_n_steps_for_profiler, under {storage}/tensorboard/plugins/profile",
    "profiler_steps": "trainer/profiling.py: steps traced (unset: 5)",
    "skip_first_n_steps_for_profiler": "trainer/profiling.py: steps before the first traced (unset: 1)",
}

# Keys the model reads that the trainer sets itself (rljob.trainer.model._RUNTIME_KEYS), with why.
TRAINER_SETS: Final[dict[str, str]] = {
    "enable_dropout": "rljob's trainer runs the model without dropout (the policy's log-probs must match "
    "the sampler's)",
    "skip_jax_distributed_system": "rljob's trainer initializes jax.distributed itself",
}

_CLIENT = "the Tinker service (spec.service) takes the optimizer from each optim_step's AdamParams"
# Trainer keys the Tinker service does not read (it reads gradient_accumulation_steps: its accumulate
# calls are the step's), with why.
SERVICE_UNREAD: Final[dict[str, str]] = {
    **{
        k: _CLIENT
        for k in (
            "opt_type",
            "adam_b1",
            "adam_b2",
            "adam_eps",
            "adam_eps_root",
            "adam_weight_decay",
            "mu_dtype",
            "grad_dtype",
            "gradient_clipping_threshold",
        )
    },
    "checkpoint_period": "the Tinker service checkpoints every spec.service.checkpointEvery optim steps",
    **{
        k: "the Tinker service writes no profiler traces"
        for k in ("profiler", "profiler_steps", "skip_first_n_steps_for_profiler")
    },
}

_SCHEDULE = "rljob's trainer owns the learning-rate schedule: set spec.algorithm.warmupSteps and "
_SCHEDULE += "spec.algorithm.learningRateSchedule"
_OPTIMIZER = "rljob's trainer owns the optimizer (AdamW on the LoRA parameters, adam_* keys): "
_OPTIMIZER += "use spec.algorithm.*"
_CHECKPOINTS = "rljob's trainer writes its own step-exact orbax checkpoints under {storage}/checkpoints "
_CHECKPOINTS += "(how often: checkpoint_period)"
_PROFILE = "rljob's trainer profiles with profiler: xplane, profiler_steps and "
_PROFILE += "skip_first_n_steps_for_profiler only"
_DATA = "rljob's trainer trains on the samplers' rollouts of spec.dataset's prompts: MaxText's input "
_DATA += "pipeline does not run (set spec.dataset, spec.algorithm.groupsPerBatch)"
_SAMPLER = "the samplers (vLLM) run inference: set spec.sampler.*"
_LOGS = "rljob's trainer logs its own step metrics (TensorBoard under {storage}/tensorboard, rljob status)"
_EVAL = "rljob's trainer evaluates held-out prompts of spec.dataset (spec.dataset.evalSize)"

# (pattern of key names, reason), first match wins; the reason of a refused key nothing else names.
_REASONS: Final[tuple[tuple[str, str], ...]] = (
    (
        r"^(warmup_steps_fraction|learning_rate_schedule_steps|learning_rate_final_fraction|lr_schedule_type"
        r"|cosine_learning_rate_final_fraction|wsd_.*)$",
        _SCHEDULE,
    ),
    (
        r"^(opt_type|adamw_mask|muon_.*|optimizer_memory_host_offload|shard_optimizer_over_data|qk_clip_.*"
        r"|skip_step_.*|trainable_parameters_mask|diloco_.*|num_diloco_.*|enable_diloco|enable_streaming_diloco"
        r"|use_tunix_gradient_accumulation|z_loss_multiplier|abort_on_.*)$",
        _OPTIMIZER,
    ),
    (
        r"checkpoint|^save_|^load_full_state_path$|^async_checkpointing$|^local_checkpoint|^replicator_"
        r"|^use_replicator_service$|^multi_tier|^mtc_|^standalone_checkpointer|^enable_autocheckpoint$"
        r"|^colocated_python",
        _CHECKPOINTS,
    ),
    (
        r"profil|^xprof_|^tpu_num_.*(trace|profile)|^enable_jax_profiler$|^jax_profiler_port$"
        r"|^hide_profiler_step_metric$|^managed_mldiagnostics",
        _PROFILE,
    ),
    (
        r"^eval_|_eval$|^target_eval_loss$|^global_batch_size_to_eval_on$|^micro_batch_size_to_eval_on$"
        r"|_for_eval$",
        _EVAL,
    ),
    (
        r"dataset|^grain_|^hf_|^tokeniz|^train_|^add_(bos|eos)$|data_|^enable_data_shuffling$|^num_epoch$"
        r"|^global_batch_size|^per_device_batch_size_|^rampup|^enable_rampup|^global_rampup|^packing_"
        r"|^use_(sft|dpo|grpo|chat_template|truncation)$|^sft_|^dpo$|^chat_template|^formatting_func"
        r"|^mmap_|^olmo_|^blend_|^max_corpus_chars$|^expansion_factor_real_data$|^reuse_example_batch$"
        r"|^colocated_python_data_input$|^generate_padding_batch|^offline_data_dir$|^eod_mask_loss$"
        r"|^reset_attention_mask$|_placeholder$|^(image|audio|video)_path$|^max_num_images_per_example$",
        _DATA,
    ),
    (
        r"decode|prefill|vllm|^inference|^kv_cache|^kv_quant|^prompt$|^system_prompt$|^stop_strings$"
        r"|^max_num_seqs$|^max_num_batched_tokens$|^rollout_|^enable_prefix_caching$|^prefix_caching"
        r"|^return_log_prob$|^multi_sampling$|^enable_model_warmup$|^enable_llm_inference_pool$"
        r"|^autoregressive_decode_assert$|^generate_slice$|^stack_prefill_result_cache$|^async_scheduling$"
        r"|^kv_tp_size$|^swap_space_vllm_gb$|^hbm_utilization_vllm$|^weight_sync|^log_weight_sync_time$"
        r"|^free_kv_cache_during_weight_sync$|^lora_input_adapters_path$|^hf_lora_adapter_path$",
        _SAMPLER,
    ),
    (
        r"^log_|^enable_(tensorboard|wandb|mllog|goodput_recording|pathways_goodput|gcp_.*)$|^wandb_"
        r"|tensorboard|goodput|^metrics_|^gcs_metrics$|^mllog_|^dump_|^heartbeat_|^report_|^monitor_"
        r"|^step_deviation_|^prometheus_port$|^gcs_debug_path$|^write_estimator_result$|^save_config_to_gcs$"
        r"|^debug_",
        _LOGS,
    ),
    (
        r"^distill_|^student_|^teacher_|^training_objective$|^block_diffusion_",
        "rljob trains with GRPO losses only (spec.algorithm.loss)",
    ),
    (
        r"^compile_xla_flags$",
        "rljob's trainer and its compile stage take XLA's TPU flags from spec.trainer.libtpuFlags "
        "(LIBTPU_INIT_ARGS), e.g. libtpuFlags: {xla_tpu_scoped_vmem_limit_kib: 65472}",
    ),
    (
        r"^compile_|^compiled_trainstep_file$|^internal_compile|^jax_cache_dir$",
        "rljob's trainer compiles its own step and keeps JAX's compilation cache under {storage}/cache",
    ),
    (
        r"^elastic_|^jax_distributed_initialization_timeout$|^enable_single_controller$|^num_target_devices$",
        "rljob's trainer runs one JAX process per TPU container and is restarted by the JobSet "
        "(spec.failurePolicy)",
    ),
)
_DEFAULT = (
    "read only by MaxText's own training, inference or conversion programs, which rljob's trainer does "
    "not run (it builds MaxText's model and runs its own step)"
)


def _reason(key: str) -> str:
    for pattern, reason in _REASONS:
        if re.search(pattern, key):
            return reason
    return _DEFAULT


def classify(key: str, keyset: KeySet, derived: frozenset[str] | set[str] = frozenset()) -> tuple[Kind, str]:
    """(kind, where or why) of one key of ``keyset``; ``derived``: the keys rljob derives from the spec."""
    if key in derived:
        return "derived", "set by rljob from the spec"
    if key in TRAINER_KEYS:
        return "trainer", TRAINER_KEYS[key]
    if key in TRAINER_SETS:
        return "refused", TRAINER_SETS[key]
    if key in keyset.model_reads:
        return "model", keyset.model_reads[key]
    return "refused", _reason(key)


def _value_problem(key: str, value: Any) -> str | None:
    """Why a trainer key's value cannot be applied, or None."""
    n = number(value)
    if key == "opt_type":
        return None if str(value) == "adamw" else f"{value!r}: {_OPTIMIZER} (opt_type adamw only)"
    if key == "profiler":
        if str(value) in ("", "xplane"):
            return None
        return f"{value!r}: rljob's trainer writes JAX profiler (xplane) traces: set xplane or ''"
    if key in ("gradient_accumulation_steps", "checkpoint_period", "profiler_steps"):
        return None if n is not None and n == int(n) and n >= 1 else f"{value!r}: must be an integer >= 1"
    if key == "skip_first_n_steps_for_profiler":
        return None if n is not None and n == int(n) and n >= 0 else f"{value!r}: must be an integer >= 0"
    if key in ("mu_dtype", "grad_dtype"):
        ok = ("", "float32", "bfloat16", "float16")
        return None if str(value) in ok else f"{value!r}: must be one of float32, bfloat16, float16"
    if key.startswith("adam_") or key == "gradient_clipping_threshold":
        return None if n is not None and n >= 0 else f"{value!r}: must be a number >= 0"
    return None


def problem(key: str, value: Any, keyset: KeySet, service: bool = False) -> str | None:
    """Why the plan refuses ``key: value`` (a key of ``keyset`` rljob does not derive), or None;
    ``service``: the trainer serves the Tinker API (spec.service) instead of running the RL loop."""
    kind, text = classify(key, keyset)
    if kind == "refused":
        return f"nothing rljob runs reads this key: {text}"
    if kind == "trainer" and service and key in SERVICE_UNREAD:
        return f"nothing rljob runs reads this key in service mode: {SERVICE_UNREAD[key]}"
    if kind == "trainer":
        return _value_problem(key, value)
    return None


def service_algorithm_problems(algorithm: Any) -> list[str]:
    """spec.algorithm's schedule in service mode, where each optim_step's AdamParams set the rate."""
    out = []
    if algorithm.warmup_steps:
        out.append(f"spec.algorithm.warmupSteps: {_CLIENT} (its learning_rate: the client's schedule)")
    if algorithm.learning_rate_schedule not in (None, "constant"):
        out.append(
            f"spec.algorithm.learningRateSchedule: {_CLIENT} (its learning_rate: the client's schedule)"
        )
    return out


def trainer_int(keys: dict[str, Any], key: str, default: int) -> int:
    """A trainer key's value as an int (the plan checked it), else ``default``."""
    n = number(keys.get(key))
    return default if key not in keys or n is None else int(n)


def trainer_float(keys: dict[str, Any], key: str, default: float) -> float:
    """A trainer key's value as a float (the plan checked it), else ``default``."""
    n = number(keys.get(key))
    return default if key not in keys or n is None else n


__all__ = [
    "SERVICE_UNREAD",
    "TRAINER_KEYS",
    "TRAINER_SETS",
    "Kind",
    "classify",
    "problem",
    "service_algorithm_problems",
    "trainer_float",
    "trainer_int",
]
