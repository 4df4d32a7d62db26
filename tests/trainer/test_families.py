"""Every catalog model family under the trainer, on its miniature (rljob.recipes.miniature): the model's
own MaxText config with only sizes shrunk builds a real MaxText model under qwix LoRA; every LoRA leaf
takes part in the forward pass; the adapter exports to PEFT under the Hugging Face model's module names
and shapes, layer by layer, and imports back exactly.

The Hugging Face side is computed from transformers' own configuration classes (their ``layer_types``
say which layer is sliding, full or linear attention) and the shapes of the projections in its modeling
files (transformers 5.x models/<family>/modeling_<family>.py): Qwen3.5's q_proj is twice
``heads x head_dim`` wide (query and output gate), its linear-attention layers have no self_attn, its
MLP LoRA lands on ``mlp.shared_expert``; Gemma 4's full-attention layers use ``global_head_dim`` and
``num_global_key_value_heads`` and, with ``attention_k_eq_v`` (MaxText ``share_kv_projections``), have
no v_proj. Qwen3 MoE (qwen3_moe) trains attention only (its MLP is routed experts); Llama 3.1 (llama2)
attention and MLP, its query and key lora_B mapped from MaxText's interleaved RoPE pairs and folded query
scale to Hugging Face's layout (checked against MaxText's own MaxText->HF checkpoint conversion below).
Mixtral (mixtral) trains attention only (its MLP is routed experts), its query lora_B scaled back by
sqrt(head_dim) (checked against MaxText's own HF->MaxText conversion). DeepSeek-V3 (deepseek) trains
its multi-head latent attention (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj) and the MLP
of its dense layers and shared experts, exported by transposes only (checked against MaxText's own
conversion in both directions). Gemma 3 (gemma3) trains attention
and MLP of its sliding-window and global layers alike, scanned in blocks of six with the last layers
unscanned (``layers_remainder``), exported under Gemma3ForConditionalGeneration's
``model.language_model.layers``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rljob.recipes import lora_targets, miniature
from rljob.trainer.model import CPU_KEYS, ModelSpec, Policy
from rljob.trainer.peft import LeafLayout

TESTED_MODULES = ("rljob.trainer.peft",)

pytestmark = pytest.mark.jax


# LoRA targets per family: every projection the family has (rljob.recipes.lora_targets).
# DeepSeek: its query projections are those of its q_lora_rank (q_a_proj and q_b_proj, or q_proj).
def _targets(model: str) -> tuple[str, ...]:
    mini = miniature.describe(model)
    block, kept = str(mini["decoder_block"]), dict(mini["kept"])  # type: ignore[call-overload]
    rank = miniature.miniature_overrides(model).get("q_lora_rank", kept.get("q_lora_rank"))
    return tuple(t for t in lora_targets.SUPPORTED[block] if not lora_targets.mla_problems(block, [t], rank))


TARGETS = {m: _targets(m) for m in miniature.MODELS}


def _listed(layer_types: list[str] | None) -> list[str]:
    """A transformers config's layer_types (typed Optional; set once num_hidden_layers is)."""
    assert layer_types is not None
    return list(layer_types)


def _hf_layer_types(model: str, cfg: Any) -> list[str]:
    import transformers

    n = int(cfg.num_decoder_layers)
    if model == "gpt-oss-20b":
        return _listed(transformers.GptOssConfig(num_hidden_layers=n).layer_types)
    if model == "qwen3.5-397b-a17b":
        return _listed(transformers.Qwen3_5MoeTextConfig(num_hidden_layers=n).layer_types)
    if model == "gemma4-31b":
        return _listed(transformers.Gemma4TextConfig(num_hidden_layers=n).layer_types)
    if model == "gemma3-27b":
        return _listed(transformers.Gemma3TextConfig(num_hidden_layers=n).layer_types)
    return ["full_attention"] * n


