"""MaxText keys: the key set of a MaxText version, and MaxText's inter-key rules rljob checks early.

The key set comes from recipes/data/maxtext-<version>-keys.json, generated from that version's own
config model by hack/gen_maxtext_keys.py (tests/recipes/test_maxtext_keys.py proves the committed file
matches the installed maxtext). MaxText refuses any key its config model does not define when the
trainer starts; rljob refuses it at submit time instead, naming the key.

Inter-key rules (MaxText configs/types.py; shared/reference/seed-code-facts.md §1.7, §4), checked on
the effective value of each key (the job's value, else the version's default). A rule about a key
the version does not define never fires: setting such a key is refused as unknown.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from rljob.recipes import families

DEFAULT_VERSION = "0.2.5"
# The trainer runs MaxText with num_vocab_tiling at least this (rljob.trainer.model): MaxText then skips its
# output head in training and sows the final hidden states, which the fused log-prob head reads.
TRAINER_MIN_VOCAB_TILING = 2
_PREFIX = "maxtext-"
_SUFFIX = "-keys.json"


@dataclass(frozen=True)
class KeySet:
    """The keys one MaxText version defines, with their defaults."""

    version: str
    defaults: Mapping[str, Any]
    models: Mapping[str, Mapping[str, Any]]
    # Key -> where the MaxText model code rljob's trainer builds reads it (rljob.recipes.maxtext_policy).
    model_reads: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __contains__(self, key: object) -> bool:
        return key in self.defaults

    def suggest(self, key: str) -> list[str]:
        return difflib.get_close_matches(key, list(self.defaults), n=3, cutoff=0.75)


def versions() -> list[str]:
    """MaxText versions with a committed key list."""
    names = [p.name for p in resources.files("rljob.recipes").joinpath("data").iterdir()]
    return sorted(
        n[len(_PREFIX) : -len(_SUFFIX)] for n in names if n.startswith(_PREFIX) and n.endswith(_SUFFIX)
    )


@cache
def load(version: str) -> KeySet:
    """The key set of a MaxText version; KeyError when no list is committed for it (the version is looked
    up among the committed files, never joined into a path)."""
    if version not in versions():
        raise KeyError(version)
    res = resources.files("rljob.recipes").joinpath("data", f"{_PREFIX}{version}{_SUFFIX}")
    doc = json.loads(res.read_text(encoding="utf-8"))
    return KeySet(
        version=str(doc["maxtext"]),
        defaults=doc["keys"],
        models=doc.get("models", {}),
        model_reads=doc.get("model_reads", {}),
    )


def effective(keys: Mapping[str, Any], keyset: KeySet, model: str | None = None) -> Callable[[str], Any]:
    """The lookup of the value MaxText runs a key with: the job's key (``keys``), else the config of
    ``model`` (the ``model_name`` key where None), else MaxText's default; None where none has it. Every
    reader of a model's effective key goes through this, against the key set of the manifest's
    spec.trainer.maxtextVersion."""
    name = str(keys.get("model_name", "") if model is None else model)
    config = keyset.models.get(name, {})

    def get(key: str) -> Any:
        if key in keys:
            return keys[key]
        return config.get(key, keyset.defaults.get(key))

    return get


def truthy(value: Any) -> bool:
    """A MaxText boolean as a config file or the CLI writes it (true, "True", "1", ...)."""
    return _truthy(value)


def number(value: Any) -> float | None:
    """A MaxText number as a config file or the CLI writes it; None when it is not one."""
    return _number(value)


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _number(value: Any) -> float | None:
    """A key's value as a finite number (MaxText reads numbers from strings too), else None."""
    if isinstance(value, bool):
        return float(value)
    try:
        if isinstance(value, int | float | str):
            out = float(value)
            return out if math.isfinite(out) else None
    except (ValueError, OverflowError):
        return None
    return None


def _none(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in ("none", ""))


MOE_EXPERT_WEIGHT_PREFETCH = ("forward", "forward_backward")


