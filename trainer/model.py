"""The trainer's model: a MaxText NNX Transformer with a qwix LoRA on the attention and MLP projections.

The same code path runs a production MaxText model on TPU (keys from RunConfig.trainer.maxtext) and
the tiny float32 model every CPU test and the CPU sampler use (:func:`tiny_keys`). MaxText runs in its
decoupled mode (``DECOUPLE_GCLOUD=TRUE``: no Google Cloud services at import).

The model is split into a graph, the frozen base parameters and the trainable LoRA parameters; only
the LoRA parameters reach the optimizer. The forward pass returns the final hidden states (after the
final norm), never the ``[B, T, V]`` logits: MaxText's vocabulary-tiling mode (``num_vocab_tiling > 1``)
skips its output head and sows the hidden states, which :meth:`Policy.hidden_states` reads and then
drops (no sown intermediate leaves the function). The fused log-prob head
(:mod:`rljob.trainer.logprobs`) then applies :meth:`Policy.head_weight` tile by tile.

Packed rows carry per-token segment ids (0 = padding) and per-segment positions; MaxText's attention
masks by segment id and causality, and RoPE uses the positions, so a packed row computes what its
segments compute alone (tests/trainer/test_model.py checks it).

On the config's mesh (``ici_*``/``dcn_*`` keys) the base and LoRA parameters are placed as MaxText's
logical axis rules say, the forward pass is traced under those rules (MaxText's activation constraints
name logical axes; without the rules they would pin every activation replicated), and the fused head scores
each device's own tokens (rows and sequence split as the batch is) against vocabulary blocks of the head
that travel around the mesh (:func:`rljob.trainer.logprobs.sharded_token_logprobs`): no device holds
the whole ``[H, V]`` head or scores another device's tokens.

The head computes what MaxText's output head computes (:func:`head_transform`): an untied
``logits_dense`` kernel, or tied embedding logits (the table in bfloat16, divided by sqrt(emb_dim) under
``normalize_embedding_logits``, soft-capped by ``final_logits_soft_cap``: Gemma), in float32.

  spec = ModelSpec.tiny()                 # or rljob.trainer.main.model_setup(rc, ...)
  policy = Policy(spec)                   # builds MaxText + qwix LoRA; policy.lora0 is the initial adapter
  h = policy.hidden_states(lora, tokens, positions, segment_ids)     # [B, T, H]
  lp = policy.next_token_logprobs(lora, tokens, positions, segment_ids)  # [B, T], fused head

The adapter's PEFT layout (the Hugging Face tensor names vLLM and peft load, adapter_config.json, the
files) is :mod:`rljob.trainer.peft`'s :class:`~rljob.trainer.peft.PeftAdapter`, built with the policy
(``policy.peft``); the LoRA factors are created by :mod:`rljob.trainer.lora`, and arrays are put on the
mesh by :func:`rljob.trainer.placement.put_global`.

The frozen base weights come from ``spec.checkpoint`` (the RLJob's ``spec.model.checkpoint``, a converted
MaxText checkpoint, restored by :mod:`rljob.trainer.base_checkpoint` before qwix adds LoRA) or, without
one, from a random initialization by ``spec.seed`` (tests, the CPU loop). Either way they are created
sharded (:func:`build_model`: an abstract model, then the restore into its sharded target or a jit
initialization with the logical out_shardings), never whole on one device. A checkpoint that does not
fit raises :class:`CheckpointError` (``spec.model.checkpoint: ...``; the entrypoints exit 2).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from jax.sharding import NamedSharding
from rljob.recipes import lora_targets, maxtext_keys
from rljob.recipes.maxtext_keys import TRAINER_MIN_VOCAB_TILING
from rljob.trainer import logprobs as lp_head
from rljob.trainer.base_checkpoint import (
    CheckpointError,
    check_checkpoint_path,
    logical_shardings,
    restore_base_params,
)
from rljob.trainer.expert_lora import add_expert_lora
from rljob.trainer.lora import add_lora_params, lora_sharding_meta
from rljob.trainer.peft import HF_PROJ, PeftAdapter, decoder_block, hf_projection
from rljob.trainer.placement import put_global
from rljob.trainer.sync import align

__all__ = [
    "CPU_KEYS",
    "CheckpointError",
    "LoraState",
    "ModelSpec",
    "Policy",
    "abstract_model",
    "build_model",
    "head_transform",
    "maxtext_config",
    "tiny_keys",
]

LoraState = Any  # a nested dict of arrays (nnx.to_pure_dict of the LoRAParam state)

_HF_TO_MT = dict(lora_targets.HF_TO_MAXTEXT)
DEFAULT_TARGETS = tuple(HF_PROJ)


def tiny_keys(**overrides: Any) -> dict[str, Any]:
    """MaxText keys of the tiny float32 qwen3-architecture model the CPU tests and the CPU sampler use.

    Two scanned layers, 64-wide, vocabulary 256: a forward pass compiles and runs in seconds on CPU.
    bf16 with scanned layers hits a carry dtype mismatch under qwix, hence float32 throughout.
    """
    keys: dict[str, Any] = {
        "model_name": "default",
        "decoder_block": "qwen3",
        "base_emb_dim": 64,
        "base_num_query_heads": 4,
        "base_num_kv_heads": 2,
        "head_dim": 16,
        "base_mlp_dim": 128,
        "base_num_decoder_layers": 2,
        "vocab_size": 256,
        "mlp_activations": ["silu", "linear"],
        "use_qk_norm": True,
        "logits_via_embedding": False,
        "normalization_layer_epsilon": 1e-6,
        "rope_max_timescale": 10000,
        "max_target_length": 128,
        **CPU_KEYS,
    }
    keys.update(overrides)
    return keys


# Keys the trainer always sets: the hidden-state-returning head, no MaxText-side I/O or jax.distributed.
_RUNTIME_KEYS: dict[str, Any] = {
    "enable_checkpointing": False,
    "skip_jax_distributed_system": True,
    "enable_dropout": False,
    # > 1: MaxText skips its output head in train mode and sows the hidden states instead.
    "num_vocab_tiling": TRAINER_MIN_VOCAB_TILING,
}

# Keys of the tiny CPU model on top (tiny_keys() includes them): float32 numerics (qwix LoRA with
# bf16 scanned layers hits a carry dtype mismatch), plain dot-product attention, no output directory.
CPU_KEYS: dict[str, Any] = {
    "run_name": "rljob",
    "per_device_batch_size": 1,
    "dtype": "float32",
    "weight_dtype": "float32",
    "matmul_precision": "highest",
    "attention": "dot_product",
    "scan_layers": True,
    "base_output_directory": "",
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What to build: MaxText keys, the adapter, the base weights: the converted MaxText checkpoint at
    ``checkpoint`` (gs:// or local; ``spec.model.checkpoint``) or, without one, a random initialization
    from ``seed``."""

    maxtext: Mapping[str, Any]
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS
    seed: int = 0
    checkpoint: str | None = None
    base_model: str = "rljob/tiny-qwen3"
    # PEFT name prefix of the Hugging Face decoder layers; None: the decoder block's
    # (rljob.trainer.peft.HF_LAYERS_PREFIX).
    hf_layers_prefix: str | None = None
    # spec.trainer.maxtextVersion: the MaxText key table the model's effective keys are read from.
    maxtext_version: str = maxtext_keys.DEFAULT_VERSION

    @classmethod
    def tiny(cls, **kw: Any) -> ModelSpec:
        return cls(maxtext=tiny_keys(), **kw)

    def __post_init__(self) -> None:
        # The plan makes the same checks (rljob.recipes.lora_targets): rljob validate refuses the same.
        for field, message in lora_targets.problems(self.decoder_block, self.lora_targets):
            raise ValueError(f"{field}: {message}")
        for field, message in lora_targets.mla_problems(
            self.decoder_block, self.lora_targets, self.q_lora_rank, self.maxtext.get("use_sliced_mla_proj")
        ):
            raise ValueError(f"{field}: {message}")
        if self.lora_rank <= 0:
            raise ValueError(f"spec.lora.rank: must be > 0, got {self.lora_rank}")

    @property
    def decoder_block(self) -> str:
        """The model's decoder block: the ``decoder_block`` key, else the model config's (MaxText's
        key list), else MaxText's default."""
        get = maxtext_keys.effective(self.maxtext, maxtext_keys.load(self.maxtext_version))
        return str(get("decoder_block") or "").lower()

    @property
    def q_lora_rank(self) -> int:
        """MaxText's ``q_lora_rank`` of the model (DeepSeek's MLA query latent; 0: none): the key, else
        the model config's, else MaxText's default."""
        get = maxtext_keys.effective(self.maxtext, maxtext_keys.load(self.maxtext_version))
        return int(get("q_lora_rank") or 0)

    @property
    def maxtext_targets(self) -> tuple[str, ...]:
        return tuple(sorted({_HF_TO_MT.get(t, t) for t in self.lora_targets}))