def _hf_deepseek_modules(cfg: Any) -> list[dict[str, tuple[int, int]]]:
    """Per layer, module -> (out, in) of DeepseekV3ForCausalLM with the miniature's sizes, from
    transformers' own config (transformers 5.x models/deepseek_v3/modeling_deepseek_v3.py:
    DeepseekV3Attention, DeepseekV3MLP, DeepseekV3MoE's shared_experts of moe_intermediate_size x
    n_shared_experts; the first first_k_dense_replace layers dense)."""
    import transformers

    hf = transformers.DeepseekV3Config(
        hidden_size=int(cfg.emb_dim),
        num_hidden_layers=int(cfg.num_decoder_layers),
        num_attention_heads=int(cfg.num_query_heads),
        q_lora_rank=int(cfg.q_lora_rank) or None,
        kv_lora_rank=int(cfg.kv_lora_rank),
        qk_nope_head_dim=int(cfg.qk_nope_head_dim),
        qk_rope_head_dim=int(cfg.qk_rope_head_dim),
        v_head_dim=int(cfg.v_head_dim),
        intermediate_size=int(cfg.mlp_dim),
        moe_intermediate_size=int(cfg.moe_mlp_dim),
        n_shared_experts=int(cfg.shared_experts),
        first_k_dense_replace=int(cfg.first_num_dense_layers),
    )

    def n(name: str) -> int:  # an int field of the config (typed Optional)
        return int(getattr(hf, name))

    h, heads, kv_rank, rope = (
        n("hidden_size"),
        n("num_attention_heads"),
        n("kv_lora_rank"),
        n("qk_rope_head_dim"),
    )
    attn = {
        "self_attn.kv_a_proj_with_mqa": (kv_rank + rope, h),
        "self_attn.kv_b_proj": (heads * (n("qk_nope_head_dim") + n("v_head_dim")), kv_rank),
        "self_attn.o_proj": (h, heads * n("v_head_dim")),
    }
    if hf.q_lora_rank is None:
        attn["self_attn.q_proj"] = (heads * n("qk_head_dim"), h)
    else:
        attn |= {
            "self_attn.q_a_proj": (n("q_lora_rank"), h),
            "self_attn.q_b_proj": (heads * n("qk_head_dim"), n("q_lora_rank")),
        }
    out = []
    for i in range(n("num_hidden_layers")):
        dense = i < n("first_k_dense_replace")
        mlp = "mlp" if dense else "mlp.shared_experts"
        w = n("intermediate_size") if dense else n("moe_intermediate_size") * n("n_shared_experts")
        out.append(attn | {f"{mlp}.gate_proj": (w, h), f"{mlp}.up_proj": (w, h), f"{mlp}.down_proj": (h, w)})
    return out


def _hf_tensors(model: str, cfg: Any, targets: tuple[str, ...], r: int) -> dict[str, tuple[int, int]]:
    """PEFT tensor name -> shape of the Hugging Face model with the miniature's sizes."""
    if model.startswith("deepseek"):
        return {
            f"base_model.model.model.layers.{i}.{mod}.lora_{w}.weight": (r, n_in) if w == "A" else (o, r)
            for i, mods in enumerate(_hf_deepseek_modules(cfg))
            for mod, (o, n_in) in mods.items()
            if mod.rsplit(".", 1)[1] in targets
            for w in "AB"
        }
    prefix = "base_model.model.model.layers"
    if model in ("qwen3.5-397b-a17b", "gemma4-31b", "gemma3-27b"):
        prefix = "base_model.model.model.language_model.layers"
    h, heads = int(cfg.emb_dim), int(cfg.num_query_heads)
    out: dict[str, tuple[int, int]] = {}
    for i, kind in enumerate(_hf_layer_types(model, cfg)):
        hd, kv = int(cfg.head_dim), int(cfg.num_kv_heads)
        q_out = heads * hd
        mods: dict[str, tuple[int, int]] = {}  # module -> (out, in)
        if model == "gemma4-31b" and kind == "full_attention":
            hd, kv = int(cfg.global_head_dim), int(cfg.global_num_kv_heads)
            q_out = heads * hd
        if model == "qwen3.5-397b-a17b":
            q_out = heads * hd * 2  # query and output gate
        if kind != "linear_attention":
            mods |= {
                "self_attn.q_proj": (q_out, h),
                "self_attn.k_proj": (kv * hd, h),
                "self_attn.v_proj": (kv * hd, h),
                "self_attn.o_proj": (heads * hd, h)[::-1],
            }
            if model == "gemma4-31b" and kind == "full_attention" and cfg.share_kv_projections:
                del mods["self_attn.v_proj"]  # attention_k_eq_v: the keys are the values
        mlp = "mlp.shared_expert" if model == "qwen3.5-397b-a17b" else "mlp"
        width = int(cfg.moe_mlp_dim if model == "qwen3.5-397b-a17b" else cfg.mlp_dim)
        mods |= {f"{mlp}.gate_proj": (width, h), f"{mlp}.up_proj": (width, h), f"{mlp}.down_proj": (h, width)}
        for mod, (o, n_in) in mods.items():
            if mod.rsplit(".", 1)[1] in targets:
                out[f"{prefix}.{i}.{mod}.lora_A.weight"] = (r, n_in)
                out[f"{prefix}.{i}.{mod}.lora_B.weight"] = (o, r)
    return out


