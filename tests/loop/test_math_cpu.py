"""The production loop on a text dataset, on CPU: spec.dataset (task math) read from the GCS emulator at
its default path, the CPU sampler tokenizing the prompts (UTF-8 bytes on a 256-token tiny model),
completions graded by math-verify, the trainer training on the sampler's prompt token ids and exporting
adapters; trainer and sampler as separate processes over HTTP, as in a cluster. A missing dataset is bad
configuration: exit 2, the field named, before any model is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rljob.common.credentials import token_env
from rljob.common.ports import free_port
from rljob.common.storage import open_store
from rljob.local.localrun import local_run_config, sampler_command, trainer_command

pytestmark = [pytest.mark.jax]


TOKEN = token_env()  # the run's token, which the sampler requires and the trainer sends


def _env() -> dict[str, str]:  # after the emulator fixture has set STORAGE_EMULATOR_HOST
    return {**os.environ, "PYTHONSAFEPATH": "1", **TOKEN}


def _config(bucket: str, tmp_path: Path, port: int) -> Path:
    rc = local_run_config(
        f"gs://{bucket}",
        port,
        tmp_path / "progress.json",
        {"steps": 2, "groupSize": 2, "groupsPerBatch": 2, "maxPromptTokens": 40, "maxTokens": 8},
        dataset={"task": "math", "evalSize": 2},
    )
    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json())
    return cfg


def test_math_task_runs_end_to_end(gcs_emulator: Any, tmp_path: Path) -> None:
    bucket = gcs_emulator.new_bucket()
    problems = "".join(
        json.dumps({"question": f"{i}+{i}=?", "answer": f"#### {2 * i}"}) + "\n" for i in range(8)
    )
    open_store(f"gs://{bucket}/data").write("train.jsonl", problems.encode())  # the default spec.dataset.path
    port = free_port(span=2)
    cfg = _config(bucket, tmp_path, port)
    metrics = tmp_path / "metrics.jsonl"
    sampler = subprocess.Popen(
        sampler_command(cfg),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "sampler.log").open("ab"),
    )
    try:
        trainer = subprocess.run(
            trainer_command(cfg, metrics, "--eval-every", "2"),
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        sampler.terminate()
        sampler.wait(30)
    assert trainer.returncode == 0, trainer.stderr[-3000:] + (tmp_path / "sampler.log").read_text()[-2000:]
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    parity = next(r for r in recs if r["event"] == "parity")
    assert parity["mean_abs_logprob_diff"] < 1e-4  # on the byte-tokenized text prompts
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward_mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # 4 graded completions per step
    assert 0.0 <= steps[0]["eval_reward"] <= 1.0  # the held-out problems, graded the same way
    adapters = open_store(f"gs://{bucket}/local/rl-cpu/adapters")
    assert adapters.read("LATEST") is not None and adapters.exists("v2/adapter_model.safetensors")


def test_missing_dataset_fails_at_once(gcs_emulator: Any, tmp_path: Path) -> None:
    bucket = gcs_emulator.new_bucket()
    cfg = _config(bucket, tmp_path, free_port(span=2))
    proc = subprocess.run(
        [sys.executable, "-m", "rljob.trainer.main", "--config", str(cfg), "--model", "tiny"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"spec.dataset.path: gs://{bucket}/data/train.jsonl does not exist (upload the data there)"
    )