def maxtext_config(keys: Mapping[str, Any]) -> Any:
    """A MaxText HyperParameters from ``keys`` plus the trainer's runtime keys (which win; a larger
    ``num_vocab_tiling`` in ``keys`` is kept)."""
    import maxtext
    from maxtext.configs import pyconfig

    base = str(Path(maxtext.__file__).parent / "configs" / "base.yml")
    merged = {**dict(keys), **_RUNTIME_KEYS}
    merged["num_vocab_tiling"] = max(int(keys.get("num_vocab_tiling", 1)), TRAINER_MIN_VOCAB_TILING)
    return pyconfig.initialize(["", base], **merged)


def head_transform(cfg: Any) -> lp_head.LogitTransform:
    """The logit transform of MaxText's output head for ``cfg`` (``NNXDecoder.apply_output_head`` in
    MaxText 0.2.5): with tied embedding logits (``logits_via_embedding``), the raw logits divided by
    sqrt(emb_dim) when ``normalize_embedding_logits`` (MaxText's checkpoints store those tables scaled by
    sqrt(emb_dim)), then ``tanh(z / cap) * cap`` when ``final_logits_soft_cap`` is set; an untied
    ``logits_dense`` head is used as is (MaxText applies neither there)."""
    if not cfg.logits_via_embedding:
        return lp_head.LogitTransform()
    # MaxText divides by jnp.sqrt(emb_dim): the float32 square root.
    divisor = float(np.sqrt(np.float32(cfg.emb_dim))) if cfg.normalize_embedding_logits else 1.0
    return lp_head.LogitTransform(divisor=divisor, soft_cap=float(cfg.final_logits_soft_cap or 0.0))