_POLICIES: dict[str, Policy] = {}


def _policy(model: str) -> Policy:
    if model not in _POLICIES:
        keys = {
            "model_name": model,
            **miniature.miniature_overrides(model),
            **CPU_KEYS,
            "max_target_length": 32,
        }
        _POLICIES[model] = Policy(
            ModelSpec(maxtext=keys, lora_rank=4, lora_alpha=8.0, lora_targets=TARGETS[model])
        )
    return _POLICIES[model]


def _random_like(lora: Any, seed: int) -> Any:
    leaves, tree = jax.tree.flatten(lora)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    )


# Qwen3.5's miniature (8 layers of gated delta nets and MoE) takes the longest to build and compile.
FAMILIES = [
    pytest.param(m, marks=pytest.mark.slow) if m.startswith("qwen3.5") else m for m in miniature.MODELS
]


@pytest.mark.parametrize("model", FAMILIES)
def test_family_builds_trains_and_round_trips_through_peft(model: str) -> None:
    policy = _policy(model)
    cfg, r = policy.cfg, policy.spec.lora_rank
    lora = _random_like(policy.lora0, seed=1)

    # Every LoRA leaf is live: the gradient of the logits reaches each one (qwix found the factors
    # created before its first call, the Gemma 4 global layer's included).
    toks = jnp.asarray(np.random.default_rng(0).integers(1, policy.vocab_size, (1, 16)), jnp.int32)
    pos, seg = jnp.arange(16, dtype=jnp.int32)[None], jnp.ones((1, 16), jnp.int32)
    weights = jax.random.normal(jax.random.key(2), (1, 16, policy.vocab_size))
    grads = jax.grad(lambda lo: jnp.sum(policy.logits(lo, toks, pos, seg) * weights))(lora)
    dead = [
        jax.tree_util.keystr(p)
        for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]
        if not jnp.any(g != 0)
    ]
    assert not dead, f"LoRA leaves without gradient: {dead}"

    # PEFT: the Hugging Face names and shapes, layer by layer.
    tensors = policy.peft.to_peft(lora)
    want = _hf_tensors(model, cfg, TARGETS[model], r)
    assert {k: v.shape for k, v in tensors.items()} == want
    assert all(v.dtype == np.float32 for v in tensors.values())
    assert policy.peft.config()["target_modules"] == sorted(TARGETS[model])

    # ... and back, exactly; a tensor of the wrong shape is refused by name.
    back = policy.peft.from_peft(tensors)
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(lora), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    name = sorted(tensors)[0]
    with pytest.raises(ValueError, match="shape"):
        policy.peft.from_peft({**tensors, name: np.zeros((r + 1, 3), np.float32)})

    # Layer order: each scan position is the Hugging Face layer the layout says (two layers of the same
    # kind swapped in the PEFT tensors come back swapped in the stacked parameter).
    q = next(
        leaf
        for leaf in policy.peft.layout
        if leaf.module in ("query", "wq_a") and leaf.which == "a" and len(leaf.layers) > 1
    )
    first, second = q.layers[0], q.layers[1]
    k0, k1 = policy.peft.name(first, q), policy.peft.name(second, q)
    swapped = policy.peft.from_peft({**tensors, k0: tensors[k1], k1: tensors[k0]})
    idx = next(i for i, leaf in enumerate(policy.peft.layout) if leaf is q)
    per_layer = q.per_layer(np.asarray(jax.tree.leaves(swapped)[idx]))
    np.testing.assert_array_equal(per_layer[0], tensors[k1].T)
    np.testing.assert_array_equal(per_layer[1], tensors[k0].T)


