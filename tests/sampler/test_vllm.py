"""The vLLM command builder and the TPU runtime-LoRA preflight.

vLLM (vllm-tpu) cannot be imported here (it needs torch and a TPU build of tpu-inference), so the built
command is checked against the option names of the pinned vllm-tpu 0.32.0, extracted from its wheel's
argument-parser sources by tests/sampler/data/extract_vllm_args.py (regenerate command in its docstring).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import recipe_manifest, resolve
from rljob.common import revision
from rljob.common.credentials import bearer, new_token, token_env
from rljob.local.localrun import local_run_config
from rljob.recipes import recipe_catalog
from rljob.recipes.runconfig import RUN_TOKEN_ENV, VLLM_API_KEY_ENV, RunConfig
from rljob.sampler import vllm

ARGS = json.loads((Path(__file__).parent / "data" / "vllm-tpu-0.32.0-serve-args.json").read_text())


def _rc(tmp_path: Path, **spec_model: str) -> RunConfig:
    rc = local_run_config("gs://bkt", 8000, tmp_path / "p.json")
    if spec_model:
        model = rc.spec.model.model_copy(update=spec_model)
        rc = rc.model_copy(update={"spec": rc.spec.model_copy(update={"model": model})})
    return rc


def _flags(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    i = 3  # vllm serve MODEL
    while i < len(argv):
        name = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if nxt is not None and not nxt.startswith("--"):
            out[name] = nxt
            i += 2
        else:
            out[name] = None
            i += 1
    return out


def test_pinned_version_matches_the_extracted_parser() -> None:
    assert ARGS["version"] == vllm.VLLM_TPU_VERSION
    assert tuple(ARGS["max_lora_ranks"]) == vllm.VLLM_LORA_RANKS
    assert ARGS["runtime_lora_env_known"] is True


@pytest.mark.parametrize(
    ("model", "maxtext", "pow2"),
    [
        ("Qwen/Qwen3-8B", "qwen3-8b", None),
        ("Qwen/Qwen3.5-27B", "qwen3.5-27b", 4096),
        ("google/gemma-4-31b-it", "gemma4-31b", 4096),
        ("rljob/tiny-qwen3", "qwen3-0.6b", None),
    ],
)
def test_command_from_plan(tmp_path: Path, model: str, maxtext: str, pow2: int | None) -> None:
    rc = _rc(tmp_path, name=model, maxtext_model=maxtext)
    cmd = vllm.build_command(rc, port=8123, download_dir="/cache/hf")
    assert cmd.argv[:3] == ["vllm", "serve", model]
    flags = _flags(cmd.argv)
    unknown = sorted(set(flags) - set(ARGS["options"]))
    assert not unknown, f"not options of vllm-tpu {ARGS['version']}: {unknown}"
    assert flags["--tensor-parallel-size"] == str(rc.sampler.tensor_parallel) == "4"  # v5p-8: 4 chips
    assert flags["--max-model-len"] == str(rc.sampler.max_model_len)
    assert "--enable-lora" in flags and flags["--enable-lora"] is None
    assert flags["--max-loras"] == str(rc.sampler.max_loras)
    assert int(flags["--max-lora-rank"] or 0) in ARGS["max_lora_ranks"]
    assert flags["--port"] == "8123" and flags["--download-dir"] == "/cache/hf"
    assert flags.get("--max-num-batched-tokens") == (str(pow2) if pow2 else None)
    assert flags["--max-num-seqs"] == str(rc.sampler.max_num_seqs) == "256"
    assert flags["--served-model-name"] == model
    assert "--seed" not in flags
    assert cmd.env[vllm.RUNTIME_LORA_ENV] == "True"
    assert VLLM_API_KEY_ENV not in cmd.env  # no token given: see the test below


def test_the_runs_token_is_vllms_api_key_in_its_env_never_its_argv(tmp_path: Path) -> None:
    """vLLM requires the run's token on its /v1 API: `--api-key` (an option of the pinned vllm-tpu's
    parser), given as VLLM_API_KEY, which vLLM reads where the flag is absent, so that the token is in no
    process list or log line."""
    token = new_token()
    cmd = vllm.build_command(_rc(tmp_path), api_key=token)
    assert "--api-key" in ARGS["options"]
    assert cmd.env[VLLM_API_KEY_ENV] == token == cmd.env["VLLM_API_KEY"]
    assert token not in " ".join(cmd.argv) and "--api-key" not in cmd.argv


def _catalog_cases() -> list[tuple[str, str | None]]:
    cases: list[tuple[str, str | None]] = []
    for name in recipe_catalog.names():
        cases.append((name, None))
        cases += [(name, p) for p in recipe_catalog.load(name).profiles]
    return cases


@pytest.mark.parametrize(("recipe", "profile"), _catalog_cases())
def test_every_catalog_recipe_serves_with_options_of_the_pinned_vllm(
    recipe: str, profile: str | None
) -> None:
    """The `vllm serve` command of every catalog recipe (and profile), as its sampler pods build it from the
    rendered run config, uses only options the pinned vllm-tpu parser defines, each once."""
    rc = resolve(recipe_manifest(recipe, profile))
    cmd = vllm.build_command(rc, download_dir="/tmp/rljob-cache/hf")
    assert not _option_problems(cmd.argv), f"{recipe}: {_option_problems(cmd.argv)}"
    flags = _flags(cmd.argv)
    assert int(flags["--max-lora-rank"] or 0) in ARGS["max_lora_ranks"]
    assert flags["--served-model-name"] == cmd.argv[2] == rc.spec.model.name


def _option_problems(argv: list[str]) -> list[str]:
    names = [a for a in argv[3:] if a.startswith("--")]
    dup = sorted({n for n in names if names.count(n) > 1})
    unknown = sorted(set(names) - set(ARGS["options"]))
    return [f"given twice: {dup}"] * bool(dup) + [f"not options of vllm {ARGS['version']}: {unknown}"] * bool(
        unknown
    )


def test_the_catalog_check_catches_unknown_and_repeated_options(tmp_path: Path) -> None:
    """Broken variants: a typo of --max-num-seqs, an option of another vLLM version, a repeated option."""
    argv = vllm.build_command(_rc(tmp_path)).argv
    assert _option_problems(argv) == []
    assert _option_problems([*argv, "--max-num-seq", "8"]) == [
        f"not options of vllm {ARGS['version']}: ['--max-num-seq']"
    ]
    assert _option_problems([*argv, "--use-v2-block-manager"])  # removed from vLLM long before 0.32
    assert _option_problems([*argv, "--max-loras", "4"]) == ["given twice: ['--max-loras']"]


@pytest.mark.parametrize("name", ["--trust-remote-code", "-x", "a b", "../models/x", "org/name/extra", ""])
def test_a_model_name_never_reaches_vllm_as_a_flag_or_path(tmp_path: Path, name: str) -> None:
    """Checked again where it becomes an argument (a run config written by hand skips the plan)."""
    with pytest.raises(vllm.SamplerConfigError, match=r"^spec\.model\.name: "):
        vllm.build_command(_rc(tmp_path, name=name))


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"lora_max_rank": 12}, "spec.lora.rank"),
        ({"max_loras": 1}, "spec.sampler.maxLoras"),
        ({"tensor_parallel": 8}, "spec.sampler.tensorParallel"),
    ],
)
def test_bad_plans_name_the_field(tmp_path: Path, update: dict[str, int], field: str) -> None:
    rc = _rc(tmp_path)
    rc = rc.model_copy(update={"sampler": rc.sampler.model_copy(update=update)})
    with pytest.raises(vllm.SamplerConfigError, match=field.replace(".", r"\.")):
        vllm.build_command(rc)


WORKER_OK = """
class WorkerBase: ...
class TPUWorker(WorkerBase):
    def add_lora(self, r): ...
    def remove_lora(self, i): ...
    def list_loras(self): ...
    def pin_lora(self, i): ...
