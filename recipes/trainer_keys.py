"""The trainer's final MaxText keys (`final_keys`: what rljob derives from the spec < recipe < profile <
manifest, each key's source, the keys MaxText's defaults would not run with filled) and the checks the
plan makes against them: the fused log-prob head, balanced padding, LoRA targets. Pure: no I/O beyond the
package's own data files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rljob.recipes import lora_targets, maxtext_keys, maxtext_policy, mesh
from rljob.recipes.api import RLJob, RLJobSpec
from rljob.recipes.runconfig import MeshPlan
from rljob.recipes.spec_layers import Layers
from rljob.recipes.syntax import key_path

# The fused log-prob head's token tile defaults to the largest divisor of a device's tokens per
# micro-batch up to this (spec.trainer.logprobs.tokenTile).
MAX_DEFAULT_TOKEN_TILE = 2048


# MaxText keys rljob derives from the spec; a recipe, profile or manifest may not set them. Those of
# NOT_IN_KEYS are not put in the final key dict either: nothing rljob runs reads them there (the trainer
# reads the spec field itself; rljob.recipes.maxtext_policy), so `rljob plan` does not list them.
DERIVED_KEYS: dict[str, str] = {
    "model_name": "spec.model.maxtextModel",
    "run_name": "metadata.name",
    "base_output_directory": "spec.storage.root",
    "load_parameters_path": "spec.model.checkpoint",
    "max_target_length": "spec.packing.tokenBudget",
    "per_device_batch_size": "spec.trainer.microBatchSize",
    "learning_rate": "spec.algorithm.learningRate",
    "steps": "spec.algorithm.steps",
    "packing": "spec.packing",
    **{
        f"{kind}_{axis}_parallelism": "spec.trainer.mesh"
        for kind in ("ici", "dcn")
        for axis in ("data", "fsdp", "tensor", "context", "expert")
    },
}


# Unknown MaxText keys that get a "did you mean" hint (see final_keys).
MAX_KEY_HINTS = 10


# Where each maxtext key came from, lowest precedence first; "derived": no layer set it and MaxText's
# default would not run, so the plan filled the value that does (RunConfig.derived says why).
SOURCES = ("rljob", "recipe", "profile", "manifest", "derived")


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def decoder_block(spec: RLJobSpec, keys: Mapping[str, Any]) -> str | None:
    """The model's MaxText decoder block: the ``decoder_block`` key of ``keys``, else its model config's
    (MaxText's default under it); None where the MaxText version or the model is unknown (reported by
    final_keys)."""
    assert spec.model is not None
    try:
        keyset = maxtext_keys.load(maxtext_version(spec))
    except KeyError:
        return None
    if str(spec.model.maxtext_model) not in keyset.models:
        return None
    return str(
        maxtext_keys.effective(keys, keyset, str(spec.model.maxtext_model))("decoder_block") or ""
    ).lower()


NOT_IN_KEYS = frozenset(
    {"run_name", "base_output_directory", "load_parameters_path", "learning_rate", "steps"}
)


def rljob_keys(
    spec: RLJobSpec, job: RLJob, ici: MeshPlan, dcn: MeshPlan, per_device_batch: float
) -> dict[str, Any]:
    """The MaxText keys rljob sets from the spec (DERIVED_KEYS but NOT_IN_KEYS)."""
    assert spec.model and spec.packing
    return {
        "model_name": spec.model.maxtext_model,
        "max_target_length": spec.packing.token_budget,
        "per_device_batch_size": per_device_batch,
        "packing": True,
        **mesh.maxtext_keys(ici, dcn),
    }


def maxtext_version(spec: RLJobSpec) -> str:
    """spec.trainer.maxtextVersion (set by DEFAULTS)."""
    assert spec.trainer is not None and spec.trainer.maxtext_version is not None
    return spec.trainer.maxtext_version


def head_problems(spec: RLJobSpec, keys: Mapping[str, Any], tokens: int, devices: int) -> list[str]:
    """What the trainer's fused log-prob head needs (rljob.trainer.model / logprobs), checked here so the
    trainer never refuses at start: MaxText's hidden states in training, MaxText's vocabulary tiling at
    the trainer's value, and block sizes that fit a device's share of a micro-batch (``tokens``: packed
    tokens of one micro-batch over all ``devices``). Fills spec.trainer.logprobs.tokenTile."""
    assert spec.trainer is not None and spec.trainer.logprobs is not None and spec.model is not None
    out: list[str] = []
    version = maxtext_version(spec)
    try:
        keyset = maxtext_keys.load(version)
    except KeyError:
        return out  # reported by final_keys
    get = maxtext_keys.effective(keys, keyset, str(spec.model.maxtext_model))

    path = "spec.trainer.maxtext"
    attention = str(get("attention"))
    if attention in ("vllm_rpa", "vllm_batched_rpa"):
        out.append(
            f"{path}.attention: {attention} is vLLM's serving attention: MaxText then computes neither "
            "logits nor the hidden states the trainer's log-prob head reads"
        )
    if (
        maxtext_keys.truthy(get("use_indexer"))
        and (maxtext_keys.number(get("indexer_loss_scaling_factor")) or 0.0) > 0
        and not maxtext_keys.truthy(get("indexer_sparse_training"))
    ):
        out.append(
            f"{path}.use_indexer: the indexer's dense warm-up (indexer_loss_scaling_factor > 0 without "
            "indexer_sparse_training) trains the indexer alone: MaxText skips the hidden states the RL "
            "trainer's log-prob head reads"
        )
    if maxtext_keys.truthy(get("quantize_logits_proj")):
        out.append(
            f"{path}.quantize_logits_proj: MaxText refuses it with vocabulary tiling, which the trainer "
            f"always turns on (num_vocab_tiling >= {maxtext_keys.TRAINER_MIN_VOCAB_TILING}) to read the "
            "hidden states instead of [B, T, V] logits"
        )
    tiling = maxtext_keys.TRAINER_MIN_VOCAB_TILING
    per_device = tokens / devices  # per_device_batch_size x max_target_length
    explicit = int(maxtext_keys.number(get("num_vocab_tiling")) or 1)
    # An explicit num_vocab_tiling > 1 is MaxText's own rule (maxtext_keys.check_rules); at 1 the trainer
    # raises it to its minimum, which MaxText then checks at start.
    if explicit <= 1 and (per_device != int(per_device) or int(per_device) % tiling):
        out.append(
            f"spec.trainer.microBatchSize: {per_device:g} tokens per device (microBatchSize x tokenBudget / "
            f"{devices} devices) do not split into the {tiling} vocabulary tiles of MaxText's "
            "num_vocab_tiling, which the trainer sets to at least "
            f"{maxtext_keys.TRAINER_MIN_VOCAB_TILING} (the hidden states instead of [B, T, V] logits)"
        )
    lp = spec.trainer.logprobs
    if per_device == int(per_device) and per_device >= 1:
        n = int(per_device)
        if lp.token_tile is None:
            lp.token_tile = max(d for d in range(1, min(n, MAX_DEFAULT_TOKEN_TILE) + 1) if n % d == 0)
        elif n % lp.token_tile:
            out.append(
                f"spec.trainer.logprobs.tokenTile: {lp.token_tile} does not divide the {n} tokens each "
                f"device scores per micro-batch (microBatchSize x tokenBudget / {devices} devices): the last "
                "tile of every micro-batch would be partly recomputed"
            )
    elif lp.token_tile is None:
        lp.token_tile = MAX_DEFAULT_TOKEN_TILE
    vocab = maxtext_keys.number(get("vocab_size"))
    if lp.vocab_chunk is not None and vocab and lp.vocab_chunk > vocab:
        out.append(
            f"spec.trainer.logprobs.vocabChunk: {lp.vocab_chunk} exceeds the model's vocabulary of {vocab:g} "
            "tokens"
        )
    return out


def lora_problems(spec: RLJobSpec, keys: Mapping[str, Any] | None) -> list[str]:
    """What the trainer checks of spec.lora.targets at start (rljob.recipes.lora_targets, the one table
    both use): known projection names and, with the MaxText keys, projections the model's decoder block
    has. ``keys`` None: the names only."""
    assert spec.lora is not None and spec.model is not None and spec.trainer is not None
    targets = spec.lora.targets or []
    block = None  # the names only: no keys, or an unknown model (reported by final_keys)
    q_lora_rank, sliced = None, False
    if keys is not None:
        if maxtext_version(spec) not in maxtext_keys.versions():
            return []  # reported by final_keys
        block = decoder_block(spec, keys)
        get = maxtext_keys.effective(
            keys, maxtext_keys.load(maxtext_version(spec)), str(spec.model.maxtext_model)
        )
        q_lora_rank, sliced = get("q_lora_rank") or 0, get("use_sliced_mla_proj") or False
    found = lora_targets.problems(block, targets)
    if not found:
        found = lora_targets.mla_problems(block, targets, q_lora_rank, sliced)
    found += lora_targets.sampler_problems(block, targets)
    return [f"{field}: {message}" for field, message in found]


def balanced_problems(spec: RLJobSpec, keys: Mapping[str, Any], context: int) -> list[str]:
    """padPosition balanced: the row must split into 2 x context chunks of whole query blocks and into
    whole key blocks of both Splash kernels (the tile model the trainer's packer scores)."""
    assert spec.packing and spec.packing.token_budget and spec.trainer
    try:
        keyset = maxtext_keys.load(maxtext_version(spec))
    except KeyError:
        return []  # the unknown version is reported by final_keys
    model = maxtext_keys.attention_tile_model(keys, keyset, context)
    budget = spec.packing.token_budget
    out = []
    blocks = [n for q, k in model["kernel_blocks"] for n in (2 * context * q, k)]
    # the smallest budget from this one up that every kernel's blocks split (with positive blocks)
    unit = math.lcm(spec.packing.segment_align or 1, *blocks) if min(blocks) > 0 else 1
    fits = round_up(budget, unit)
    for names, (bq, bk) in zip(maxtext_keys.SPLASH_BLOCK_KEYS, model["kernel_blocks"], strict=True):
        if bq <= 0 or bk <= 0:
            out.append(
                f"spec.trainer.maxtext.{names[0]}: Splash blocks must be positive for padPosition balanced"
            )
        elif budget % (2 * context * bq) or budget % bk:
            out.append(
                f"spec.packing.tokenBudget: {budget} must be a multiple of 2 x context {context} x "
                f"{names[0]} {bq} and of {names[1]} {bk} for padPosition balanced (the next budget that "
                f"fits every kernel: {fits})"
            )
    return out


def _splash(spec: RLJobSpec, keys: Mapping[str, Any]) -> dict[str, int] | None:
    """The Splash blocks of these keys (:func:`maxtext_keys.splash_blocks`) where the trainer's attention
    is Splash (``attention`` flash, or MaxText's default autoselected, which takes Splash on a TPU for rows
    of 128 tokens and more); None where it is not, or the MaxText version is unknown (final_keys says so)."""
    try:
        keyset = maxtext_keys.load(maxtext_version(spec))
    except KeyError:
        return None
    attention = str(keys["attention"] if "attention" in keys else keyset.defaults.get("attention"))
    if attention not in ("flash", "autoselected"):
        return None
    return maxtext_keys.splash_blocks(keys, keyset)


def splash_unit(spec: RLJobSpec) -> int:
    """What a default tokenBudget is a multiple of so that :func:`splash_problems` holds: the Splash blocks
    of the spec's MaxText keys (recipe, profile and manifest merged), times the context axis where the mesh
    names it (ICI and DCN); 1 where the attention is not Splash."""
    assert spec.trainer is not None
    blocks = _splash(spec, dict(spec.trainer.maxtext or {}))
    if not blocks:
        return 1
    context = 1
    for axes in (spec.trainer.mesh, spec.trainer.mesh.dcn if spec.trainer.mesh else None):
        if axes is not None and axes.context and axes.context > 1:
            context *= axes.context
    return math.lcm(*(b for b in blocks.values() if b > 0)) * context


def splash_problems(spec: RLJobSpec, keys: Mapping[str, Any], context: int) -> list[str]:
    """Where the trainer's attention is Splash (:func:`_splash`): each Splash block (clamped to the row, as
    MaxText does) divides the tokens of a row each context rank holds, or the kernel refuses the trainer's
    first step."""
    assert spec.packing and spec.packing.token_budget
    budget = spec.packing.token_budget
    blocks = _splash(spec, keys)
    if blocks is None or budget < 128:
        return []
    row = budget // max(context, 1)
    bad = {k: b for k, b in blocks.items() if b <= 0 or row % min(b, row)}
    if not bad or (context > 1 and budget % (2 * context)):
        return []  # a budget the context axis (or its load-balanced chunks) does not split: the mesh's check
    unit = math.lcm(*(min(b, row) for b in blocks.values() if b > 0))
    where = f"the {row} tokens of a row each of {context} context ranks holds" if context > 1 else "a row"
    return [
        f"spec.packing.tokenBudget: {budget} does not split into whole Splash attention blocks "
        f"({', '.join(f'{k} {b}' for k, b in bad.items())}) over {where}: use a multiple of "
        f"{unit * max(context, 1)}, or set those spec.trainer.maxtext keys to divide it"
    ]


def final_keys(
    spec: RLJobSpec,
    layers: Layers,
    job: RLJob,
    derived: dict[str, Any],
    problems: list[str],
    rules: bool = True,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The final MaxText key dict and each key's source; problems appended."""
    assert spec.trainer is not None
    version = maxtext_version(spec)
    try:
        keyset = maxtext_keys.load(version)
    except KeyError:
        problems.append(
            f"spec.trainer.maxtextVersion: no MaxText key list for {version!r}; "
            f"known: {', '.join(maxtext_keys.versions())}"
        )
        return {}, {}
    job_keys = dict((job.spec.trainer.maxtext or {}) if job.spec.trainer else {})
    recipe_keys = dict((layers.recipe.get("trainer") or {}).get("maxtext") or {})
    profile_keys = dict((layers.profile.get("trainer") or {}).get("maxtext") or {})
    layer_keys = {"recipe": recipe_keys, "profile": profile_keys, "manifest": job_keys}
    where = {
        "recipe": f" (from recipe {layers.recipe_name})",
        "profile": f" (from profile {layers.profile_name} of recipe {layers.recipe_name})",
        "manifest": "",
    }
    keys: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for k, v in derived.items():
        keys[k], sources[k] = v, "rljob"
    hints_left = MAX_KEY_HINTS
    for source in ("recipe", "profile", "manifest"):
        for k, v in layer_keys[source].items():
            path = key_path("spec.trainer.maxtext", k)
            if v is None:  # a manifest removing a recipe key
                keys.pop(k, None)
                sources.pop(k, None)
                continue
            if k in DERIVED_KEYS:
                problems.append(
                    f"{path}: set by rljob from {DERIVED_KEYS[k]}; set that instead{where[source]}"
                )
                continue
            if k not in keyset:
                # difflib costs O(keys x key length) per unknown key: hints for the first few only.
                hint = keyset.suggest(k) if hints_left > 0 and len(k) <= 64 else []
                hints_left -= 1
                problems.append(
                    f"{path}: not a MaxText {keyset.version} config key{where[source]}"
                    + (f" (did you mean {', '.join(hint)}?)" if hint else "")
                )
                continue
            if spec.service is not None and source != "manifest" and k in maxtext_policy.SERVICE_UNREAD:
                continue  # a recipe's loop-mode key the Tinker service does not read: left out, not listed
            why = maxtext_policy.problem(k, v, keyset, service=spec.service is not None)
            if why is not None:
                problems.append(f"{path}: {why}{where[source]}")
                continue
            keys[k], sources[k] = v, source
    if spec.model and spec.model.maxtext_model not in keyset.models:
        problems.append(
            f"spec.model.maxtextModel: {spec.model.maxtext_model!r} is not a MaxText "
            f"{keyset.version} model name"
        )
    for k, (value, why) in maxtext_keys.derived_keys(keys, keyset).items():
        keys[k], sources[k] = value, "derived"
        layers.derived[key_path("spec.trainer.maxtext", k)] = why
    if rules:
        for k, msg in maxtext_keys.check_rules(keys, keyset):
            origin = where.get(sources.get(k, ""), "")
            problems.append(f"{key_path('spec.trainer.maxtext', k)}: {msg}{origin}")
    return dict(sorted(keys.items())), dict(sorted(sources.items()))
