"""The trainer's own conversion of a Hugging Face model (rljob.trainer.hf_weights), on CPU, without the Hub:
the test writes a tiny model's Hugging Face files (config.json from transformers' configuration class,
model.safetensors with random weights under the Hugging Face state-dict names and shapes MaxText's
checkpoint conversion lists for the family: maxtext.checkpoint_conversion.utils.hf_shape), converts them
through the job's code path (ensure_converted: MaxText's PARAM_MAPPING / HOOK_FNS, lazily, into the cache
directory with its marker), loads the result into the trainer's Policy and compares its logits with a numpy
forward pass of the Hugging Face weights written from transformers' Qwen3 modeling (RMSNorm, per-head query
and key norms, rotate-half RoPE, grouped-query attention, SwiGLU, untied head). So the round trip proves
that what the trainer trains is the Hugging Face model the sampler serves, not only that shapes fit.

The cache: a second start finds the marker and converts nothing (no download, no tensor read: counted);
a directory a preempted conversion left without its marker is deleted and converted again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fixtures.hf_models import qwen3_config
from rljob.recipes import miniature
from rljob.trainer import hf_weights
from rljob.trainer.hf_weights import MARKER, BaseWeights, ensure_converted
from rljob.trainer.model import CPU_KEYS, ModelSpec, Policy, maxtext_config

pytestmark = pytest.mark.jax

MODEL = "qwen3-8b"


def _keys() -> dict[str, Any]:
    return {"model_name": MODEL, **miniature.miniature_overrides(MODEL), **CPU_KEYS, "max_target_length": 32}


def _hf_config(cfg: Any) -> Any:
    return qwen3_config(cfg, tie_word_embeddings=False)


def _write_hf_model(directory: Path, cfg: Any, seed: int = 3) -> dict[str, np.ndarray]:
    """config.json and model.safetensors of a random tiny Qwen3 (norm scales near 1)."""
    from maxtext.checkpoint_conversion.utils.hf_shape import QWEN_HF_WEIGHTS_TO_SHAPE
    from safetensors.numpy import save_file

    hf_cfg = _hf_config(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    hf_cfg.save_pretrained(str(directory))
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in QWEN_HF_WEIGHTS_TO_SHAPE(hf_cfg.to_dict()).items():
        if name.endswith("norm.weight"):
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    out: np.ndarray = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    return out


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """transformers' rotate-half RoPE on [T, heads, D]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    out: np.ndarray = x * cos + half * sin
    return out


