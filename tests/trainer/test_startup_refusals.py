"""One source of truth for "will it start": every refusal the trainer makes at start-up from a value a
manifest sets is made by ``rljob validate`` too (and so by the admission webhook, which runs the same
plan), naming the same field. Each row is a manifest change that triggers one refusal, the trainer's own
start-up check fed the same value (it must refuse, naming the field), and ``rljob validate -f`` on the
changed manifest (exit 2, that field on its own line). The trainer's checks that the plan shares call
the same recipes function (rljob.recipes.lora_targets, rljob.recipes.startup).

Not in the table, because no manifest value reaches them: the run config's path and JSON, the pod's
JOB_COMPLETION_INDEX, ``--steps``, the coordinator and sampler endpoints the plan always fills; and
what only I/O can tell, whether the base checkpoint and the dataset exist and fit (the trainer refuses
those at start with spec.model.checkpoint / spec.dataset.path).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest
import yaml
from rljob.cli.main import main as rljob
from rljob.trainer.losses import LossConfig, group_advantages
from rljob.trainer.model import ModelSpec
from rljob.trainer.packing import PackConfig
from rljob.trainer.rollouts import SamplerSource

pytestmark = pytest.mark.jax

BASE: dict[str, Any] = {
    "apiVersion": "rljob.dev/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "startup", "namespace": "default"},
    "spec": {"recipe": "qwen3-8b-v5p", "storage": {"root": "gs://rljob-test"}},
}


def _loop(group_size: int) -> None:
    SamplerSource(None, None, steps=1, group_size=group_size, groups_per_batch=1, logprobs=None)  # type: ignore[arg-type]


# (name, manifest spec change, the trainer's start-up check with the same value, field)
ROWS: list[tuple[str, dict[str, Any], Callable[[], object], str]] = [
    (
        "LoRA target unknown",
        {"lora": {"targets": ["q_proj", "qkv_proj"]}},
        lambda: ModelSpec(maxtext={"model_name": "qwen3-8b"}, lora_targets=("q_proj", "qkv_proj")),
        "spec.lora.targets",
    ),
    (
        "LoRA target the decoder lacks (gpt-oss MLP: experts only)",
        {"recipe": "gpt-oss-20b-v5p", "lora": {"targets": ["q_proj", "gate_proj"]}},
        lambda: ModelSpec(maxtext={"model_name": "gpt-oss-20b"}, lora_targets=("q_proj", "gate_proj")),
        "spec.lora.targets",
    ),
    (
        "LoRA target the decoder lacks (Qwen3 MoE MLP: routed experts only)",
        {"model": {"maxtextModel": "qwen3-30b-a3b"}, "lora": {"targets": ["q_proj", "down_proj"]}},
        lambda: ModelSpec(maxtext={"model_name": "qwen3-30b-a3b"}, lora_targets=("q_proj", "down_proj")),
        "spec.lora.targets",
    ),
    (
        "LoRA target the decoder lacks (Mixtral MLP: routed experts only)",
        {"model": {"maxtextModel": "mixtral-8x7b"}, "lora": {"targets": ["q_proj", "gate_proj"]}},
        lambda: ModelSpec(maxtext={"model_name": "mixtral-8x7b"}, lora_targets=("q_proj", "gate_proj")),
        "spec.lora.targets",
    ),
    (
        "LoRA on routed experts the trainer does not wrap (gpt-oss's)",
        {"recipe": "gpt-oss-20b-v5p", "lora": {"targets": ["q_proj", "experts"]}},
        lambda: ModelSpec(maxtext={"model_name": "gpt-oss-20b"}, lora_targets=("q_proj", "experts")),
        "spec.lora.targets",
    ),
    (
        "decoder block without an adapter export (DeepSeek V4's compressed MLA)",
        {"model": {"maxtextModel": "deepseek4-284b"}},
        lambda: ModelSpec(maxtext={"model_name": "deepseek4-284b"}),
        "spec.model.maxtextModel",
    ),
    (
        "LoRA target the decoder lacks (DeepSeek MLA: no k_proj)",
        {"model": {"maxtextModel": "deepseek3-671b"}, "lora": {"targets": ["q_a_proj", "k_proj"]}},
        lambda: ModelSpec(maxtext={"model_name": "deepseek3-671b"}, lora_targets=("q_a_proj", "k_proj")),
        "spec.lora.targets",
    ),
    (
        "DeepSeek-V3's query has a latent (q_lora_rank 1536): no q_proj",
        {"model": {"maxtextModel": "deepseek3-671b"}, "lora": {"targets": ["q_proj", "o_proj"]}},
        lambda: ModelSpec(maxtext={"model_name": "deepseek3-671b"}, lora_targets=("q_proj", "o_proj")),
        "spec.lora.targets",
    ),
    (
        "LoRA on an MLA kernel MaxText slices (use_sliced_mla_proj)",
        {
            "model": {"maxtextModel": "deepseek3-671b"},
            "lora": {"targets": ["q_b_proj", "o_proj"]},
            "trainer": {"maxtext": {"use_sliced_mla_proj": True}},
        },
        lambda: ModelSpec(
            maxtext={"model_name": "deepseek3-671b", "use_sliced_mla_proj": True},
            lora_targets=("q_b_proj", "o_proj"),
        ),
        "spec.trainer.maxtext",
    ),
    (
        "LoRA rank",
        {"lora": {"rank": 0}},
        lambda: ModelSpec(maxtext={"model_name": "qwen3-8b"}, lora_rank=0),
        "spec.lora.rank",
    ),
    ("GRPO group of one", {"algorithm": {"groupSize": 1}}, lambda: _loop(1), "spec.algorithm.groupSize"),
    (
        "KL coefficient below 0",
        {"algorithm": {"klPenaltyCoef": -0.1}},
        lambda: LossConfig(kl_coef=-0.1),
        "spec.algorithm.klPenaltyCoef",
    ),
    ("loss", {"algorithm": {"loss": "dpo"}}, lambda: LossConfig(kind="dpo"), "spec.algorithm.loss"),  # type: ignore[arg-type]
    (
        "advantage normalization",
        {"algorithm": {"advantageNormalization": "max"}},
        lambda: group_advantages(jnp.asarray([1.0, 0.0]), 2, normalization="max"),  # type: ignore[arg-type]
        "spec.algorithm.advantageNormalization",
    ),
    (
        "padAlign with padPosition end",
        {"packing": {"padAlign": 128}},
        lambda: PackConfig(budget=8192, pad_align=128),
        "spec.packing.padAlign",
    ),
    (
        "padAlign not a multiple of segmentAlign",
        {"packing": {"padPosition": "start", "segmentAlign": 64, "padAlign": 96}},
        lambda: PackConfig(budget=8192, segment_align=64, pad_position="start", pad_align=96),
        "spec.packing.padAlign",
    ),
    (
        "padAlign not below the token budget",
        {"packing": {"padPosition": "start", "padAlign": 8192, "tokenBudget": 8192}},
        lambda: PackConfig(budget=8192, pad_position="start", pad_align=8192),
        "spec.packing.padAlign",
    ),
    (
        "segmentAlign",
        {"packing": {"segmentAlign": 0}},
        lambda: PackConfig(budget=8192, segment_align=0),
        "spec.packing.segmentAlign",
    ),
]


def _field(line: str) -> str:
    """The field of a ``field: message`` line, with the ``spec.`` prefix (the trainer's packing and loss
    checks name spec fields without it)."""
    field = line.split(": ", 1)[0]
    return field if field.startswith("spec.") else f"spec.{field}"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _validate(tmp_path: Path, capsys: pytest.CaptureFixture[str], spec: dict[str, Any]) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**BASE, "spec": _merge(BASE["spec"], spec)}))
    code = rljob(["validate", "-f", str(path)])
    return code, capsys.readouterr().err


def test_the_base_manifest_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _validate(tmp_path, capsys, {}) == (0, "")


@pytest.mark.parametrize(("name", "change", "trainer", "field"), ROWS, ids=[r[0] for r in ROWS])
def test_each_startup_refusal_is_refused_by_validate_with_its_field(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    change: dict[str, Any],
    trainer: Callable[[], object],
    field: str,
) -> None:
    with pytest.raises(ValueError) as refused:  # the trainer's start-up refusal (exit 2 in the entrypoint)
        trainer()
    assert _field(str(refused.value)) == field, str(refused.value)
    code, err = _validate(tmp_path, capsys, change)
    assert code == 2, err
    fields = [_field(line) for line in err.splitlines() if ": " in line]
    assert field in fields, err