def test_gpt_oss_block_order_is_hugging_faces() -> None:
    """gpt-oss alternates sliding and full attention: MaxText's sub-layer j of a scanned pair has the
    attention type of Hugging Face layer 2b + j (GptOssConfig.layer_types)."""
    from flax import nnx
    from maxtext.layers.attentions import AttentionType

    policy = _policy("gpt-oss-20b")
    model = nnx.merge(policy.graphdef, policy.as_state(policy.lora0), policy.base)
    hf = _hf_layer_types("gpt-oss-20b", policy.cfg)
    kind = {AttentionType.LOCAL_SLIDING: "sliding_attention", AttentionType.GLOBAL: "full_attention"}
    checked = 0
    for leaf in policy.peft.layout:
        if leaf.module != "query" or leaf.which != "a":
            continue
        j = int(leaf.path.split("/")[2].removeprefix("layers_"))
        sub = getattr(model.decoder.layers, f"layers_{j}")
        assert leaf.layers == tuple(range(j, policy.num_layers, 2))
        assert all(hf[i] == kind[sub.attention_type] for i in leaf.layers)
        checked += len(leaf.layers)
    assert checked == policy.num_layers


def _hf_delta_by_maxtexts_conversion(
    model: str, policy: Policy, module: str, a: np.ndarray, b: np.ndarray
) -> Any:
    """MaxText's own MaxText->Hugging Face conversion (checkpoint_conversion/utils/param_mapping.py HOOK_FNS,
    saving_to_hf) of one layer's LoRA delta a @ b, as an HF weight (out, in). The hooks are linear, so the
    converted delta is the change of the converted kernel."""
    from maxtext.checkpoint_conversion.utils import param_mapping

    cfg = policy.cfg
    text = {
        "num_hidden_layers": policy.num_layers,
        "head_dim": int(cfg.head_dim),
        "hidden_size": int(cfg.emb_dim),
    }
    # Gemma 3's hooks read the image-text model's text_config and vision_config
    hf_config = {**text, "text_config": text, "vision_config": {"num_hidden_layers": 0}}
    hooks = param_mapping.HOOK_FNS[model](hf_config, cfg, scan_layers=True, saving_to_hf=True)
    parent = "self_attention" if module in ("query", "key", "value", "out") else "mlp"
    # the same hook for every layer: params-decoder-layers-<parent>-... (one scan axis of layers), or
    # Gemma 3's params-decoder-layers-layers_<j>-... and params-decoder-layers_remainder-layers_<j>-...
    chain = next(
        v
        for k, v in hooks.items()
        if k.startswith("params-decoder-layers") and k.endswith(f"-{parent}-{module}-kernel")
    )
    heads = {"query": int(cfg.num_query_heads), "key": int(cfg.num_kv_heads), "value": int(cfg.num_kv_heads)}
    delta = a @ b  # [in, out]
    if module in heads:  # MaxText's kernel: [emb, heads, head_dim]
        delta = delta.reshape(delta.shape[0], heads[module], int(cfg.head_dim))
    elif module == "out":  # [heads, head_dim, emb]
        delta = delta.reshape(int(cfg.num_query_heads), int(cfg.head_dim), delta.shape[-1])
    target = (b.shape[1], a.shape[0])  # Hugging Face (out, in)
    for hook in chain if isinstance(chain, list) else [chain]:
        delta = hook(delta, target)
    return np.asarray(delta, np.float64)


