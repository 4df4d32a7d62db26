"""`make tinker-cpu`: the Tinker API service and the CPU sampler on this machine, storage on the GCS emulator.

Starts fake-gcs-server (as `make rl-cpu` does), resolves a local RLJob with ``spec.service: {api: tinker}``
into the RunConfig a cluster would get (rljob.recipes.plan), pointed at local ports, then runs
``rljob-sampler --backend cpu`` (with its adapter agent on port + 1) and the service
(``python -m rljob.trainer.tinker.main --model tiny``) as two processes. The model is the tiny CPU model
with a byte vocabulary: a token is one UTF-8 byte (``list(text.encode())``; 256 tokens, 256 long). Once the
service answers it prints

    TINKER_BASE_URL=http://127.0.0.1:PORT
    TINKER_BASE_MODEL=rljob/tiny-qwen3

and serves until interrupted (Ctrl-C / SIGTERM), then stops both processes and the emulator. The service
runs with the local development switch ``--dev-any-key``: any ``tml-`` API key is accepted
(``TINKER_API_KEY=tml-local``), and each key still owns only what it creates. A cluster run has no such
switch: spec.service.apiKeySecret is required.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["local_service_config", "main", "service_command"]


def local_service_config(
    root: str,
    sampler_port: int,
    progress: Path,
    *,
    service: dict[str, Any] | None = None,
    toy: bool = False,
    name: str = "tinker-cpu",
) -> Any:
    """The RunConfig of a local service run: rljob.local.localrun's manifest with spec.service, local
    endpoints and progress file. ``toy``: the successor task's 32-token model instead of byte tokens."""
    import yaml
    from rljob.local.localrun import LOCAL_MANIFEST
    from rljob.recipes.plan import parse_manifest, resolve

    manifest = json.loads(json.dumps(LOCAL_MANIFEST))
    manifest["metadata"]["name"] = name
    spec = manifest["spec"]
    spec["storage"]["root"] = root
    # The plan requires a key Secret; a local run names one it never reads (the service runs with
    # --dev-any-key, service_command).
    spec["service"] = {"api": "tinker", "apiKeySecret": "tinker-local-keys", **(service or {})}
    spec["sampler"].pop("maxLoras")  # the service's default: one adapter per training client
    if not toy:
        spec.pop("dataset")
        spec["sampler"]["maxModelLen"] = 256
    rc = resolve(parse_manifest(yaml.safe_dump(manifest)))
    return rc.model_copy(
        update={
            "endpoints": rc.endpoints.model_copy(update={"samplers": [f"http://127.0.0.1:{sampler_port}"]}),
            "progress": rc.progress.model_copy(update={"config_map": None, "file": str(progress)}),
        }
    )


def service_command(cfg: Path, port: int) -> list[str]:
    """The Tinker service of a local run on the tiny CPU model."""
    module = ["-m", "rljob.trainer.tinker.main", "--config", str(cfg), "--model", "tiny", "--dev-any-key"]
    return [sys.executable, *module, "--host", "127.0.0.1", "--port", str(port)]


def main(argv: list[str] | None = None) -> int:
    from rljob.common.ports import free_port
    from rljob.local.localrun import local_storage, sampler_command

    p = argparse.ArgumentParser(prog="tinker-cpu", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=0, help="service port (default: a free one)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--toy", action="store_true", help="the toy task's 32-token model instead of bytes")
    p.add_argument("--max-clients", type=int, default=None, help="spec.service.maxTrainingClients")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tinker-cpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    gcs, env, root = local_storage(workdir)
    sampler_port = free_port(span=2)
    service = {"maxTrainingClients": args.max_clients} if args.max_clients else None
    rc = local_service_config(root, sampler_port, workdir / "progress.json", service=service, toy=args.toy)
    cfg = workdir / "run.json"
    cfg.write_text(rc.model_dump_json(indent=1))
    port = args.port or free_port()
    procs: list[subprocess.Popen[Any]] = []
    stop = threading.Event()

    def on_signal(_sig: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        with (workdir / "sampler.log").open("wb") as slog:
            procs.append(
                subprocess.Popen(sampler_command(cfg), env=env, stdout=slog, stderr=subprocess.STDOUT)
            )
        service_proc = subprocess.Popen(
            service_command(cfg, port),
            env=env,
            stdout=subprocess.PIPE,
            stderr=(workdir / "service.log").open("wb"),
            text=True,
        )
        procs.append(service_proc)
        assert service_proc.stdout is not None
        ready: dict[str, Any] = {}
        for line in service_proc.stdout:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("event") == "serving":
                ready = rec
                break
        if not ready:
            print(f"tinker-cpu: the service exited; see {workdir}/service.log", file=sys.stderr)
            return 1
        print(f"TINKER_BASE_URL={ready['url']}", flush=True)
        print(f"TINKER_BASE_MODEL={ready['base_model']}", flush=True)
        print(f"# workdir {workdir}; Ctrl-C stops the service, the sampler and the emulator", flush=True)
        while not stop.is_set():
            if any(p.poll() is not None for p in procs):
                print(f"tinker-cpu: a process exited; see {workdir}/*.log", file=sys.stderr)
                return 1
            stop.wait(0.5)
        return 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        gcs.terminate()
        gcs.wait(timeout=10)
        time.sleep(0)


if __name__ == "__main__":
    sys.exit(main())