def _create_fn(cfg: Any, mesh: Any, seed: int) -> Any:
    """The zero-argument constructor of the MaxText NNX Transformer for ``cfg`` on ``mesh``, its random
    initialization drawn from ``seed`` (only ever called abstractly or inside a jit)."""
    from maxtext.models import models

    def create() -> Any:
        rngs = nnx.Rngs(params=seed, dropout=seed + 1, aqt=seed + 2)
        return models.Transformer(cfg, mesh, quant=None, rngs=rngs, model_mode="train")

    return create


def abstract_model(cfg: Any, seed: int = 0) -> tuple[Any, Any, Any]:
    """(graphdef, abstract state, shardings) of the MaxText NNX Transformer for ``cfg``: the state's leaves
    are ShapeDtypeStructs carrying MaxText's logical-axis NamedSharding on the config's mesh
    (:func:`rljob.trainer.base_checkpoint.logical_shardings`), ``shardings`` the same tree of
    NamedShardings. Nothing is allocated: the constructor runs under ``nnx.eval_shape``, as in MaxText's
    ``model_creation_utils.create_nnx_abstract_model``."""
    from maxtext.utils import maxtext_utils

    mesh = maxtext_utils.get_mesh_from_config(cfg)
    with nn.logical_axis_rules(cfg.logical_axis_rules):
        abstract = nnx.eval_shape(_create_fn(cfg, mesh, seed))
    graphdef, state = nnx.split(abstract)
    shardings = logical_shardings(state, cfg, mesh)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),  # type: ignore[no-untyped-call]
        state,
        shardings,
    )
    return graphdef, state, shardings