@pytest.mark.parametrize("model", ["llama3.1-8b", "qwen3-30b-a3b", "qwen3-8b", "gemma3-27b"])
def test_the_adapter_is_maxtexts_hugging_face_conversion_of_the_lora_delta(model: str) -> None:
    """For every projection and layer, the PEFT adapter's delta B @ A is what MaxText's own checkpoint
    conversion makes of the MaxText delta a @ b: for Llama 3.1 its query and key lora_B go from MaxText's
    interleaved RoPE pairs back to Hugging Face's halves and the query's by sqrt(head_dim) (the scale
    MaxText folds into the query kernel); for Qwen3, Qwen3 MoE and Gemma 3 (whose query is scaled at run
    time, query_pre_attn_scalar after its QK norm) nothing but the transposes, on every layer of Gemma 3's
    scanned blocks and remainder. A broken
    export (Llama's RoPE map or query scale left out) is caught."""
    import dataclasses

    policy = _policy(model)
    lora = _random_like(policy.lora0, seed=3)
    tensors = policy.peft.to_peft(lora)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(lora)]
    # a LoRA leaf per module and scan container (Gemma 3: each sub-layer of its block, each remainder layer)
    by = {
        (leaf.path.rsplit("/", 1)[0], leaf.which): (leaf, arr)
        for leaf, arr in zip(policy.peft.layout, leaves, strict=True)
    }
    checked = 0
    for (container, which), (la, a_arr) in by.items():
        if which != "a":
            continue
        lb, b_arr = by[(container, "b")]
        module = la.module
        assert la.layers == lb.layers
        for i, (a, b) in enumerate(zip(la.per_layer(a_arr), lb.per_layer(b_arr), strict=True)):
            layer = la.layers[i]
            want = _hf_delta_by_maxtexts_conversion(model, policy, module, a, b)
            got = (
                tensors[policy.peft.name(layer, lb)].astype(np.float64) @ tensors[policy.peft.name(layer, la)]
            )
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{module} layer {layer}")
            checked += 1
            if model.startswith("llama") and module in ("query", "key"):
                broken = dataclasses.replace(lb, rope_pairs=False, scale=1.0)
                bad = (
                    broken.to_hf(b.astype(np.float32)).astype(np.float64)
                    @ tensors[policy.peft.name(layer, la)]
                )
                assert not np.allclose(bad, want, rtol=1e-3, atol=1e-4), f"{module}: a broken map passed"
    assert checked == policy.num_layers * len(TARGETS[model])


def _maxtext_delta_by_maxtexts_conversion(model: str, policy: Policy, module: str, hf: np.ndarray) -> Any:
    """MaxText's own Hugging Face->MaxText conversion (param_mapping.py HOOK_FNS, not saving_to_hf: the
    direction of ``to_maxtext``, which converts the base checkpoint rljob trains on, docs/gke.md) of one
    layer's Hugging Face delta (out, in), as a MaxText kernel ([emb, heads, head_dim] for the query, key
    and value, [heads, head_dim, emb] for the output)."""
    from maxtext.checkpoint_conversion.utils import param_mapping

    cfg = policy.cfg
    hf_config = {"num_hidden_layers": policy.num_layers, "hidden_size": int(cfg.emb_dim)}
    hooks = param_mapping.HOOK_FNS[model](hf_config, cfg, scan_layers=True, saving_to_hf=False)
    chain = hooks[f"params-decoder-layers-self_attention-{module}-kernel"]
    heads = {"query": int(cfg.num_query_heads), "key": int(cfg.num_kv_heads), "value": int(cfg.num_kv_heads)}
    hd = int(cfg.head_dim)
    target = (
        (hf.shape[1], heads[module], hd) if module in heads else (int(cfg.num_query_heads), hd, hf.shape[0])
    )
    out = hf
    for hook in chain if isinstance(chain, list) else [chain]:
        out = hook(out, target)
    return np.asarray(out, np.float64)


@pytest.mark.parametrize("model", ["mixtral-8x7b"])
def test_maxtexts_conversion_of_the_adapter_is_the_lora_delta(model: str) -> None:
    """Mixtral (attention only): for every projection and layer, MaxText's own Hugging Face->MaxText
    conversion of the PEFT adapter's delta B @ A is the MaxText delta a @ b: the query's lora_B comes out
    sqrt(head_dim) larger (the scale MaxText folds into the query kernel and its conversion divides out);
    key, value and output are transposes. (MaxText's MaxText->Hugging Face hook for Mixtral's output kernel,
    reshape_and_transpose_attention, reshapes [heads, head_dim, emb] to [emb, -1] instead of transposing
    it, so this direction is the one checked.) An export without the query scale is caught."""
    import dataclasses

    policy = _policy(model)
    lora = _random_like(policy.lora0, seed=3)
    tensors = policy.peft.to_peft(lora)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(lora)]
    by = {
        (leaf.module, leaf.which): (leaf, arr) for leaf, arr in zip(policy.peft.layout, leaves, strict=True)
    }
    assert len(by) == len(leaves)  # one scan axis of layers: a leaf per module
    checked = 0
    for (module, which), (la, a_arr) in by.items():
        if which != "a":
            continue
        lb, b_arr = by[(module, "b")]
        for i, (a, b) in enumerate(zip(la.per_layer(a_arr), lb.per_layer(b_arr), strict=True)):
            layer = la.layers[i]
            a_hf = tensors[policy.peft.name(layer, la)].astype(np.float64)
            hf = tensors[policy.peft.name(layer, lb)].astype(np.float64) @ a_hf
            got = _maxtext_delta_by_maxtexts_conversion(model, policy, module, hf)
            want = (a @ b).reshape(got.shape)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{module} layer {layer}")
            checked += 1
            if module == "query":
                broken = dataclasses.replace(lb, scale=1.0).to_hf(b.astype(np.float32)).astype(np.float64)
                bad = _maxtext_delta_by_maxtexts_conversion(model, policy, module, broken @ a_hf)
                assert not np.allclose(bad, want, rtol=1e-3, atol=1e-4), "a query without its scale passed"
    assert checked == policy.num_layers * len(TARGETS[model])


