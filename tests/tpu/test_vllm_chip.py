"""vLLM's TPU engine against rljob's trainer on the chip: the step-0 parity gate on real hardware.

hack/tpu/vllm_chip.py in three processes that hold the chip in turn (the trainer's JAX, then vllm-tpu's, then
the trainer's): the trainer converts a full-size Qwen3-0.6B's Hugging Face files and publishes two adapters
(random factors, then what its train step made of them);
vLLM's engine, built from the argv rljob renders for examples/qwen3-0.6b-v5e-1.yaml, loads them, scores the
trainer's rows, samples, hot-swaps to the next version as the sampler does and times a batch; the trainer
scores the sampled tokens. This module never opens the chip itself (a process holding it would lock the
others out): it needs a TPU machine (a /dev/vfio or /dev/accel device) and the vLLM bundle unpacked
(``VLLM_PYTHONPATH``: ``make tpu-vllm-bundle``, hack/tpu/README.md), and runs in a pytest process of its
own (hack/tpu/run.sh).
"""

from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fixtures.chip_models import ADAPTER_EFFECT_NATS, vllm_chip_figures
from rljob.recipes.quantization import BF16_PARITY_NATS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "tpu" / "vllm_chip.py"
VLLM_SITE = os.environ.get("VLLM_PYTHONPATH", "")

pytestmark = pytest.mark.skipif(
    not (glob.glob("/dev/vfio/*") or glob.glob("/dev/accel*")) or not VLLM_SITE,
    reason="needs a TPU machine and the vLLM bundle (VLLM_PYTHONPATH; hack/tpu/README.md)",
)


def _has_tcp() -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory, record: Any) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("vllm-chip")
    base = {**os.environ, "JAX_PLATFORMS": "tpu,cpu", "PYTHONSAFEPATH": "1"}
    engine_env = {**base, "PYTHONPATH": VLLM_SITE, "SKIP_JAX_PRECOMPILE": "1"}
    if not _has_tcp():
        engine_env["RLJOB_VLLM_NO_TCP"] = "1"
    for step, env, limit in (("prepare", base, 600), ("engine", engine_env, 900), ("score", base, 600)):
        subprocess.run([sys.executable, str(SCRIPT), step, str(d)], env=env, check=True, timeout=limit)
    out = vllm_chip_figures(d)
    for row in out.values():
        record("vllm_chip", row["metric"], row["value"], **row["context"])
    return out


@pytest.mark.parametrize("adapter", ["base", "v1", "v2"])
def test_the_engine_scores_the_trainers_tokens_within_the_gate(figures: dict[str, Any], adapter: str) -> None:
    """The same rows scored by vLLM (prompt log-probs) and by the trainer's scoring program, bf16 both."""
    diff = figures[f"prompt_logprob_diff_{adapter}"]["value"]
    assert diff["mean"] < BF16_PARITY_NATS, diff


def test_each_version_moves_the_log_probs_past_the_gate(figures: dict[str, Any]) -> None:
    """The engine agreeing with the trainer within the gate says it serves a version only if the versions
    differ by more: v1 (random factors) from the base, and v2 (v1 after rljob's train steps, published as
    the loop publishes) from v1, by at least twice the gate on the trainer's side, so that an engine serving
    the base or the previous version fails the test above; and the engine's own log-probs move as much."""
    trainer = figures["adapter_effect"]["value"]
    engine = figures["adapter_effect_engine"]["value"]
    for change in ("v1_vs_base", "v2_vs_v1"):
        assert trainer[change] > ADAPTER_EFFECT_NATS, (change, trainer)
        assert engine[change] > BF16_PARITY_NATS, (change, engine)


def test_the_parity_gate_passes_on_the_sampled_tokens(figures: dict[str, Any]) -> None:
    assert figures["parity_gate_mean_abs_logprob_diff"]["value"] < BF16_PARITY_NATS


def test_the_hot_swap_leaves_only_the_next_version_loaded(figures: dict[str, Any]) -> None:
    assert figures["hot_swap_s"]["context"]["loaded"] == [2]


def test_sampling_throughput_is_measured(figures: dict[str, Any]) -> None:
    row = figures["sampling_tokens_per_s"]
    assert row["value"] > 0 and row["context"]["new_tokens"] == 32 * 128