def build_model(cfg: Any, seed: int = 0, checkpoint: str | None = None) -> Any:
    """The MaxText NNX Transformer for ``cfg``, every array created already laid out by MaxText's logical
    axis rules on the config's mesh (each device only ever holds its own shards), as MaxText's
    ``from_pretrained`` builds it: the model is traced abstractly (:func:`abstract_model`), then

    - without ``checkpoint``: the whole state is initialized from ``seed`` inside one jit whose
      out_shardings are the logical shardings (the same values as an eager initialization: the PRNG is
      partitionable);
    - with ``checkpoint`` (a converted MaxText checkpoint, ``spec.model.checkpoint``): the weights
      (:func:`base_weight_variables`) are restored straight into the sharded abstract target
      (:func:`rljob.trainer.base_checkpoint.restore_base_params`; no random weights are ever computed),
      and only the small non-weight state (the modules' RNG streams) comes from the jit, whose
      weight initializers XLA then drops as dead code.
    """
    from maxtext.utils import maxtext_utils

    mesh = maxtext_utils.get_mesh_from_config(cfg)
    graphdef, abstract, shardings = abstract_model(cfg, seed)
    create = _create_fn(cfg, mesh, seed)
    weights = base_weight_variables()
    keep: Any = nnx.Not(weights) if checkpoint else ...
    out_shardings = shardings.filter(keep)

    @partial(jax.jit, out_shardings=out_shardings)
    def init() -> Any:
        with nn.logical_axis_rules(cfg.logical_axis_rules):
            state = nnx.state(create(), keep)
        return jax.lax.with_sharding_constraint(state, out_shardings)  # type: ignore[no-untyped-call]

    state = init()
    if not checkpoint:
        return nnx.merge(graphdef, state)
    params = restore_base_params(checkpoint, abstract.filter(weights), cfg)
    return nnx.merge(graphdef, params, state)


def base_weight_variables() -> Any:
    """The NNX filter of the variables a converted checkpoint holds: every nnx.Param, and the routing
    bias MaxText keeps in a variable collection of its own (MaxText 0.2.5 layers/moe.py: DeepSeek-V3's
    gate bias, the Hugging Face ``e_score_correction_bias``, is a ``MoEBiasVar``, which its conversion
    writes and its own DeepSeek code reads with the params: ``nnx.state(self, (nnx.Param,
    moe.MoEBiasVar))`` in models/deepseek.py). Restored with the params, it is frozen with them: qwix's
    LoRA and the optimizer see only nnx.LoRAParam."""
    from maxtext.layers import moe

    return nnx.Any(nnx.Param, moe.MoEBiasVar)