def _hf_logits(t: dict[str, np.ndarray], hf_cfg: Any, tokens: np.ndarray) -> np.ndarray:
    """Qwen3ForCausalLM's logits of one row, in float64 (transformers models/qwen3/modeling_qwen3.py)."""
    w = {k: v.astype(np.float64) for k, v in t.items()}
    eps, theta = hf_cfg.rms_norm_eps, float(hf_cfg.rope_parameters["rope_theta"])
    heads, kv, d = hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, hf_cfg.head_dim
    n = len(tokens)
    pos = np.arange(n, dtype=np.float64)
    x = w["model.embed_tokens.weight"][tokens]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(hf_cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv, d)
        q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], eps), pos, theta)
        k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps), pos, theta)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(n, heads * d)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1.0 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    logits: np.ndarray = _rms(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T
    return logits


class _Fetch:
    """The Hub download stand-in: copies the test's Hugging Face files, counting calls."""

    def __init__(self, src: Path) -> None:
        self.src, self.calls = src, 0

    def __call__(self, model: str, revision: str, dest: Path) -> Path:
        import shutil

        self.calls += 1
        shutil.copytree(self.src, dest, dirs_exist_ok=True)
        return dest


def _base(tmp: Path) -> BaseWeights:
    directory = str(tmp / "store" / "cache" / "converted" / "Qwen" / "Qwen3-tiny@main" / "maxtext-0.2.5")
    return BaseWeights("Qwen/Qwen3-tiny", "main", "0.2.5", f"{directory}/0/items", directory)


def test_the_converted_hugging_face_model_gives_the_trainer_hugging_faces_logits(tmp_path: Path) -> None:
    keys = _keys()
    cfg = maxtext_config(keys)
    tensors = _write_hf_model(tmp_path / "hf", cfg)
    fetch = _Fetch(tmp_path / "hf")
    lines: list[str] = []
    bw = _base(tmp_path)
    done = ensure_converted(
        bw, cfg, process_index=0, local_dir=tmp_path / "local", report=lines.append, fetch=fetch
    )
    assert not done.hit and fetch.calls == 1 and done.tensors == len(tensors)
    assert json.loads((Path(str(bw.directory)) / MARKER).read_text()) == bw.source()
    assert lines[-1].startswith(f"converted Qwen/Qwen3-tiny@main: {len(tensors)}/{len(tensors)} tensors, ")
    assert not (tmp_path / "local" / "hf-convert").exists() or not any(
        (tmp_path / "local" / "hf-convert").rglob("*.safetensors")
    )

    policy = Policy(ModelSpec(maxtext=keys, lora_rank=4, lora_alpha=8.0, checkpoint=bw.checkpoint))
    tokens = np.array([[5, 17, 200, 3, 99, 42, 7, 128]], np.int32)
    pos = np.arange(tokens.shape[1], dtype=np.int32)[None]
    got = np.asarray(policy.logits(policy.lora0, tokens, pos, np.ones_like(tokens)))[0]
    want = _hf_logits(tensors, _hf_config(cfg), tokens[0])
    assert np.abs(got - want).max() < 2e-3 * max(1.0, np.abs(want).max()), np.abs(got - want).max()
    # Random weights would be far off: the comparison has teeth.
    assert np.abs(want).max() > 0.5


def test_a_second_start_reuses_the_conversion_and_a_partial_one_is_redone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = _keys()
    cfg = maxtext_config(keys)
    _write_hf_model(tmp_path / "hf", cfg)
    fetch = _Fetch(tmp_path / "hf")
    bw = _base(tmp_path)
    converts: list[str] = []
    real = hf_weights.convert

    def counting(*a: Any, **kw: Any) -> int:
        converts.append(str(a[1]))
        return real(*a, **kw)

    monkeypatch.setattr(hf_weights, "convert", counting)
    run = dict(process_index=0, local_dir=tmp_path / "local", report=lambda _: None, fetch=fetch)
    first = ensure_converted(bw, cfg, **run)  # type: ignore[arg-type]
    again = ensure_converted(bw, cfg, **run)  # type: ignore[arg-type]
    assert (first.hit, again.hit, fetch.calls, len(converts)) == (False, True, 1, 1)
    # Another process waits for the marker and converts nothing itself.
    other = ensure_converted(bw, cfg, **{**run, "process_index": 1})  # type: ignore[arg-type]
    assert other.hit and (fetch.calls, len(converts)) == (1, 1)

    # A preemption mid-conversion leaves files but no marker: the next start deletes them and converts.
    marker = Path(str(bw.directory)) / MARKER
    marker.unlink()
    leftover = Path(str(bw.directory)) / "0" / "items" / "leftover-from-a-preempted-start"
    leftover.write_text("x")
    redone = ensure_converted(bw, cfg, **run)  # type: ignore[arg-type]
    assert not redone.hit and (fetch.calls, len(converts)) == (2, 2)
    assert marker.is_file() and not leftover.exists()


# Hugging Face config keys -> the MaxText config attribute of the miniature that sizes them.
_HF_SIZES = {
    "hidden_size": "emb_dim",
    "intermediate_size": "mlp_dim",
    "moe_intermediate_size": "moe_mlp_dim",
    "num_hidden_layers": "num_decoder_layers",
    "num_attention_heads": "num_query_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "num_experts": "num_experts",
    "num_local_experts": "num_experts",
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "kv_lora_rank": "kv_lora_rank",
    "q_lora_rank": "q_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "first_k_dense_replace": "first_num_dense_layers",
    "sliding_window": "sliding_window_size",
    "global_head_dim": "global_head_dim",
    "num_global_key_value_heads": "global_num_kv_heads",
    "n_group": "n_routing_groups",
    "topk_group": "topk_routing_group",
    # Qwen3.5's gated delta net layers and its shared expert (MaxText's is moe_mlp_dim wide: moe.py).
    "linear_key_head_dim": "gdn_key_head_dim",
    "linear_value_head_dim": "gdn_value_head_dim",
    "linear_num_key_heads": "gdn_num_key_heads",
    "linear_num_value_heads": "gdn_num_value_heads",
    "linear_conv_kernel_dim": "gdn_conv_kernel_dim",
    "shared_expert_intermediate_size": "moe_mlp_dim",
}


def _sized(hf: dict[str, Any], cfg: Any) -> dict[str, Any]:
    out = dict(hf)
    for key, attr in _HF_SIZES.items():
        if key in out and getattr(cfg, attr, None) not in (None, 0):
            out[key] = int(getattr(cfg, attr))
    if "qk_head_dim" in out:  # DeepSeek-V3's config states the sum of the two query head widths it sizes
        out["qk_head_dim"] = int(out["qk_nope_head_dim"]) + int(out["qk_rope_head_dim"])
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][: int(cfg.num_decoder_layers)]
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = _sized(out["text_config"], cfg)
    return out


