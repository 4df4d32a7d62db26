"""The trainer's side of the chip tier's vLLM test (hack/tpu/vllm_chip.py ``prepare``) on the CPU: its
two-layer dry run (``RLJOB_VLLM_CHIP_CPU=1``) publishes the two adapter versions as the training loop
publishes them, v2 is what rljob's train step made of v1, and each version moves the trainer's log-probs by
more than twice the parity gate, so that the engine's agreement with a version on the chip shows it serves
that version. A failure here costs no chip time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fixtures.chip_models import ADAPTER_EFFECT_NATS, vllm_chip_figures

pytestmark = [pytest.mark.jax, pytest.mark.slow, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]


def test_prepare_publishes_a_trained_version_that_moves_the_log_probs(tmp_path: Path) -> None:
    from rljob.trainer.export import latest_version, read_adapter

    env = {**os.environ, "RLJOB_VLLM_CHIP_CPU": "1", "JAX_PLATFORMS": "cpu", "PYTHONSAFEPATH": "1"}
    env.pop("RLJOB_TPU_FIGURES", None)
    script = ROOT / "hack" / "tpu" / "vllm_chip.py"
    subprocess.run([sys.executable, str(script), "prepare", str(tmp_path)], env=env, check=True, timeout=900)
    effect = vllm_chip_figures(tmp_path)["adapter_effect"]["value"]
    for change in ("v1_vs_base", "v2_vs_v1"):
        assert effect[change] > ADAPTER_EFFECT_NATS, (change, effect)
    adapters = str(tmp_path / "adapters")
    assert latest_version(adapters) == 2
    v1, config = read_adapter(adapters, 1)
    v2, _ = read_adapter(adapters, 2)
    assert config["r"] == 16 and config["peft_type"] == "LORA"
    assert v1.keys() == v2.keys() and v1
    # v2 is v1 trained: every factor the step's gradient reaches has moved, none has jumped
    moved = [float(np.abs(v2[k] - v1[k]).max()) for k in v1]
    assert min(moved) > 0.0 and max(moved) < 1.0, (min(moved), max(moved))
    trained = np.load(tmp_path / "trainer_v2.npy")
    assert np.isfinite(trained).all()