def _sample_inputs(t: int = 8) -> tuple[jax.Array, jax.Array, jax.Array]:
    toks = jnp.ones((1, t), jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    return toks, pos, jnp.ones((1, t), jnp.int32)


def lora_module_path(spec: ModelSpec) -> str:
    """qwix's module-path regex for ``spec``'s LoRA targets but the routed experts (those get factors
    of their own, rljob.trainer.expert_lora)."""
    modules = [t for t in spec.maxtext_targets if t != lora_targets.EXPERTS]
    return rf".*/({'|'.join(modules)})"


def _with_lora(model: Any, spec: ModelSpec, cfg: Any) -> Any:
    """``model`` wrapped by qwix's LoRA on ``spec``'s targets, every factor created first; the routed
    experts (target ``experts``) get per-expert factors of their own (rljob.trainer.expert_lora)."""
    module_path = lora_module_path(spec)
    provider = qwix.LoraProvider(
        module_path=module_path,
        rank=spec.lora_rank,
        alpha=spec.lora_alpha,
    )
    toks, pos, seg = _sample_inputs()
    # Every LoRA factor exists before qwix wraps the model (add_lora_params), so qwix's first call, whose
    # only work is to create them, is skipped (skip_nnx_init): that call runs the model eagerly, op by
    # op (MaxText's layer scan, then one jnp.moveaxis per scanned variable), each a program of its own
    # over the whole mesh, hundreds of compiles on every process before the first step. Creating the
    # factors here also keeps them out of a scan: MaxText 0.2.5's Gemma 4 block runs its global layer
    # inside a jax.lax.scan whose carry is that layer's state (Gemma4ScannableBlock._scan_global_layer),
    # where a parameter created during the call changes the carry's structure, and its local-layer scan
    # returns the shared qwix_rngs stacked, which qwix then cannot draw from.
    add_lora_params(model, module_path, spec.lora_rank, spec.seed + 1000, cfg)
    if lora_targets.EXPERTS in spec.maxtext_targets and not add_expert_lora(
        model, spec.lora_rank, spec.lora_alpha, spec.seed + 2000, cfg
    ):
        raise ValueError(
            f"spec.lora.targets: experts: the {decoder_block(cfg)} decoder has no routed experts"
        )
    return qwix.apply_lora_to_model(
        model,
        provider,
        toks,
        pos,
        decoder_segment_ids=seg,
        enable_dropout=False,
        rngs=nnx.Rngs(spec.seed + 1000),
        skip_nnx_init=True,
    )


def _abstract(x: Any, sharding: NamedSharding) -> Any:
    """A ShapeDtypeStruct of ``x`` laid out by ``sharding`` (an abstract policy's 'array')."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # type: ignore[no-untyped-call]


class Policy:
    """The model split into graph, frozen base parameters and trainable LoRA parameters.

    Pure functions of ``lora`` (the trainable state) so they jit, grad and checkpoint as pytrees.

    ``devices`` (the compile stage, rljob.trainer.compilecheck): the policy is built abstractly over
    these devices (e.g. a TPU topology's compile-only devices, ``jax.experimental.topologies``): the same
    model, LoRA and shardings, every parameter a ShapeDtypeStruct with its NamedSharding, nothing
    allocated or initialized. Its functions and the Trainer's then lower and compile for those devices.
    """

    def __init__(self, spec: ModelSpec, devices: Any = None) -> None:
        self.spec = spec
        self.cfg = maxtext_config(spec.maxtext)
        self.abstract = devices is not None
        # The map from raw logits (hidden @ head_weight) to the model's logits, as MaxText's output head
        # applies it (NNXDecoder.apply_output_head): only on tied embedding logits, divided by
        # sqrt(emb_dim) under normalize_embedding_logits, then soft-capped by final_logits_soft_cap.
        self.logit_transform = head_transform(self.cfg)
        if self.abstract:
            from maxtext.utils import maxtext_utils

            mesh = maxtext_utils.get_mesh_from_config(self.cfg, devices)

            def create() -> Any:
                with nn.logical_axis_rules(self.cfg.logical_axis_rules):
                    model = _create_fn(self.cfg, mesh, spec.seed)()
                return _with_lora(model, spec, self.cfg)

            lora_model = nnx.eval_shape(create)
            place: Any = _abstract
        else:
            if spec.checkpoint:
                check_checkpoint_path(spec.checkpoint)  # a missing path fails before the model is built
            # Built sharded: base weights restored from the checkpoint or initialized on their devices.
            model = build_model(self.cfg, spec.seed, spec.checkpoint)
            mesh = model.mesh
            lora_model = _with_lora(model, spec, self.cfg)
            place = put_global
        nnx.pop(lora_model, nnx.Intermediate)
        parts: Any = nnx.split(lora_model, nnx.LoRAParam, ...)
        self.graphdef: Any = parts[0]
        # Every array lives on the config's mesh, laid out by MaxText's logical axis rules (build_model's
        # come so; put_global returns them as they are).
        self.mesh: Any = mesh
        # MaxText's load-balanced context parallelism (context_parallel_load_balance, its default, with a
        # context axis over 1) takes the batch in DUAL_CHUNK_SWAP order: each context rank holds chunks r
        # and 2cp-1-r of a row, and Splash's LoadBalanced masks bake that order in (MaxText's input pipeline
        # reorders; max_utils.reordered_cp_size). hidden_states reorders its rows so, and its result back.
        from maxtext.utils import max_utils

        self.reorder_cp = int(max_utils.reordered_cp_size(self.cfg, mesh))
        if not self.abstract:
            # Each process compiled the initialization in its own time: meet before the first
            # cross-process transfer (rljob.trainer.sync).
            align("rljob-policy-base")
        self.base: Any = jax.tree.map(place, parts[2], logical_shardings(parts[2], self.cfg, self.mesh))
        lora0 = parts[1]
        self._lora_template = jax.tree.map(
            lora_sharding_meta, lora0, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        # The trainable state is a plain nested dict of arrays (optax and orbax see ordinary pytrees).
        self.lora_sharding: dict[str, Any] = nnx.to_pure_dict(
            logical_shardings(self._lora_template, self.cfg, self.mesh)
        )
        self.lora0: dict[str, Any] = jax.tree.map(
            place, nnx.to_pure_dict(self._lora_template), self.lora_sharding
        )
        self.num_layers = int(self.cfg.num_decoder_layers)
        self.vocab_size = int(self.cfg.vocab_size)
        self.hidden_size = int(self.cfg.emb_dim)
        # The adapter's PEFT layout (rljob.trainer.peft): ValueError on a layout the export does not know,
        # or (below) a target that wraps no projection of this model.
        self.peft = PeftAdapter(spec, self.lora0, self.cfg)
        wrapped = {lora_targets.EXPERTS if leaf.experts else leaf.module for leaf in self.peft.layout}
        missing = sorted(set(spec.maxtext_targets) - wrapped)
        if missing:
            names = ", ".join(hf_projection(m) for m in missing)
            raise ValueError(
                f"spec.lora.targets: {names} wrap(s) no projection of the {decoder_block(self.cfg)} decoder "
                f"({self.cfg.model_name})"
            )

    # ------------------------------------------------------------------ forward

    def hidden_states(
        self,
        lora: LoraState,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        base: Any = None,
    ) -> jax.Array:
        """[B, T, H] final hidden states (after the final norm) of packed rows.

        ``base``: the frozen parameters (default ``self.base``); pass them as a jit argument so they
        are not baked into the compiled program as constants."""
        # Fresh variables of the current trace (a pytree round trip): the state's own nnx.Variable objects
        # belong to the trace they were made in (e.g. self.base: the top level, when a jitted caller closes
        # over it), and a module that writes its state back during the call (MaxText 0.2.5's Gemma 3
        # remainder layers: NNXDecoder._apply_gemma3_scanned_blocks nnx.update(self.layers_remainder, ...))
        # may only mutate variables of the trace it runs in (flax nnx TraceContextError otherwise).
        lora_state, base_state = jax.tree.map(
            lambda x: x, (self.as_state(lora), self.base if base is None else base)
        )
        cp = self.reorder_cp
        if cp > 1:  # the load-balanced order MaxText's attention expects (see __init__)
            from maxtext.utils.max_utils import reorder_sequence

            tokens, positions, segment_ids = (
                reorder_sequence(x, cp) for x in (tokens, positions, segment_ids)
            )
        model = nnx.merge(self.graphdef, lora_state, base_state)
        # MaxText's activation sharding constraints name logical axes; only under the config's rules do
        # they map onto the mesh (without them every constraint says "replicated": each device would
        # compute every row). MaxText's trainers trace under the same rules.
        with nn.logical_axis_rules(self.cfg.logical_axis_rules):
            logits = model(tokens, positions, decoder_segment_ids=segment_ids, enable_dropout=False)
        assert logits is None, "num_vocab_tiling > 1 must skip MaxText's output head"
        sown: Any = nnx.pop(model, nnx.Intermediate)  # discard every sown intermediate
        y = sown["decoder"]["hidden_states"].get_value()[0]
        h: jax.Array = model.decoder.decoder_norm(y)
        if cp > 1:
            h = reorder_sequence(h, cp, to_contiguous=True)  # back to the rows' own order
        return h

    def as_state(self, lora: LoraState) -> Any:
        """An nnx.State of LoRAParam variables from a pure dict (or the State itself)."""
        if isinstance(lora, nnx.State):
            return lora
        state = jax.tree.map(lambda x: x, self._lora_template, is_leaf=lambda x: isinstance(x, nnx.Variable))
        nnx.replace_by_pure_dict(state, lora)
        return state

    def head_weight(self, lora: LoraState, base: Any = None) -> jax.Array:
        """[H, V] output head (frozen): the raw logits are ``hidden_states @ head_weight``, the model's
        logits ``self.logit_transform`` of them. Tied embeddings (``logits_via_embedding``) are read as
        MaxText's ``attend_on_embedding`` reads them: the table cast to bfloat16, transposed."""
        base = self.base if base is None else base
        if self.cfg.logits_via_embedding:
            table = base["token_embedder"]["embedding"].get_value()
            return jnp.asarray(table, jnp.bfloat16).T
        return base["decoder"]["logits_dense"]["kernel"].get_value()  # type: ignore[no-any-return]

    def head_axes(self, rows: int, tokens: int) -> tuple[Any, Any, tuple[str, ...]]:
        """(row axes, token axes, vocab axes) of the log-prob head for ``[rows, tokens]`` batches: tokens
        split as :meth:`batch_axes` splits the batch, the vocabulary over every other mesh axis of size
        > 1 (where the tokens are replicated), so every device scores a different share."""
        r, t = self.batch_axes(rows, tokens)
        used = set(r or ()) | set(t or ())
        vocab = tuple(a for a, n in self.mesh.shape.items() if n > 1 and a not in used)
        return r, t, vocab

    def head_operand(self, lora: LoraState, rows: int, tokens: int, base: Any = None) -> jax.Array:
        """The head weight as the log-prob head takes it for ``[rows, tokens]`` batches: on one device as
        is; on a mesh, the vocabulary padded to a multiple of the device count and its columns split over
        every device (:func:`rljob.trainer.logprobs.head_spec`: vocab axes, then the axes of the batch), so
        no device holds the whole ``[H, V]`` head. Compute it once outside a loop over micro-batches."""
        w = self.head_weight(lora, base)
        if self.mesh.size == 1:
            return w
        r, t, vocab = self.head_axes(rows, tokens)
        vp = lp_head.padded_vocab(self.vocab_size, self.mesh.size)
        if vp > w.shape[1]:
            w = jnp.pad(w, ((0, 0), (0, vp - w.shape[1])))
        spec = lp_head.head_spec(vocab + tuple(r or ()) + tuple(t or ()))
        out: jax.Array = jax.lax.with_sharding_constraint(w, NamedSharding(self.mesh, spec))  # type: ignore[no-untyped-call]
        return out

    def next_token_logprobs(
        self,
        lora: LoraState,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        token_tile: int = lp_head.DEFAULT_TOKEN_TILE,
        vocab_chunk: int = lp_head.DEFAULT_VOCAB_CHUNK,
        temperature: float = 1.0,
        base: Any = None,
        head: jax.Array | None = None,
    ) -> jax.Array:
        """[B, T]: entry i is log p(tokens[i] | its segment's prefix); 0 on segment starts and padding.

        The fused head: no ``[B, T, V]`` array is ever formed. On a mesh each device scores its own tokens
        (rows and sequence split as the batch is) against the vocabulary blocks of
        :meth:`head_operand` (``head``: that operand, computed once by the caller; else here).
        ``temperature`` divides the model's logits (after the soft cap), as the sampler's does."""
        h = self.hidden_states(lora, tokens, positions, segment_ids, base)
        tf = dataclasses.replace(self.logit_transform, temperature=float(temperature))
        b, t = tokens.shape
        if head is None:
            head = self.head_operand(lora, b, t, base)
        if self.mesh.size == 1:
            return lp_head.next_token_logprobs(
                h,
                head,
                tokens,
                segment_ids,
                token_tile=token_tile,
                vocab_chunk=vocab_chunk,
                temperature=tf.temperature,
                soft_cap=tf.soft_cap,
                divisor=tf.divisor,
                grad_w=False,
            )
        r, toks, vocab = self.head_axes(b, t)
        sharded = lp_head.sharded_token_logprobs(
            self.mesh,
            (r, toks),
            vocab,
            self.vocab_size,
            token_tile=token_tile,
            vocab_chunk=vocab_chunk,
            transform=tf,
        )
        targets, valid = lp_head.next_token_targets(tokens, segment_ids)
        return lp_head.shift_to_tokens(sharded(h, head, targets, valid))

    def scoring_program(self) -> Any:
        """The jitted ``(base, lora, tokens, positions, segment_ids) -> [B, T]`` next-token log-probs: the
        step-0 parity gate's program (rljob.trainer.loop scores the sampler's tokens with it; the compile
        stage compiles it). The base weights are an argument, not a constant: with several processes they
        span devices this process cannot address, which a jitted function may take but not close over."""

        def parity_logprobs(base: Any, lora: LoraState, t: Any, p: Any, s: Any) -> Any:
            # Named, so that JAX's cache and compile logs name it (``jit_parity_logprobs``).
            return self.next_token_logprobs(lora, t, p, s, base=base)

        return jax.jit(parity_logprobs)

    def zero_lora(self, lora: LoraState) -> LoraState:
        """The adapter switched off: every LoRA factor 0, so each wrapped projection computes exactly
        its base weight's output (the reference policy of the KL penalty)."""
        return jax.tree.map(jnp.zeros_like, lora)

    def batch_axes(self, rows: int, tokens: int) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
        """Mesh axes that split ``rows`` packed rows of ``tokens`` tokens: MaxText's input data sharding
        (``input_data_sharding_logical_axes``: rows over the batch axes, data and fsdp among them; tokens
        over the sequence axes) without the axes of size 1, and without an axis whose size does not divide
        what is left to split (the rows are then whole on it). None: not split."""
        from maxtext.utils import sharding

        spec = tuple(sharding.get_input_data_sharding(self.cfg, self.mesh).spec)
        spec = (spec[1:] if self.cfg.enable_diloco else spec) + (None, None)

        def fit(entry: Any, size: int) -> tuple[str, ...] | None:
            kept: list[str] = []
            for a in (entry,) if isinstance(entry, str) else tuple(entry or ()):
                n = int(self.mesh.shape[a])
                if n > 1 and size % n == 0:
                    kept.append(a)
                    size //= n
            return tuple(kept) or None

        return fit(spec[0], rows), fit(spec[1], tokens)

    def row_multiple(self) -> int:
        """What the rows of a batch are rounded up to so that every mesh axis of MaxText's input data
        sharding of the rows (data, fsdp, expert, ... of size > 1) divides them: the product of those axes'
        sizes. The step-0 parity gate pads its rows to it; a train step's micro-batch rows usually are a
        multiple already, and the gate then scores the train step's own shape."""
        from maxtext.utils import sharding

        spec = tuple(sharding.get_input_data_sharding(self.cfg, self.mesh).spec)
        spec = spec[1:] if self.cfg.enable_diloco else spec
        entry = spec[0] if spec else None
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        return math.prod(int(self.mesh.shape[a]) for a in axes)

    @partial(jax.jit, static_argnums=0)
    def logits(
        self, lora: LoraState, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        """[B, T, V] float32 logits (for sampling and tests only; training never forms them): the raw
        logits in float32, then the model's logit transform (tied-embedding scaling, soft cap)."""
        h = self.hidden_states(lora, tokens, positions, segment_ids)
        raw = jnp.dot(h, self.head_weight(lora), preferred_element_type=jnp.float32)
        return self.logit_transform(raw)