def _with_head_dim(shapes: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """MaxText's Mixtral shapes take head_dim to be hidden_size / heads (hf_shape.py); the Hugging Face
    model reads config.head_dim (transformers models/mixtral/modeling_mixtral.py), which the miniature
    sets apart: the attention projections at that head_dim."""
    d, hidden = hf.get("head_dim"), hf.get("hidden_size")
    if not d or not any(n.endswith("self_attn.k_proj.weight") for n in shapes):
        return shapes  # no per-head key projection (DeepSeek's MLA): MaxText's shapes as they are
    out = dict(shapes)
    widths = {"q_proj": hf["num_attention_heads"] * d, "k_proj": hf["num_key_value_heads"] * d}
    widths["v_proj"] = widths["k_proj"]
    for name in shapes:
        proj = name.rsplit(".", 2)[-2]
        if ".self_attn." in name and name.endswith(".weight") and proj in widths:
            out[name] = [widths[proj], hidden]
        elif ".self_attn." in name and name.endswith("o_proj.weight"):
            out[name] = [hidden, widths["q_proj"]]
    return out


def _write_family(directory: Path, model: str, cfg: Any) -> dict[str, np.ndarray]:
    """config.json (MaxText's copy of the family's Hugging Face config, sized as the miniature) and random
    safetensors under the names and shapes MaxText's conversion lists for it; returns the tensors."""
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from maxtext.checkpoint_conversion.utils.hf_shape import HF_SHAPE
    from safetensors.numpy import save_file

    hf = _sized(HF_MODEL_CONFIGS[model].to_dict(), cfg)
    hf.pop("quantization_config", None)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    rng = np.random.default_rng(11)
    # Keys only: Qwen3.5's shape table also lists composite (tuple) keys for the reverse conversion, each
    # part of which it lists on its own as well.
    shapes = {k: v for k, v in _with_head_dim(HF_SHAPE[model](hf), hf).items() if isinstance(k, str)}
    tensors = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return tensors


# The families rljob trains besides qwen3-8b above (recipes/miniature.py: one miniature per family).
FAMILIES = [m for m in miniature.MODELS if m != MODEL]
# The Hugging Face tensor of a MoE layer's routing bias (DeepSeek-V3's score-correction bias), which
# MaxText keeps in a variable collection of its own (MoEBiasVar), not with the params.
ROUTING_BIAS = ".mlp.gate.e_score_correction_bias"


def _routing_bias(policy: Policy) -> np.ndarray | None:
    """The routing bias the trainer's model holds (its one MoEBiasVar leaf, the MoE layers stacked)."""
    from flax import nnx
    from maxtext.layers.moe import MoEBiasVar

    leaves = [np.asarray(v) for _, v in nnx.to_flat_state(policy.base.filter(MoEBiasVar))]
    assert len(leaves) <= 1
    return leaves[0] if leaves else None


@pytest.mark.slow
@pytest.mark.parametrize("model", FAMILIES)
def test_every_family_converts_and_loads_into_the_trainer(tmp_path: Path, model: str) -> None:
    keys = {"model_name": model, **miniature.miniature_overrides(model), **CPU_KEYS, "max_target_length": 32}
    cfg = maxtext_config(keys)
    tensors = _write_family(tmp_path / "hf", model, cfg)
    directory = str(tmp_path / "store" / model)
    bw = BaseWeights(f"org/{model}", "main", "0.2.5", f"{directory}/0/items", directory)
    done = ensure_converted(
        bw,
        cfg,
        process_index=0,
        local_dir=tmp_path / "local",
        report=lambda _: None,
        fetch=_Fetch(tmp_path / "hf"),
    )
    assert not done.hit and 0 < done.tensors <= len(tensors)
    # The trainer's restore compares every leaf's tree path and shape with the model's before reading.
    policy = Policy(
        ModelSpec(
            maxtext=keys, lora_rank=4, lora_alpha=8.0, lora_targets=("o_proj",), checkpoint=bw.checkpoint
        )
    )
    tokens = np.array([[5, 17, 200, 3, 99, 42, 7, 128]], np.int32)
    pos = np.arange(tokens.shape[1], dtype=np.int32)[None]
    got = np.asarray(policy.logits(policy.lora0, tokens, pos, np.ones_like(tokens)))
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    # The routing bias is restored with the weights (it is not an nnx.Param): each MoE layer's is the
    # Hugging Face model's, not the zeros it is initialized to. Only where the model routes with one
    # (MaxText's routed_bias: DeepSeek-V3, not V2, whose files written here carry the tensor all the same).
    biases = (
        [
            t
            for name, t in sorted(tensors.items(), key=lambda kv: _layer(kv[0]))
            if name.endswith(ROUTING_BIAS)
        ]
        if cfg.routed_bias
        else []
    )
    bias = _routing_bias(policy)
    assert (bias is None) == (not biases) and (model != "deepseek3-671b" or len(biases) == 2)
    if biases:
        want = np.stack(biases)
        assert bias is not None and np.abs(want).min() > 0
        np.testing.assert_array_equal(bias if bias.shape == want.shape else bias.T, want)


def _layer(name: str) -> int:
    """The decoder layer index of a Hugging Face tensor name (-1 outside the layers)."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1


COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize(
    ("revision", "answer", "want_revision", "want_dir"),
    [
        ("main", COMMIT, COMMIT, f"/s/cache/converted/Qwen/Q@{COMMIT}/maxtext-0.2.5"),
        ("main", None, "main", "/s/cache/converted/Qwen/Q@main/maxtext-0.2.5"),  # no route to the Hub
        (COMMIT, "never asked", COMMIT, f"/s/cache/converted/Qwen/Q@{COMMIT}/maxtext-0.2.5"),
    ],
)
def test_a_moving_revision_is_pinned_to_its_commit_and_the_cache_keyed_on_it(
    revision: str, answer: str | None, want_revision: str, want_dir: str
) -> None:
    directory = f"/s/cache/converted/Qwen/Q@{revision}/maxtext-0.2.5"
    bw = BaseWeights("Qwen/Q", revision, "0.2.5", f"{directory}/0/items", directory)
    asked: list[tuple[str, str]] = []

    def resolve(model: str, rev: str) -> str | None:
        asked.append((model, rev))
        return answer

    got = hf_weights.resolve_revision(bw, resolve)
    assert (got.revision, got.directory, got.checkpoint) == (want_revision, want_dir, f"{want_dir}/0/items")
    assert asked == ([] if revision == COMMIT else [("Qwen/Q", "main")])
    assert got.source()["revision"] == want_revision  # the marker names the commit
    assert got.ref == ("main" if got is not bw else "")


def test_process_0s_commit_is_the_one_every_process_loads() -> None:
    directory = "/s/cache/converted/Qwen/Q@main/maxtext-0.2.5"
    bw = BaseWeights("Qwen/Q", "main", "0.2.5", f"{directory}/0/items", directory)
    # Another process asks nothing itself and takes process 0's answer.
    got = hf_weights.resolve_revision(bw, lambda _m, _r: None, share=lambda _mine: COMMIT)
    assert got.revision == COMMIT and got.ref == "main"


def test_a_resolver_answer_that_is_no_commit_is_refused_naming_the_field() -> None:
    directory = "/s/cache/converted/Qwen/Q@main/maxtext-0.2.5"
    bw = BaseWeights("Qwen/Q", "main", "0.2.5", f"{directory}/0/items", directory)
    with pytest.raises(hf_weights.WeightsError, match=r"^spec\.model\.revision: "):
        hf_weights.resolve_revision(bw, lambda _m, _r: "not-a-commit")


def test_a_checkpoint_converted_from_the_commit_the_ref_names_is_accepted(tmp_path: Path) -> None:
    conv = tmp_path / "conv"
    conv.mkdir()
    (conv / MARKER).write_text(json.dumps({"model": "Qwen/Q", "revision": COMMIT, "maxtext": "0.2.5"}))
    user = BaseWeights("Qwen/Q", "main", "0.2.5", f"{conv}/0/items", None)
    hf_weights.check_source(hf_weights.pin(user, COMMIT))  # the ref resolved to the marker's commit
    with pytest.raises(hf_weights.WeightsError, match=r"^spec\.model\.checkpoint: "):
        hf_weights.check_source(hf_weights.pin(user, "f" * 40))  # main moved since that conversion


def test_conversion_holds_about_one_tensor_in_host_memory_not_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tracemalloc counts numpy's buffers: building the MaxText leaves of a 16-layer model (~26 MB of
    float32 tensors, none over 0.5 MB) peaks far below the model's size (the leaves are file-backed,
    filled one Hugging Face tensor at a time; the earlier conversion held every leaf at once). Measured
    up to orbax's save, whose bytes in flight are bounded by SAVE_CONCURRENT_GB (1 GB: more than this
    whole model, so not measurable here); a first conversion imports every module outside the count."""
    import tracemalloc

    keys = {**_keys(), "base_num_decoder_layers": 16, "base_mlp_dim": 1024, "base_emb_dim": 128}
    cfg = maxtext_config(keys)
    tensors = _write_hf_model(tmp_path / "hf", cfg)
    total = sum(t.nbytes for t in tensors.values())
    largest = max(t.nbytes for t in tensors.values())
    del tensors
    assert total > 40 * largest  # many tensors: holding the model would show

    def run(out: str) -> None:
        hf_weights.convert(
            tmp_path / "hf",
            str(tmp_path / out),
            cfg,
            label="tiny",
            report=lambda _: None,
            scratch=tmp_path / f"{out}-leaves",
        )

    run("warm")
    peaks: list[int] = []
    real = hf_weights._save

    def at_save(*a: Any, **kw: Any) -> None:
        peaks.append(tracemalloc.get_traced_memory()[1])
        real(*a, **kw)

    monkeypatch.setattr(hf_weights, "_save", at_save)
    tracemalloc.start()
    try:
        run("measured")
    finally:
        tracemalloc.stop()
    assert len(peaks) == 1 and peaks[0] < total / 3, (peaks, total, largest)