"""


def _site(tmp: Path, *, vllm_env: bool = True, tpu: str | None = WORKER_OK) -> Path:
    (tmp / "vllm").mkdir(parents=True)
    (tmp / "vllm" / "__init__.py").write_text("raise ImportError('must not be imported by the preflight')\n")
    (tmp / "vllm" / "envs.py").write_text(
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING: bool = False\n" if vllm_env else "\n"
    )
    if tpu is not None:
        (tmp / "tpu_inference" / "worker").mkdir(parents=True)
        (tmp / "tpu_inference" / "__init__.py").write_text("raise ImportError('no TPU here')\n")
        (tmp / "tpu_inference" / "worker" / "tpu_worker.py").write_text(tpu)
    return tmp


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({}, None),
        ({"vllm_env": False}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
        ({"tpu": None}, "tpu_inference is not installed"),
        ({"tpu": WORKER_OK.replace("def pin_lora", "def pin_lora_x")}, "lacks pin_lora"),
        # tpu-inference 0.23.0: the TPU worker has no LoRA forwarders at all.
        ({"tpu": "class TPUWorker:\n    def execute_model(self): ...\n"}, "lacks add_lora, remove_lora"),
        ({"tpu": "class Worker: ...\n"}, "no TPUWorker class"),
    ],
)
def test_preflight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, object], reason: str | None
) -> None:
    site = _site(tmp_path / "site", **kwargs)  # type: ignore[arg-type]
    monkeypatch.syspath_prepend(str(site))
    got = vllm.preflight()
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


def test_preflight_without_vllm_and_sampler_exit_2(tmp_path: Path) -> None:
    assert vllm.preflight() is not None  # vLLM is not installed in the dev venv
    cfg = tmp_path / "run.json"
    cfg.write_text(_rc(tmp_path).model_dump_json())
    argv = [sys.executable, "-m", "rljob.sampler.main", "--config", str(cfg), "--backend", "vllm"]
    env = {k: v for k, v in os.environ.items() if k != RUN_TOKEN_ENV}
    # Without the run's token the sampler serves nothing (the Secret's key named), whatever the backend.
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"{RUN_TOKEN_ENV}: not set: the run's token (key token of the Secret ")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**env, **token_env()})
    assert proc.returncode == 2, proc.stderr
    assert "sampler preflight: vllm is not installed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sampler_bad_config_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "run.json"
    cfg.write_text('{"kind": "RunConfig"}')
    proc = subprocess.run(
        [sys.executable, "-m", "rljob.sampler.main", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


SHIM = """#!/usr/bin/env bash
# Stand-in for the `vllm` executable: checks what the supervisor passes, then serves the same HTTP API
# with the CPU backend on the requested --port (no watcher: the supervisor's watcher drives it). Its agent
# goes on $SHIM_STATUS_PORT, a port the test reserved: port + 1, the default, was never reserved by anyone
# (the supervisor draws the --port it passes), and one CI run found it taken.
set -eu
[ "${VLLM_ALLOW_RUNTIME_LORA_UPDATING:-}" = "True" ] || { echo "runtime LoRA env missing" >&2; exit 3; }
echo "$@" > "$ARGV_FILE"
port=""
prev=""
for a in "$@"; do
  [ "$prev" = "--port" ] && port="$a"
  prev="$a"
