"""The one table of plain spec defaults, and their text in the API's field descriptions.

`rljob.recipes.plan` lays `DEFAULTS` under the recipe, profile and manifest (spec.service's entries only
when a layer sets spec.service); `rljob.recipes.api` writes each field's "Default N." from the same table
with `text`, so a description cannot say another value than the plan fills. Defaults derived from other
fields (spec.lora.alpha, spec.packing.tokenBudget, ...) are computed by the plan and described in words.
"""

from __future__ import annotations

import json
from typing import Any

from rljob.recipes import maxtext_keys

IMAGE_VERSION = "0.1.0"
DEFAULT_TRAINER_IMAGE = f"ghcr.io/rljob/rljob-trainer:{IMAGE_VERSION}"
DEFAULT_SAMPLER_IMAGE = f"ghcr.io/rljob/rljob-sampler:{IMAGE_VERSION}"
# pad-first rounds its shift down to the largest Splash attention block of the 397B recipe (4,096).
DEFAULT_PAD_ALIGN = 4096
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
DEFAULT_PROMPT_TEMPLATE = "{question}\nPut the final answer after ####.\n"
# bench/logprob_head_memory.py measured vocabulary chunks of 8192 best for the fused log-prob head.
DEFAULT_VOCAB_CHUNK = 8192
# spec.dataset.path when unset: {storage.root}/ this, shared by every run under the same storage root.
DEFAULT_DATASET_OBJECT = "data/train.jsonl"

# Plain defaults of the spec (camelCase, as in a manifest). "service" applies only to a spec that sets
# spec.service (rljob.recipes.spec_layers.merged_spec).
DEFAULTS: dict[str, Any] = {
    "model": {"revision": "main"},
    "trainer": {
        "slices": 1,
        "maxtextVersion": maxtext_keys.DEFAULT_VERSION,
        "image": DEFAULT_TRAINER_IMAGE,
        "logprobs": {"vocabChunk": DEFAULT_VOCAB_CHUNK},
        # A recipe whose compile needs more sets its own: Qwen3.5-397B's reached 9.3 GB (docs/drill.md).
        "preflight": {"compile": False, "cpu": "4", "memory": "8Gi"},
    },
    "sampler": {
        "replicas": 1,
        "expertParallel": 1,
        "dataParallel": 1,
        "maxLoras": 2,
        "maxNumSeqs": 256,
        "weights": {"quantization": "bfloat16"},
        "image": DEFAULT_SAMPLER_IMAGE,
    },
    "lora": {"rank": 16, "targets": DEFAULT_LORA_TARGETS},
    "algorithm": {
        "loss": "importance_sampling",
        "groupSize": 8,
        "groupsPerBatch": 16,
        "maxPromptTokens": 1024,
        "maxTokens": 2048,
        "learningRate": 1e-5,
        "steps": 100,
        "warmupSteps": 0,
        "learningRateSchedule": "constant",
        "klPenaltyCoef": 0.0,
        "advantageNormalization": "mean",
        "clipLow": 0.2,
        "clipHigh": 0.2,
        "importanceRatio": "token",
        "lossNormalization": "token",
        "overlongBuffer": 0,
        "overlongPenalty": 1.0,
        "sampling": {"temperature": 1.0, "topP": 1.0, "topK": 0, "stop": []},
    },
    "packing": {"padPosition": "end", "segmentAlign": 64, "padAlign": DEFAULT_PAD_ALIGN},
    "dataset": {"task": "math", "evalSize": 64, "promptTemplate": DEFAULT_PROMPT_TEMPLATE},
    "evaluation": {"every": 10, "passK": 1, "majK": 0},
    "service": {"port": 8080, "maxTrainingClients": 8, "checkpointEvery": 1, "clientNamespaces": []},
    "failurePolicy": {"maxRestarts": 3, "maxSamplerRestarts": 10, "maxNonFiniteSteps": 10},
    "suspend": False,
}


def value(path: str) -> Any:
    """The default of the spec field at a dotted camelCase path under spec (e.g. "lora.rank")."""
    node: Any = DEFAULTS
    for part in path.split("."):
        node = node[part]
    return node


def show(v: Any) -> str:
    """A default as a description writes it: 1e-5, 0, false, [a, b], a quoted string with whitespace."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        if v.is_integer():
            return str(int(v))
        mantissa, _, exponent = f"{v:g}".partition("e")
        return f"{mantissa}e{int(exponent)}" if exponent else mantissa
    if isinstance(v, list):
        return "[" + ", ".join(show(x) for x in v) + "]"
    if isinstance(v, str) and (not v or any(c.isspace() for c in v)):
        return json.dumps(v)
    return str(v)


def text(path: str, why: str = "") -> str:
    """The sentence "Default N." (or "Default N (why).") of the spec field at ``path``, for its
    description."""
    return f"Default {show(value(path))}" + (f" ({why})." if why else ".")


def paths(node: dict[str, Any] | None = None, prefix: str = "") -> list[str]:
    """Every leaf of DEFAULTS as a dotted camelCase path under spec."""
    out: list[str] = []
    for k, v in (DEFAULTS if node is None else node).items():
        here = f"{prefix}{k}"
        out += paths(v, here + ".") if isinstance(v, dict) else [here]
    return out


__all__ = [
    "DEFAULTS",
    "DEFAULT_DATASET_OBJECT",
    "DEFAULT_LORA_TARGETS",
    "DEFAULT_PAD_ALIGN",
    "DEFAULT_PROMPT_TEMPLATE",
    "DEFAULT_SAMPLER_IMAGE",
    "DEFAULT_TRAINER_IMAGE",
    "DEFAULT_VOCAB_CHUNK",
    "IMAGE_VERSION",
    "paths",
    "show",
    "text",
    "value",
]
