"""`make rl-cpu`: the whole RL loop on this machine, trainer and sampler as separate processes over HTTP.

Starts the GCS emulator (fake-gcs-server, built by hack/build-fake-gcs-server.sh), resolves a local RLJob
manifest into the same RunConfig the renderer writes for a cluster (rljob.recipes.plan), pointed at a
local sampler port, a gs:// root on the emulator and a local progress file; then runs
`rljob-sampler --backend cpu` and the trainer loop as two processes and relays the trainer's JSON lines.
A final JSON line summarizes the run (first step with reward_mean >= 0.9 and the seconds it took).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from rljob.common.credentials import token_env
from rljob.common.ports import free_port
from rljob.local.gcs_emulator import (
    create_bucket,
    emulator_env,
    fake_gcs_server_binary,
    start_fake_gcs_server,
)
from rljob.recipes.api import API_VERSION, KIND
from rljob.recipes.plan import parse_manifest, resolve
from rljob.recipes.runconfig import RunConfig

LOCAL_MANIFEST: dict[str, Any] = {
    "apiVersion": API_VERSION,
    "kind": KIND,
    "metadata": {"name": "rl-cpu", "namespace": "local"},
    "spec": {
        "model": {"name": "rljob/tiny-qwen3", "maxtextModel": "qwen3-0.6b"},
        "trainer": {"tpu": "v5p-8"},
        "sampler": {"tpu": "v5p-8", "maxLoras": 2, "maxModelLen": 128},
        "lora": {"rank": 8, "alpha": 16},
        "algorithm": {
            "groupSize": 16,
            "groupsPerBatch": 8,
            "maxTokens": 1,
            "maxPromptTokens": 8,
            "learningRate": 0.003,
            "steps": 80,
        },
        "dataset": {"task": "successor"},
        "storage": {"root": "gs://rljob-local"},
    },
}


def start_gcs(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """fake-gcs-server on a free loopback port (rljob.local.gcs_emulator, as the tests start it)."""
    return start_fake_gcs_server(fake_gcs_server_binary(), workdir)


def local_storage(workdir: Path) -> tuple[subprocess.Popen[bytes], dict[str, str], str]:
    """The GCS emulator (its variables exported into this process too) and a fresh bucket on it:
    (emulator process, environment for child processes, ``gs://bucket``). The environment also holds a new
    run token (rljob.common.credentials), as a pod's comes from its run's Secret: the sampler requires it
    and the trainer sends it."""
    gcs, endpoint = start_gcs(workdir)
    # The CPU platform unless the caller says otherwise: the dev venv has libtpu (the compile extra), and
    # JAX would otherwise try a TPU first and log libtpu's warnings before falling back to the CPU.
    env = {
        "JAX_PLATFORMS": "cpu",
        **os.environ,
        **emulator_env(endpoint),
        "PYTHONSAFEPATH": "1",
        **token_env(),
    }
    os.environ.update({k: env[k] for k in ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT")})
    bucket = f"rljob-{uuid.uuid4().hex[:10]}"
    create_bucket(endpoint, bucket)
    return gcs, env, f"gs://{bucket}"


def local_run_config(
    root: str,
    sampler_port: int,
    progress_file: Path,
    overrides: dict[str, Any] | None = None,
    name: str = "rl-cpu",
    dataset: dict[str, Any] | None = None,
) -> RunConfig:
    """The RunConfig of a local run: the renderer's resolution, then local endpoints, storage and progress."""
    manifest = json.loads(json.dumps(LOCAL_MANIFEST))
    manifest["metadata"]["name"] = name
    manifest["spec"]["storage"]["root"] = root
    for k, v in (overrides or {}).items():
        manifest["spec"]["algorithm"][k] = v
    if dataset is not None:  # spec.dataset instead of the toy task
        manifest["spec"]["dataset"] = dataset
    rc = resolve(parse_manifest(yaml.safe_dump(manifest)))
    return rc.model_copy(
        update={
            "endpoints": rc.endpoints.model_copy(update={"samplers": [f"http://127.0.0.1:{sampler_port}"]}),
            "progress": rc.progress.model_copy(update={"config_map": None, "file": str(progress_file)}),
        }
    )


def sampler_command(cfg: Path) -> list[str]:
    """The CPU sampler of a local run (rljob-sampler's cpu backend) on a loopback port of the config."""
    module = ["-m", "rljob.sampler.main", "--config", str(cfg)]
    return [sys.executable, *module, "--backend", "cpu", "--host", "127.0.0.1"]


def trainer_command(cfg: Path, metrics: Path, *extra: str) -> list[str]:
    """The trainer loop of a local run on the tiny CPU model, its JSON lines appended to ``metrics``."""
    module = ["-m", "rljob.trainer.main", "--config", str(cfg)]
    return [sys.executable, *module, "--model", "tiny", "--log-jsonl", str(metrics), *extra]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rl-cpu", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--learning-rate", type=float, default=None, help="override spec.algorithm.learningRate")
    p.add_argument("--target", type=float, default=0.9, help="report when a step's reward_mean reaches this")
    p.add_argument("--stop-at-target", action="store_true", help="stop the run at the target")
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rl-cpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    gcs, env, root = local_storage(workdir)
    port = free_port(span=2)  # the sampler and its adapter agent
    overrides: dict[str, Any] = {"steps": args.steps}
    if args.learning_rate:
        overrides["learningRate"] = args.learning_rate
    rc = local_run_config(root, port, workdir / "progress.json", overrides)
    cfg = workdir / "run.json"
    cfg.write_text(rc.model_dump_json(indent=1))
    sampler = subprocess.Popen(
        sampler_command(cfg),
        env=env,
        stdout=(workdir / "sampler.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    t0 = time.monotonic()
    trainer_cmd = trainer_command(cfg, workdir / "metrics.jsonl")
    trainer = subprocess.Popen(trainer_cmd, env=env, stdout=subprocess.PIPE, text=True)
    first_hit: dict[str, Any] | None = None
    assert trainer.stdout is not None
    for line in trainer.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if first_hit is None and rec.get("reward_mean", 0) >= args.target:
            first_hit = {"step": rec["step"], "seconds": round(time.monotonic() - t0, 1)}
            if args.stop_at_target:
                trainer.terminate()
    rc_code = trainer.wait()
    if first_hit is not None and args.stop_at_target:
        rc_code = 0
    sampler.terminate()
    sampler.wait(timeout=30)
    gcs.terminate()
    print(
        json.dumps(
            {
                "summary": "rl-cpu",
                "exit": rc_code,
                "target": args.target,
                "first_at_target": first_hit,
                "wall_s": round(time.monotonic() - t0, 1),
                "workdir": str(workdir),
            }
        ),
        flush=True,
    )
    return rc_code


if __name__ == "__main__":
    sys.exit(main())