def test_a_query_scale_of_head_dim_128_round_trips_to_float32_rounding() -> None:
    """Llama 3.1's full head_dim 128: sqrt(128) is not a power of two, so lora_B of the query comes back
    from PEFT within float32 rounding (the miniature's head_dim 16 round-trips exactly)."""
    from rljob.trainer.peft import LeafLayout

    leaf = LeafLayout(
        "decoder/layers/x", "query", "b", "self_attn", (4, 2 * 128), 0, (), (0,), 128, True, 128**0.5
    )
    m = np.random.default_rng(0).standard_normal((4, 2 * 128)).astype(np.float32)
    t = leaf.to_hf(m)
    assert t.shape == (256, 4)
    # head 0's HF feature 1 is MaxText's feature 2 (the pairs' first halves first), scaled by sqrt(128)
    np.testing.assert_allclose(t[1], m[:, 2] * 128**0.5, rtol=1e-6)
    np.testing.assert_allclose(t[64], m[:, 1] * 128**0.5, rtol=1e-6)
    np.testing.assert_allclose(leaf.from_hf(t), m, rtol=1e-6)


def _deepseek_kernel_shape(cfg: Any, module: str) -> tuple[int, ...]:
    """MaxText's kernel shape of a DeepSeek projection (layers/attention_mla.py MLA._init_projections,
    init_out_w; layers/linears.py MlpBlock), one layer: what its checkpoint conversion reshapes to."""
    heads, qk = int(cfg.num_query_heads), int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
    emb = int(cfg.emb_dim)
    return {
        "query": (emb, heads, qk),
        "wq_a": (emb, int(cfg.q_lora_rank)),
        "wq_b": (int(cfg.q_lora_rank), heads, qk),
        "wkv_a": (emb, int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)),
        "wkv_b": (int(cfg.kv_lora_rank), heads, int(cfg.qk_nope_head_dim) + int(cfg.v_head_dim)),
        "out": (heads, int(cfg.v_head_dim), emb),
    }.get(module, ())


def _deepseek_hooks(policy: Policy, saving_to_hf: bool) -> dict[str, Any]:
    from maxtext.checkpoint_conversion.utils import param_mapping

    hf_config = {
        "num_hidden_layers": policy.num_layers,
        "first_k_dense_replace": policy.cfg.first_num_dense_layers,
    }
    return dict(
        param_mapping.HOOK_FNS[str(policy.cfg.model_name)](
            hf_config, policy.cfg, scan_layers=True, saving_to_hf=saving_to_hf
        )
    )


def _deepseek_broken(leaf: LeafLayout, b: np.ndarray, cfg: Any) -> np.ndarray | None:
    """A plausible wrong export of a lora_B, or None: kv_b_proj's output taken head-minor ([nope+v, heads]
    instead of per head), q_b_proj's (q_proj's) per-head rotary part put before the non-rotary part."""
    t = leaf.to_hf(b.astype(np.float32)).astype(np.float64)  # (out, r)
    heads, nope = int(cfg.num_query_heads), int(cfg.qk_nope_head_dim)
    if leaf.module == "wkv_b":
        return t.reshape(heads, -1, t.shape[-1]).transpose(1, 0, 2).reshape(t.shape)
    if leaf.module in ("wq_b", "query"):
        h = t.reshape(heads, -1, t.shape[-1])
        swapped: np.ndarray = np.concatenate([h[:, nope:], h[:, :nope]], axis=1).reshape(t.shape)
        return swapped
    return None