# The mesh axes of MaxText 0.2.5's custom mesh rules (``mesh_axes`` of
# maxtext/configs/custom_mesh_and_rule/<name>.yml; tests/recipes/test_maxtext_keys.py compares with the
# installed MaxText): a rule builds the mesh over these axes only, so a parallelism on any other axis
# leaves devices out and MaxText refuses the mesh at start.
CUSTOM_MESH_AXES: dict[str, tuple[str, ...]] = {
    "cp-as-ep": ("data", "stage", "fsdp", "context", "expert"),
    "ep-as-cp": ("data", "stage", "fsdp", "expert"),
    "ep-as-dp": ("data", "fsdp", "fsdp_transpose", "expert"),
    "fsdp-as-dp-for-attn": ("data", "fsdp", "fsdp_transpose", "expert"),
    "pipeline-large-moe": ("data", "stage", "fsdp", "context", "tensor", "expert"),
    "pure-fsdp": ("fsdp",),
    "shard-exp-on-fsdp": ("data", "stage", "fsdp", "fsdp_transpose", "context", "expert"),
}
# The mesh axes rljob sets (spec.trainer.mesh; MaxText ici_<axis>_parallelism / dcn_<axis>_parallelism).
_RLJOB_MESH_AXES = ("data", "fsdp", "tensor", "context", "expert")

# MaxText 0.2.5's decoder blocks with gated delta net layers (configs/types.py: QWEN3_NEXT, QWEN3_5).
GATED_DELTA_NET_BLOCKS = families.blocks_where("recurrent")


