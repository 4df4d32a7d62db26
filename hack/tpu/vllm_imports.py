"""What hack/tpu/vllm_chip.py's engine side imports: hack/tpu/vllm_bundle.sh packs the distributions
these load."""

# What the engine loads while it builds the model, its LoRA layers and its runner (imported lazily there).
import contextlib
import importlib
import pkgutil

import tpu_inference.runner.tpu_runner
import tpu_inference.worker.tpu_worker  # noqa: F401
import vllm
import vllm.model_executor.models.qwen3
import vllm.v1.engine.core
import vllm.v1.engine.llm_engine  # noqa: F401
from rljob.recipes.plan import resolve  # noqa: F401
from rljob.sampler.vllm import build_command  # noqa: F401
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.engine.arg_utils import EngineArgs  # noqa: F401
from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: F401
from vllm.lora.request import LoRARequest  # noqa: F401

for package in (
    "tpu_inference.lora",
    "tpu_inference.models.vllm",
    "tpu_inference.layers.vllm",
    "tpu_inference.layers.common",
    "tpu_inference.runner",
    "tpu_inference.worker",
    "vllm.lora",
    "vllm.model_executor.model_loader",
    "vllm.v1.sample",
    "vllm.v1.core",
):
    mod = importlib.import_module(package)
    for info in pkgutil.walk_packages(mod.__path__, package + "."):
        # a module for other hardware (CUDA kernels, ...) fails to import: not this engine's path
        with contextlib.suppress(Exception):
            importlib.import_module(info.name)