@pytest.mark.parametrize("model", ["deepseek3-671b", "deepseek2-16b"])
def test_deepseek_adapter_is_maxtexts_conversion_of_the_lora_delta_both_ways(model: str) -> None:
    """DeepSeek-V3 (MLA, dense then MoE layers): for every projection and layer, the PEFT adapter's delta
    B @ A is MaxText's own MaxText->Hugging Face conversion of the MaxText delta a @ b, and MaxText's
    Hugging Face->MaxText conversion (the direction of ``to_maxtext``, which converts the base checkpoint)
    of B @ A is a @ b again (checkpoint_conversion/utils/param_mapping.py
    DEEPSEEK_MAXTEXT_TO_HF_PARAM_HOOK_FN: transposes and head reshapes only; MaxText scales the query by
    its softmax scale at run time and rotates DeepSeek's interleaved RoPE pairs as Hugging Face's
    rope_interleave does, so nothing is rescaled or reordered). Dense layers map to the first
    model.layers, MoE layers to those after them, their MLP under mlp.shared_experts. Exports that split
    kv_b_proj's heads the wrong way or put q_b_proj's (DeepSeek-V2: q_proj's) rotary dims first are caught."""
    policy = _policy(model)
    cfg = policy.cfg
    to_hf, to_mt = _deepseek_hooks(policy, True), _deepseek_hooks(policy, False)
    lora = _random_like(policy.lora0, seed=3)
    tensors = policy.peft.to_peft(lora)
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(lora)]
    by = {
        (leaf.path.rsplit("/", 1)[0], leaf.which): (leaf, arr)
        for leaf, arr in zip(policy.peft.layout, leaves, strict=True)
    }
    checked, broken_caught = 0, 0
    for (container, which), (la, a_arr) in by.items():
        if which != "a":
            continue
        lb, b_arr = by[(container, "b")]
        keys = container.split("/")  # decoder/<dense_layers|moe_layers>/.../<module>
        key = "params-" + "-".join(keys) + "-kernel"
        assert la.layers == lb.layers
        dense = int(cfg.first_num_dense_layers)
        assert la.layers == tuple(
            range(dense) if keys[1] == "dense_layers" else range(dense, policy.num_layers)
        )
        assert la.hf_parent == (
            "self_attn"
            if "self_attention" in keys
            else "mlp.shared_experts"
            if "shared_experts" in keys
            else "mlp"
        )
        for a, b, layer in zip(la.per_layer(a_arr), lb.per_layer(b_arr), la.layers, strict=True):
            a_hf = tensors[policy.peft.name(layer, la)].astype(np.float64)
            got = tensors[policy.peft.name(layer, lb)].astype(np.float64) @ a_hf
            kernel = _deepseek_kernel_shape(cfg, la.module) or (a.shape[0], b.shape[1])
            want = np.asarray(to_hf[key]((a @ b).reshape(kernel), got.shape), np.float64)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{key} layer {layer}")
            back = np.asarray(to_mt[key](got, kernel), np.float64)
            np.testing.assert_allclose(back, (a @ b).reshape(kernel), rtol=1e-5, atol=1e-6, err_msg=key)
            checked += 1
            bad_b = _deepseek_broken(lb, b, cfg)
            if bad_b is not None:
                assert not np.allclose(bad_b @ a_hf, want, rtol=1e-3, atol=1e-4), (
                    f"{key}: a broken export passed"
                )
                broken_caught += 1
    assert checked == policy.num_layers * len(TARGETS[model])
    assert broken_caught == 2 * policy.num_layers


def test_the_trainers_family_tables_are_the_registrys() -> None:
    """trainer/peft.py and trainer/expert_lora.py read recipes/families.py: the values they held."""
    from rljob.trainer import expert_lora, peft

    assert expert_lora.EXPERT_HF_NAMES == {
        "qwen3_moe": ("mlp.experts", {"wi_0": "gate_proj", "wi_1": "up_proj", "wo": "down_proj"}),
        "mixtral": ("block_sparse_moe.experts", {"wi_0": "w1", "wi_1": "w3", "wo": "w2"}),
    }
    language_model = "base_model.model.model.language_model.layers"
    assert {
        "qwen3_5": language_model,
        "gemma4": language_model,
        "gemma3": language_model,
    } == peft.HF_LAYERS_PREFIX
    assert peft.DEFAULT_HF_LAYERS_PREFIX == "base_model.model.model.layers"
    assert {"llama2", "mixtral"} == peft.QUERY_SCALE_FOLDED