def check_rules(keys: Mapping[str, Any], keyset: KeySet) -> list[tuple[str, str]]:
    """MaxText's inter-key rules on the final key dict: a list of (key, message)."""

    def has(k: str) -> bool:
        return k in keyset

    def get(k: str) -> Any:
        return keys[k] if k in keys else keyset.defaults.get(k)

    def num(k: str) -> float:
        v = _number(get(k))
        return 0.0 if v is None else v

    problems: list[tuple[str, str]] = []
    ring = has("use_ring_of_experts") and _truthy(get("use_ring_of_experts"))
    chunks = int(num("num_moe_token_chunks")) if has("num_moe_token_chunks") else 1
    target = int(num("max_target_length")) if has("max_target_length") else 0

    if chunks > 1 and not ring:
        problems.append(("num_moe_token_chunks", f"{chunks} chunks require use_ring_of_experts=true"))
    if chunks > 1 and target and target % chunks:
        problems.append(
            (
                "num_moe_token_chunks",
                f"max_target_length {target} (the packing token budget) is not divisible "
                f"by num_moe_token_chunks {chunks}",
            )
        )
    if has("moe_chunk_pipeline") and _truthy(get("moe_chunk_pipeline")):
        if chunks <= 1:
            problems.append(
                ("moe_chunk_pipeline", "requires num_moe_token_chunks > 1 (set it false at one chunk)")
            )
        if not ring:
            problems.append(("moe_chunk_pipeline", "requires use_ring_of_experts=true"))
        if has("moe_chunk_barrier") and _truthy(get("moe_chunk_barrier")):
            problems.append(("moe_chunk_pipeline", "requires moe_chunk_barrier=false"))
        if has("num_moe_emb_chunks") and num("num_moe_emb_chunks") != 0:
            problems.append(("moe_chunk_pipeline", "requires num_moe_emb_chunks=0"))
    if has("moe_roe_packed_routing_gather") and _truthy(get("moe_roe_packed_routing_gather")):
        pipeline = has("moe_chunk_pipeline") and _truthy(get("moe_chunk_pipeline"))
        if not pipeline:
            problems.append(("moe_roe_packed_routing_gather", "requires moe_chunk_pipeline=true"))
    for k in ("ring_of_experts_local_routing", "ring_of_experts_row_major_reduce_scatter"):
        if has(k) and _truthy(get(k)) and not ring:
            problems.append((k, "requires use_ring_of_experts=true"))
    ragged = has("ragged_buffer_factor") and num("ragged_buffer_factor") > 0
    if ring and ragged and not (has("use_ragged_sort") and _truthy(get("use_ragged_sort"))):
        problems.append(
            ("ragged_buffer_factor", "> 0 with use_ring_of_experts requires use_ragged_sort=true")
        )
    if has("moe_expert_weight_prefetch") and not _none(get("moe_expert_weight_prefetch")):
        value = str(get("moe_expert_weight_prefetch"))
        if value not in MOE_EXPERT_WEIGHT_PREFETCH:
            problems.append(
                ("moe_expert_weight_prefetch", f"must be none, forward or forward_backward, not {value!r}")
            )
        elif not _truthy(get("sparse_matmul")):
            problems.append(("moe_expert_weight_prefetch", "requires sparse_matmul=true"))
    if (
        has("use_tokamax_splash")
        and has("use_jax_splash")
        and _truthy(get("use_tokamax_splash"))
        and _truthy(get("use_jax_splash"))
    ):
        problems.append(
            ("use_jax_splash", "at most one of use_tokamax_splash and use_jax_splash can be true")
        )
    if has("num_vocab_tiling") and num("num_vocab_tiling") > 1 and target:
        tiles = int(num("num_vocab_tiling"))
        tokens = num("per_device_batch_size") * target
        if tokens != int(tokens) or int(tokens) % tiles:
            problems.append(
                (
                    "num_vocab_tiling",
                    f"per_device_batch_size x max_target_length = {tokens} is not divisible by "
                    f"num_vocab_tiling {tiles}",
                )
            )
    cp = int(num("ici_context_parallelism") * max(num("dcn_context_parallelism"), 1))
    if cp > 1 and target and str(get("context_parallel_strategy")) == "ring" and target % (cp * cp):
        problems.append(
            (
                "context_parallel_strategy",
                f"ring context parallelism {cp} needs max_target_length % {cp * cp} == 0, "
                f"max_target_length is {target}",
            )
        )
    balanced = get("context_parallel_load_balance")
    ring = str(get("context_parallel_strategy")) == "ring"  # its own check above is the stricter one
    uneven = bool(target) and not ring and target % (2 * cp)
    if cp > 1 and (balanced is None or _truthy(balanced)) and (cp % 2 or uneven):
        # The trainer feeds the rows in the load-balanced order (2 x cp equal chunks: rank r holds chunks r
        # and 2cp-1-r; MaxText's max_utils.reorder_sequence), which needs both.
        problems.append(
            (
                "context_parallel_load_balance",
                f"load-balanced context parallelism {cp} needs an even context axis and a token budget "
                f"(max_target_length, spec.packing.tokenBudget) divisible by {2 * cp}, it is {target}; set "
                "context_parallel_load_balance=false or change the context axis",
            )
        )
    rule = get("custom_mesh_and_rule")
    if not _none(rule) and str(rule) in CUSTOM_MESH_AXES:
        axes = CUSTOM_MESH_AXES[str(rule)]
        for axis in _RLJOB_MESH_AXES:
            size = int(num(f"ici_{axis}_parallelism") or 1) * int(num(f"dcn_{axis}_parallelism") or 1)
            if size > 1 and axis not in axes:
                problems.append(
                    (
                        "custom_mesh_and_rule",
                        f"{rule} builds the mesh over {', '.join(axes)} only: spec.trainer.mesh.{axis} "
                        f"{size} would leave devices out (MaxText refuses the mesh at start); set "
                        f"spec.trainer.mesh.{axis} to 1 or use another rule",
                    )
                )
    model = str(get("model_name"))
    effective_ = effective(keys, keyset, model)
    block = effective_("decoder_block")
    balance = get("context_parallel_load_balance")
    if cp > 1 and str(block) in GATED_DELTA_NET_BLOCKS and (balance is None or _truthy(balance)):
        problems.append(
            (
                "context_parallel_load_balance",
                f"the {block} decoder's gated delta net layers with context parallelism {cp} need "
                "context_parallel_load_balance=false: their recurrence runs in device order, which the "
                "load-balancing reorder breaks, and MaxText refuses it at start",
            )
        )
    if model in keyset.models and not _truthy(get("override_model_config")):
        for k, fixed in keyset.models[model].items():
            if k in keys and k != "model_name" and keys[k] != fixed:
                problems.append(
                    (
                        k,
                        f"the {model} model config sets {k}={fixed!r}; MaxText refuses another value unless "
                        "override_model_config=true",
                    )
                )
    return problems


