"""The production sampler backend: vLLM on TPU (vllm-tpu + tpu-inference), built from the run plan.

`build_command` turns the sampler plan of a RunConfig into the `vllm serve` argv and environment;
`preflight` checks, before serving, that the installed build can load and unload LoRA adapters at
runtime on TPU. The TPU worker of tpu-inference forwards `add_lora`, `remove_lora`, `list_loras` and
`pin_lora` to its model runner only since tpu-inference PR #2707 (0.23.0 lacks them, 0.32.0 has them);
without them `/v1/load_lora_adapter` fails on TPU, so the sampler would serve the base model forever.
The check reads the installed sources with `ast` instead of importing them (importing tpu_inference
initialises JAX on the TPU, which the serving process must own).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from rljob.recipes import families, quantization, syntax
from rljob.recipes.runconfig import SAMPLER_PORT, VLLM_API_KEY_ENV, RunConfig
from rljob.recipes.sampler_layout import VLLM_LORA_RANKS

# The vLLM build the TPU sampler image installs (pip install vllm-tpu==...; it pins tpu-inference==same).
VLLM_TPU_VERSION = "0.32.0"
# Model families whose LoRA punica buffers must match a power-of-two --max-num-batched-tokens
# (multimodal-architecture checkpoints; see reference/seed-code-facts.md §5, limitation 4).
# (rljob.recipes.families ``vllm_pow2_batched_tokens``)
POW2_BATCHED_TOKENS_FAMILIES: tuple[str, ...] = tuple(
    name for f in families.FAMILIES.values() for name in f.vllm_pow2_batched_tokens
)
POW2_BATCHED_TOKENS_MIN = 4096
TPU_WORKER_LORA_METHODS: tuple[str, ...] = ("add_lora", "remove_lora", "list_loras", "pin_lora")
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class SamplerConfigError(ValueError):
    """The run config cannot be served; the message names the field."""


@dataclass(frozen=True)
class VllmCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def needs_pow2_batched_tokens(model_names: list[str]) -> bool:
    names = [n.lower() for n in model_names]
    return any(fam in n for n in names for fam in POW2_BATCHED_TOKENS_FAMILIES)


def pow2_at_least(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def build_command(
    rc: RunConfig,
    *,
    port: int = SAMPLER_PORT,
    download_dir: str | None = None,
    api_key: str | None = None,
    pinned: str | None = None,
) -> VllmCommand:
    """The `vllm serve` argv and env of the sampler plan; SamplerConfigError names a bad field. ``pinned``:
    the commit the run pinned spec.model.revision to (rljob.common.revision), served in its place. With
    ``api_key`` (the run's token) the server requires `Authorization: Bearer <api_key>` on its /v1 API: vLLM
    reads `--api-key`, or VLLM_API_KEY_ENV where the flag is absent (vllm/entrypoints/openai/api_server.py;
    https://docs.vllm.ai/en/stable/usage/security/), given here in the env so that the token shows in no
    process list or log line; `/health` stays open for the readiness checks."""
    spec = rc.spec
    model = spec.model.name
    if not syntax.matches(syntax.HF_MODEL_ID, model):
        # The plan refuses it too; here it would become an argument of `vllm serve` (one starting with "-"
        # parses as a flag, e.g. --trust-remote-code).
        raise SamplerConfigError(f"spec.model.name: {model!r} {syntax.DESCRIPTIONS[syntax.HF_MODEL_ID]}")
    plan = rc.sampler
    if plan.lora_max_rank not in VLLM_LORA_RANKS:
        raise SamplerConfigError(
            f"spec.lora.rank: {plan.lora_max_rank} is not a vLLM LoRA rank (one of {list(VLLM_LORA_RANKS)})"
        )
    if plan.max_num_seqs < 1:
        raise SamplerConfigError(f"spec.sampler.maxNumSeqs: {plan.max_num_seqs} < 1")
    if plan.max_loras < 2:
        raise SamplerConfigError(
            f"spec.sampler.maxLoras: {plan.max_loras} < 2; the hot-swap loads the new version before "
            "unloading the one being served"
        )
    tp, ep, dp = plan.tensor_parallel, plan.expert_parallel, plan.data_parallel
    if min(tp, ep, dp) < 1 or tp * ep * dp != plan.tpu.devices:
        raise SamplerConfigError(
            f"spec.sampler.tensorParallel: {tp} x expertParallel {ep} x dataParallel {dp} is not the "
            f"{plan.tpu.devices} devices of one sampler slice"
        )
    if dp != 1:
        raise SamplerConfigError(
            f"spec.sampler.dataParallel: {dp}; vLLM's TPU backend serves LoRA only without data parallelism"
        )
    weights = spec.sampler.weights
    quant = quantization.get(weights.quantization)
    # bfloat16: the model itself (the plan allows no other name there); else the declared quantized checkpoint
    served, revision = (
        (model, pinned or spec.model.revision)
        if quant.vllm_method is None
        else (weights.name, weights.revision)
    )
    argv = [
        "vllm",
        "serve",
        # spec.model.name at the run's pinned commit of spec.model.revision, the weights the trainer converts
        # and trains (both roles start from the same weights, which the step-0 parity gate then checks); or
        # the quantized checkpoint of that model that spec.sampler.weights names (rljob.recipes.quantization).
        served,
        "--revision",
        revision,
        "--host",
        "127.0.0.1",  # loopback only: the pod's port is the authenticating front's (rljob.sampler.front)
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tp * ep),
        "--max-model-len",
        str(plan.max_model_len),
        "--enable-lora",
        "--max-loras",
        str(plan.max_loras),
        "--max-lora-rank",
        str(plan.lora_max_rank),
        "--max-num-seqs",
        str(plan.max_num_seqs),
        # The API name of the base model stays the Hugging Face id when the weights are served from a
        # restored local copy (the adapters keep their own versioned names).
        "--served-model-name",
        model,
    ]
    if quant.vllm_method is not None:
        # vLLM refuses a checkpoint whose quantization_config names another method
        # (vllm/config/model.py ModelConfig._verify_quantization).
        argv += ["--quantization", quant.vllm_method]
    if needs_pow2_batched_tokens([model, spec.model.maxtext_model]):
        tokens = pow2_at_least(max(POW2_BATCHED_TOKENS_MIN, plan.max_model_len))
        argv += ["--max-num-batched-tokens", str(tokens)]
    if download_dir:
        argv += ["--download-dir", download_dir]
    env = {
        RUNTIME_LORA_ENV: "True",
        # LoRA is served on tpu-inference's torch (vLLM model) path only.
        "MODEL_IMPL_TYPE": "vllm",
    }
    if api_key:
        env[VLLM_API_KEY_ENV] = api_key
    if ep > 1:
        # Expert parallelism as tpu-inference names it: its ShardingStrategy (additional_config
        # sharding.sharding_strategy) splits the replica's devices into tensor_parallelism x
        # expert_parallelism, where an explicit tensor_parallelism wins over --tensor-parallel-size (which
        # stays the replica's device count: vLLM's world size). vLLM's fused MoE layers shard by expert
        # under --enable-expert-parallel; the mesh has an expert axis only in tpu-inference's
        # NEW_MODEL_DESIGN layout (its default 2D mesh is data x model). Sources:
        # https://github.com/vllm-project/tpu-inference/blob/main/tpu_inference/layers/common/sharding.py,
        # .../tpu_inference/runner/tpu_runner.py, .../tpu_inference/layers/vllm/quantization/configs.py.
        # Not run on a TPU by rljob's tests.
        strategy = {"tensor_parallelism": tp, "expert_parallelism": ep}
        argv += [
            "--enable-expert-parallel",
            "--additional-config",
            json.dumps({"sharding": {"sharding_strategy": strategy}}, separators=(",", ":")),
        ]
        env["NEW_MODEL_DESIGN"] = "1"
    return VllmCommand(argv=argv, env=env)


def _package_dir(name: str) -> Path | None:
    # find_spec on a top-level name locates the package without executing it.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _class_methods(source: str, cls: str) -> set[str] | None:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return None


def preflight() -> str | None:
    """None if the installed vLLM can hot-swap LoRA adapters on TPU, else the reason it cannot."""
    vllm_dir = _package_dir("vllm")
    if vllm_dir is None:
        return f"vllm is not installed (the sampler image must install vllm-tpu=={VLLM_TPU_VERSION})"
    envs = vllm_dir / "envs.py"
    if not envs.is_file() or RUNTIME_LORA_ENV not in envs.read_text(encoding="utf-8"):
        return f"the installed vllm ({vllm_dir}) does not know {RUNTIME_LORA_ENV}: no runtime LoRA updating"
    tpu_dir = _package_dir("tpu_inference")
    if tpu_dir is None:
        return "tpu_inference is not installed: this vllm build has no TPU backend"
    worker = tpu_dir / "worker" / "tpu_worker.py"
    if not worker.is_file():
        return f"{worker} not found: cannot check the TPU worker's LoRA methods"
    methods = _class_methods(worker.read_text(encoding="utf-8"), "TPUWorker")
    if methods is None:
        return f"{worker} defines no TPUWorker class"
    missing = [m for m in TPU_WORKER_LORA_METHODS if m not in methods]
    if missing:
        return (
            f"tpu_inference TPUWorker lacks {', '.join(missing)} ({worker}): runtime LoRA load/unload "
            "fails on TPU (fixed by tpu-inference PR #2707; install "
            f"vllm-tpu=={VLLM_TPU_VERSION})"
        )
    return None


__all__ = [
    "POW2_BATCHED_TOKENS_MIN",
    "RUNTIME_LORA_ENV",
    "TPU_WORKER_LORA_METHODS",
    "VLLM_LORA_RANKS",
    "VLLM_TPU_VERSION",
    "SamplerConfigError",
    "VllmCommand",
    "build_command",
    "needs_pow2_batched_tokens",
    "preflight",
]