done
exec "$PYTHON" -m rljob.sampler.main --config "$CONFIG" --backend cpu --no-watch \
  --host 127.0.0.1 --port "$port" --status-port "$SHIM_STATUS_PORT"
"""


@pytest.mark.jax
@pytest.mark.slow
def test_vllm_supervisor_runs_the_command_and_hot_swaps(
    gcs_bucket: str, cpu_policy: Any, tmp_path: Path
) -> None:
    """The `--backend vllm` path end to end, with a stand-in `vllm` on PATH and vLLM sources that pass
    the preflight: the built argv and env reach the server, the watcher loads the published adapter
    into it over HTTP and reports the version on the status port, SIGTERM is forwarded."""
    from rljob.common.ports import free_port
    from rljob.trainer.export import publish_adapter

    site = _site(tmp_path / "site")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vllm").write_text(SHIM)
    (bindir / "vllm").chmod(0o755)
    port, status_port, shim_status_port = free_port(), free_port(), free_port()
    rc = local_run_config(gcs_bucket, port, tmp_path / "p.json")
    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json())
    publish_adapter(
        rc.storage.adapters, 0, cpu_policy.peft.to_peft(cpu_policy.lora0), cpu_policy.peft.config()
    )
    # The commit the trainer pinned for spec.model.revision (the sampler waits for it and serves it).
    commit = "0123456789abcdef0123456789abcdef01234567"
    revision.write(rc.storage.root, revision.Pinned(rc.spec.model.name, rc.spec.model.revision, commit))
    token = new_token()
    env = {
        **os.environ,
        **token_env(token),
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "PYTHONPATH": str(site),
        "PYTHONSAFEPATH": "1",
        "ARGV_FILE": str(tmp_path / "argv"),
        "PYTHON": sys.executable,
        "CONFIG": str(cfg),
        "SHIM_STATUS_PORT": str(shim_status_port),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rljob.sampler.main",
            "--config",
            str(cfg),
            "--backend",
            "vllm",
            "--status-port",
            str(status_port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "sampler.log").open("wb"),
    )
    try:
        deadline = time.monotonic() + 400
        status: dict[str, Any] = {}
        while status.get("version") != 0:
            assert proc.poll() is None, (tmp_path / "sampler.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "adapter v0 never served"
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(
                    urllib.request.Request(
                        f"http://127.0.0.1:{status_port}/rljob/v1/adapter", headers=bearer(token)
                    ),
                    timeout=2,
                ) as r,
            ):
                status = json.loads(r.read())
            time.sleep(0.5)
        models = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=bearer(token))
        with urllib.request.urlopen(models, timeout=10) as r:
            ids = [m["id"] for m in json.loads(r.read())["data"]]
        assert ids == ["rljob/tiny-qwen3", "rl-cpu-v0"]
        argv = (tmp_path / "argv").read_text().split()
        assert token not in argv
        assert argv[:2] == ["serve", "rljob/tiny-qwen3"]
        assert argv[argv.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in argv
        assert argv[argv.index("--revision") + 1] == commit
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_moe_layout_reaches_vllm_as_tpu_inference_names_it() -> None:
    """The 397B recipe: tensor 1 x expert 16 over a tpu7x-16 replica's 16 devices."""
    rc = resolve(recipe_manifest("qwen3.5-397b-a17b-tpu7x"))
    assert (rc.sampler.tensor_parallel, rc.sampler.expert_parallel, rc.sampler.data_parallel) == (1, 16, 1)
    cmd = vllm.build_command(rc)
    flags = _flags(cmd.argv)
    assert flags["--tensor-parallel-size"] == "16"  # vLLM's world size: every device of the replica
    assert "--enable-expert-parallel" in flags and "--data-parallel-size" not in flags
    assert json.loads(flags["--additional-config"] or "") == {
        "sharding": {"sharding_strategy": {"tensor_parallelism": 1, "expert_parallelism": 16}}
    }
    assert cmd.env["NEW_MODEL_DESIGN"] == "1"
    dense = vllm.build_command(resolve(recipe_manifest("qwen3-8b-v5p")))
    assert "--enable-expert-parallel" not in dense.argv and "NEW_MODEL_DESIGN" not in dense.env


@pytest.mark.parametrize(
    ("update", "message"),
    [
        (
            {"expert_parallel": 3},
            "tensorParallel: 4 x expertParallel 3 x dataParallel 1 is not the 4 devices",
        ),
        ({"tensor_parallel": 2, "data_parallel": 2}, "dataParallel: 2; vLLM's TPU backend serves LoRA only"),
    ],
)
def test_a_hand_written_layout_is_refused_where_it_becomes_arguments(
    tmp_path: Path, update: dict[str, int], message: str
) -> None:
    rc = _rc(tmp_path)
    rc = rc.model_copy(update={"sampler": rc.sampler.model_copy(update=update)})
    with pytest.raises(vllm.SamplerConfigError, match=re.escape(f"spec.sampler.{message}")):
        vllm.build_command(rc)