def derived_keys(keys: Mapping[str, Any], keyset: KeySet) -> dict[str, tuple[Any, str]]:
    """Keys absent from ``keys`` (no layer set them) whose MaxText default check_rules would refuse, with
    the one value that runs and why: the plan fills these (source ``derived``) instead of refusing a value
    the user never chose. A key a layer set is left to check_rules."""

    def get(k: str) -> Any:
        return keys[k] if k in keys else keyset.defaults.get(k)

    def num(k: str) -> float:
        v = _number(get(k))
        return 0.0 if v is None else v

    out: dict[str, tuple[Any, str]] = {}
    cp = int(num("ici_context_parallelism") * max(num("dcn_context_parallelism"), 1))
    model = str(get("model_name"))
    effective_ = effective(keys, keyset, model)
    block = effective_("decoder_block")
    key = "context_parallel_load_balance"
    if cp > 1 and str(block) in GATED_DELTA_NET_BLOCKS and key not in keys and key in keyset:
        out[key] = (
            False,
            f"the {block} decoder's gated delta net layers with context parallelism {cp}: MaxText refuses "
            "the default true at start (their recurrence runs in device order, which the load-balancing "
            "reorder breaks)",
        )

    # The trainer's LoRA (qwix) adds the adapter's output, in the adapter's weight_dtype, to the layer's
    # activations (dtype): under MaxText's layer scan, whose carry keeps one dtype, MaxText's default
    # weight_dtype float32 with bfloat16 activations fails the trainer's first step ("scan body function
    # carry input and carry output must have equal types"; rljob drill --compile, docs/drill.md).
    key = "weight_dtype"
    if (
        key not in keys
        and key in keyset
        and _truthy(effective_("scan_layers"))
        and str(effective_("dtype")) == "bfloat16"
        and str(effective_(key)) == "float32"
    ):
        out[key] = (
            "bfloat16",
            "MaxText's default weight_dtype float32 under bfloat16 activations (dtype) and scanned layers: "
            "the LoRA's float32 output changes the layer scan's carry dtype and the trainer's first step "
            "fails (the base weights are frozen: bfloat16 also halves them)",
        )
    return out


# The Splash attention blocks of the forward and of the dkv backward kernel (MaxText key names).
SPLASH_BLOCK_KEYS = (("sa_block_q", "sa_block_kv"), ("sa_block_q_dkv", "sa_block_kv_dkv"))


# Every Splash block the trainer's kernels split a row by, query blocks then key blocks (MaxText key names;
# MaxText 0.2.5 layers/attention_op.py clamps each to the row's length, and the kernel refuses a block
# that does not divide it: tokamax splash_attention_mask_info "q_block_size=... should divide q_seq_len").
SPLASH_ROW_BLOCKS = (
    ("sa_block_q", "sa_block_q_dkv", "sa_block_q_dq"),
    ("sa_block_kv", "sa_block_kv_compute", "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_kv_dq"),
)


def splash_blocks(keys: Mapping[str, Any], keyset: KeySet) -> dict[str, int]:
    """Each Splash block key of :data:`SPLASH_ROW_BLOCKS`: its final value (the keys', else MaxText's
    default, else 512)."""

    def get(k: str) -> Any:
        return keys[k] if k in keys else keyset.defaults.get(k)

    return {k: int(_number(get(k)) or 512) for names in SPLASH_ROW_BLOCKS for k in names}


def attention_tile_model(keys: Mapping[str, Any], keyset: KeySet, context: int) -> dict[str, Any]:
    """The tile model packing.padPosition 'balanced' lays rows out for: ``context_ranks`` (the mesh's
    context parallelism), ``kernel_blocks`` ((query, key) Splash blocks of the forward and dkv
    kernels, the final keys or MaxText's defaults) and ``dual_chunk_swap``
    (context_parallel_load_balance: each rank holds chunks r and 2cp-1-r, else contiguous chunks)."""

    sizes = splash_blocks(keys, keyset)
    blocks = tuple(tuple(sizes[k] for k in pair) for pair in SPLASH_BLOCK_KEYS)
    balance = keys.get("context_parallel_load_balance", keyset.defaults.get("context_parallel_load_balance"))
    return {
        "context_ranks": int(context),
        "kernel_blocks": blocks,
        "dual_chunk_swap": True if balance is None else _truthy(balance),
    }
