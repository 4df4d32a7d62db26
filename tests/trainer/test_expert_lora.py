"""LoRA on the routed experts (the target ``experts``, rljob.trainer.expert_lora) of the Qwen3 MoE and
Mixtral miniatures (rljob.recipes.miniature: 16 experts top-8 and 8 experts top-2, two scanned layers;
MaxText's sparse megablox path, which the CPU interprets, and for Qwen3 MoE its dense einsum path too):
per-expert factors change the routed experts' output, zeroing them restores the base model exactly, and
every factor gets a gradient; they export to PEFT per layer and expert under the checkpoint's names
(Qwen3MoeForCausalLM ``mlp.experts.{j}.gate_proj``, MixtralForCausalLM ``block_sparse_moe.experts.{j}.w1``);
and the adapter, merged into the Hugging Face
weights as peft merges a LoRA (W + alpha/r * B @ A) and converted back by MaxText's own checkpoint
conversion (checkpoint_conversion/utils/param_mapping.py, the mapping to_maxtext uses), gives the logits
the trainer computes. An exporter that writes an expert's tensors under another expert's index, or the
gate's under the up projection's, fails that round trip.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rljob.recipes import lora_targets, miniature
from rljob.trainer.model import CPU_KEYS, ModelSpec, Policy

pytestmark = pytest.mark.jax

MODEL = "qwen3-30b-a3b"
# model -> (MaxText's MoE module in a layer, the experts' Hugging Face parent, gate/up/down names)
MODELS: dict[str, tuple[str, str, tuple[str, str, str]]] = {
    "qwen3-30b-a3b": ("moe_block", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral-8x7b": ("MoeBlock_0", "block_sparse_moe.experts", ("w1", "w3", "w2")),
}
RANK, ALPHA = 4, 8.0
_POLICIES: dict[str, Policy] = {}


def _policy(model: str = MODEL) -> Policy:
    if model not in _POLICIES:
        keys = {
            "model_name": model,
            **miniature.miniature_overrides(model),
            **CPU_KEYS,
            "max_target_length": 32,
        }
        targets = (*lora_targets.ATTENTION, lora_targets.EXPERTS)
        _POLICIES[model] = Policy(
            ModelSpec(maxtext=keys, lora_rank=RANK, lora_alpha=ALPHA, lora_targets=targets)
        )
    return _POLICIES[model]


def _is_expert(path: Any) -> bool:
    return str(getattr(path[-1], "key", path[-1])).split("_lora_")[0] in ("wi_0", "wi_1", "wo")


def _experts_random(lora: Any, seed: int, scale: float = 0.1) -> Any:
    """``lora`` with every expert factor drawn at random (attention factors as they are)."""
    flat, tree = jax.tree_util.tree_flatten_with_path(lora)
    keys = jax.random.split(jax.random.key(seed), len(flat))
    out = [
        scale * jax.random.normal(k, x.shape, x.dtype) if _is_expert(p) else x
        for k, (p, x) in zip(keys, flat, strict=True)
    ]
    return jax.tree_util.tree_unflatten(tree, out)


def _inputs(policy: Policy, t: int = 16) -> tuple[jax.Array, jax.Array, jax.Array]:
    toks = jnp.asarray(np.random.default_rng(0).integers(1, policy.vocab_size, (2, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
    return toks, pos, jnp.ones((2, t), jnp.int32)


@pytest.mark.parametrize("model", MODELS)
def test_the_expert_factors_are_per_expert_and_stacked_on_the_layer_axis(model: str) -> None:
    policy = _policy(model)
    cfg = policy.cfg
    e, h, m, n = int(cfg.num_experts), int(cfg.emb_dim), int(cfg.moe_mlp_dim), policy.num_layers
    moe = policy.lora0["decoder"]["layers"][MODELS[model][0]]
    want = {
        "wi_0_lora_a": (e, n, h, RANK),
        "wi_0_lora_b": (e, n, RANK, m),
        "wi_1_lora_a": (e, n, h, RANK),
        "wi_1_lora_b": (e, n, RANK, m),
        "wo_lora_a": (e, n, m, RANK),
        "wo_lora_b": (e, n, RANK, h),
    }
    assert {k: tuple(v.shape) for k, v in moe.items()} == want
    # B starts at zero (the adapter starts as the base model), A does not
    assert all(not np.any(np.asarray(moe[k])) for k in want if k.endswith("_b"))
    assert all(np.any(np.asarray(moe[k])) for k in want if k.endswith("_a"))
    # laid out as the expert weights: the experts' axis keeps the weights' logical axis name (MaxText's
    # ``exp``, on the ``expert`` mesh axis), the layer axis its name, the matrix axes replicated
    weight = policy.base["decoder"]["layers"][MODELS[model][0]]["wi_0"].get_metadata()["out_sharding"]
    state = policy.as_state(policy.lora0)["decoder"]["layers"][MODELS[model][0]]
    for k in want:
        assert state[k].get_metadata()["out_sharding"] == (weight[0], "layers", None, None), k
    assert weight[0] == "exp"


@pytest.mark.parametrize("model", MODELS)
def test_expert_factors_change_the_routed_experts_and_zeroing_them_restores_the_base(model: str) -> None:
    policy = _policy(model)
    toks, pos, seg = _inputs(policy)
    base = np.asarray(policy.logits(policy.zero_lora(policy.lora0), toks, pos, seg))
    lora = _experts_random(policy.zero_lora(policy.lora0), seed=1)
    got = np.asarray(policy.logits(lora, toks, pos, seg))
    assert np.max(np.abs(got - base)) > 1e-2, "the expert adapter did not change the logits"
    # only the expert B factors zeroed (A left random): exactly the base model
    flat, tree = jax.tree_util.tree_flatten_with_path(lora)
    zero_b = [jnp.zeros_like(x) if _is_expert(p) and str(p[-1].key).endswith("_b") else x for p, x in flat]
    back = np.asarray(policy.logits(jax.tree_util.tree_unflatten(tree, zero_b), toks, pos, seg))
    np.testing.assert_array_equal(back, base)

    # every expert factor is trained: the gradient of the logits reaches each one
    weights = jax.random.normal(jax.random.key(2), got.shape)
    grads = jax.grad(lambda lo: jnp.sum(policy.logits(lo, toks, pos, seg) * weights))(lora)
    dead = [
        jax.tree_util.keystr(p)
        for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]
        if _is_expert(p) and not jnp.any(g != 0)
    ]
    assert not dead, f"expert LoRA leaves without gradient: {dead}"


def _hf_names(model: str, policy: Policy) -> dict[str, tuple[int, int]]:
    """PEFT tensor name -> shape of the expert adapter with the miniature's sizes (transformers 4.x
    Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock: experts.{j} a module of gate, up, down Linear)."""
    cfg = policy.cfg
    h, m = int(cfg.emb_dim), int(cfg.moe_mlp_dim)
    _, parent, (gate, up, down) = MODELS[model]
    out: dict[str, tuple[int, int]] = {}
    for i in range(policy.num_layers):
        for j in range(int(cfg.num_experts)):
            for proj, (o, n_in) in {gate: (m, h), up: (m, h), down: (h, m)}.items():
                name = f"base_model.model.model.layers.{i}.{parent}.{j}.{proj}"
                out[f"{name}.lora_A.weight"] = (RANK, n_in)
                out[f"{name}.lora_B.weight"] = (o, RANK)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_the_expert_adapter_exports_per_expert_under_hugging_faces_names_and_back(model: str) -> None:
    policy = _policy(model)
    module, parent, projections = MODELS[model]
    lora = _experts_random(policy.lora0, seed=3)
    tensors = policy.peft.to_peft(lora)
    experts = {k: v.shape for k, v in tensors.items() if ".experts." in k}
    assert experts == _hf_names(model, policy)
    assert policy.peft.config()["target_modules"] == sorted([*lora_targets.ATTENTION, *projections])
    back = policy.peft.from_peft(tensors)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(lora), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # expert j of layer i is the [j, i] slice of the stacked factor, transposed
    a = np.asarray(lora["decoder"]["layers"][module]["wo_lora_a"])
    np.testing.assert_array_equal(
        tensors[f"base_model.model.model.layers.1.{parent}.5.{projections[2]}.lora_A.weight"], a[5, 1].T
    )


def _merged_by_hugging_face(model: str, policy: Policy, tensors: dict[str, np.ndarray]) -> Any:
    """The base weights with the PEFT adapter ``tensors`` merged as peft merges a LoRA into a Linear
    (W + lora_alpha / r * B @ A) on the Hugging Face side: MaxText's stacked expert weights to Hugging
    Face's per-expert weights and back by MaxText's own conversion (PARAM_MAPPING names, HOOK_FNS
    transposes: QWEN_MAXTEXT_TO_HF_*, MIXTRAL_MAXTEXT_TO_HF_*)."""
    from maxtext.checkpoint_conversion.utils import param_mapping

    cfg = policy.cfg
    hf_config = {
        "num_hidden_layers": policy.num_layers,
        "num_experts": int(cfg.num_experts),
        "hidden_size": int(cfg.emb_dim),
        "head_dim": int(cfg.head_dim),
    }
    names = param_mapping.PARAM_MAPPING[model](hf_config, cfg, scan_layers=True)
    to_hf = dict(param_mapping.HOOK_FNS[model](hf_config, cfg, scan_layers=True, saving_to_hf=True))
    to_mt = dict(param_mapping.HOOK_FNS[model](hf_config, cfg, scan_layers=True, saving_to_hf=False))
    scale = policy.peft.config()["lora_alpha"] / policy.peft.config()["r"]
    base = jax.tree.map(lambda x: x, policy.base)
    module = MODELS[model][0]
    moe = base["decoder"]["layers"][module]
    for w in ("wi_0", "wi_1", "wo"):
        key = f"params-decoder-layers-{module}-{w}"
        stacked = np.asarray(moe[w].get_value(), np.float64)  # [experts, layers, in, out]
        out = np.empty_like(stacked)
        for e, per_layer in enumerate(names[key]):
            for layer, hf_name in enumerate(per_layer):
                weight = to_hf[key](stacked[e, layer], None)  # Hugging Face (out, in)
                peft = "base_model.model." + hf_name.removesuffix(".weight")
                a = tensors[f"{peft}.lora_A.weight"].astype(np.float64)
                b = tensors[f"{peft}.lora_B.weight"].astype(np.float64)
                out[e, layer] = to_mt[key](weight + scale * b @ a, None)
        moe[w].set_value(jnp.asarray(out, moe[w].get_value().dtype))
    return base


@pytest.mark.parametrize("model", MODELS)
def test_the_exported_adapter_merged_on_the_hugging_face_side_gives_the_trainers_logits(model: str) -> None:
    policy = _policy(model)
    toks, pos, seg = _inputs(policy)
    lora = _experts_random(policy.zero_lora(policy.lora0), seed=4)
    tensors = policy.peft.to_peft(lora)
    want = np.asarray(policy.logits(lora, toks, pos, seg))
    zero = policy.zero_lora(policy.lora0)
    base = np.asarray(policy.logits(zero, toks, pos, seg))

    def merged_logits(t: dict[str, np.ndarray]) -> np.ndarray:
        merged = _merged_by_hugging_face(model, policy, t)
        return np.asarray(jax.jit(policy.next_token_logprobs)(zero, toks, pos, seg, base=merged))

    # compared as next-token log-probs (the trainer's own head; base weights as an argument)
    want_lp = np.asarray(jax.jit(policy.next_token_logprobs)(lora, toks, pos, seg))
    got_lp = merged_logits(tensors)
    np.testing.assert_allclose(got_lp, want_lp, rtol=1e-4, atol=1e-4)
    assert np.max(np.abs(want - base)) > 1e-2

    # broken exports: expert j's tensors under expert n - 1 - j; the gate's under the up projection's
    prefix = "base_model.model.model.layers"
    n = int(policy.cfg.num_experts)

    def other_expert(name: str) -> str:
        if ".experts." not in name:
            return name
        head, tail = name.split(".experts.")
        j, rest = tail.split(".", 1)
        return f"{head}.experts.{n - 1 - int(j)}.{rest}"

    wrong_expert = {other_expert(k): v for k, v in tensors.items()}
    gate, up = (f".{p}." for p in MODELS[model][2][:2])
    swapped = {k.replace(gate, ".TMP.").replace(up, gate).replace(".TMP.", up): v for k, v in tensors.items()}
    for label, bad in (("expert index", wrong_expert), ("gate/up", swapped)):
        assert set(bad) == set(tensors) and all(k.startswith(prefix) for k in bad)
        lp = merged_logits(bad)
        assert not np.allclose(lp, want_lp, rtol=1e-4, atol=1e-4), f"a broken export ({label}) passed"


def test_the_dense_expert_path_computes_the_same_adapter_as_the_sparse_one() -> None:
    """The miniature runs MaxText's sparse path (``sparse_matmul``, megablox's grouped matmul, which the
    CPU interprets); with ``sparse_matmul: false`` MaxText's dense einsum path computes the same model,
    and the merged expert weights give the same adapter there."""
    sparse = _policy()
    keys = {
        "model_name": MODEL,
        **miniature.miniature_overrides(MODEL),
        **CPU_KEYS,
        "max_target_length": 32,
        "sparse_matmul": False,
    }
    dense = Policy(
        ModelSpec(maxtext=keys, lora_rank=RANK, lora_alpha=ALPHA, lora_targets=sparse.spec.lora_targets)
    )
    assert not dense.cfg.sparse_matmul and sparse.cfg.sparse_matmul
    toks, pos, seg = _inputs(sparse)
    lora = _experts_random(sparse.zero_lora(sparse.lora0), seed=5)
    zero = sparse.zero_lora(sparse.lora0)
    np.testing.assert_allclose(
        np.asarray(dense.logits(zero, toks, pos, seg)),
        np.asarray(sparse.logits(zero, toks, pos, seg)),
        atol=1e-4,
    )
    got, want = (
        np.asarray(dense.logits(lora, toks, pos, seg)),
        np.asarray(sparse.logits(lora, toks, pos, seg)),
    )
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.max(np.abs(want - np.asarray(sparse.logits(zero, toks, pos, seg)))) > 1e-2


@pytest.mark.slow
def test_the_expert_lora_compiles_for_a_tpu_with_megablox_and_expert_parallelism() -> None:
    """The TPU program (libtpu's compiler, jax.experimental.topologies, nothing runs): the Qwen3 MoE
    miniature in bfloat16 on a v5p-8 with its four devices on the expert axis, the forward and backward of
    the log-probs with respect to the LoRA state: the merged expert weights go through megablox's grouped
    matmul as Pallas (Mosaic) kernels, and the expert factors are split over the expert axis as the expert
    weights are."""
    from jax.experimental.topologies import get_topology_desc
    from maxtext.utils import accelerator_to_spec_map

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    hw = accelerator_to_spec_map.get_system_characteristics("v5p-8")
    devices = get_topology_desc(
        platform=hw.platform,
        topology_name=hw.topology_name,
        chip_config_name=hw.chip_config_name,
        chips_per_host_bounds=hw.chips_per_host_bounds,
        num_slices=1,
        wrap=hw.wrap,
    ).devices
    keys = {
        "model_name": MODEL,
        **miniature.miniature_overrides(MODEL),
        **CPU_KEYS,
        "max_target_length": 256,
        "dtype": "bfloat16",
        "weight_dtype": "bfloat16",
        "matmul_precision": "default",
        "ici_fsdp_parallelism": 1,
        "ici_expert_parallelism": 4,
        "compile_topology": "v5p-8",
        "compile_topology_num_slices": 1,
    }
    targets = (*lora_targets.ATTENTION, lora_targets.EXPERTS)
    policy = Policy(
        ModelSpec(maxtext=keys, lora_rank=8, lora_alpha=16.0, lora_targets=targets), devices=devices
    )
    assert policy.cfg.sparse_matmul and policy.cfg.megablox and policy.mesh.shape["expert"] == 4
    for k, sharding in policy.lora_sharding["decoder"]["layers"]["moe_block"].items():
        assert sharding.spec[0] == "expert", (k, sharding.spec)

    def loss(lora: Any, base: Any, toks: jax.Array, pos: jax.Array, seg: jax.Array) -> jax.Array:
        return jnp.sum(policy.next_token_logprobs(lora, toks, pos, seg, base=base))

    batch = jax.ShapeDtypeStruct((4, 256), jnp.int32)  # type: ignore[no-untyped-call]
    compiled = jax.jit(jax.grad(loss)).lower(policy.lora0, policy.base, batch, batch, batch).compile()
    text = compiled.as_text()
    assert text is not None and text.count("tpu_custom_call") > 0
