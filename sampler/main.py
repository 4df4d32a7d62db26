"""`rljob-sampler --config PATH`: serve rollouts to the trainer and follow its adapter versions.

Backends:
- `vllm` (TPU, the default in a pod): preflight the installed vLLM for runtime LoRA on TPU (exit 2 with
  the reason if it cannot), wait for the commit the trainer pins a moving spec.model.revision to
  (rljob.common.revision; exit 1, a counted restart, if none appears within --revision-wait-s), run
  `vllm serve` of that commit built from the sampler plan, and hot-swap adapters into it;
- `cpu` (laptop, tests, `make rl-cpu`): the same HTTP API served by rljob.sampler.cpu_server over the
  trainer's tiny policy, with the trainer's base weights (spec.model.checkpoint when the run config names
  one; exit 2 naming the field if it is missing or does not fit). A pod of a multi-host replica
  (RLJOB_SAMPLER_HOSTS > 1: `rljob drill`) runs the replica's Ray bootstrap as on TPU, the head serving
  this backend from a stand-in for `vllm serve` that first checks every node (rljob.sampler.ray_replica).

The run's token (env RLJOB_RUN_TOKEN, from the run's credentials Secret: rljob.common.credentials) is
required: without it the sampler exits 2. Both backends listen on loopback only, behind the front on the
sampler's port (rljob.sampler.front), which requires it on every route but /health; the adapter agent
requires it on every request.

Either way an AdapterWatcher polls `{adapters}/LATEST` and loads each new version under a versioned name
(`<rljob>-v<N>`), then unloads the previous one. On the sampler's port + 1 the adapter agent loads named
adapters from storage on request (rljob.sampler.adapters.AdapterAgent; the Tinker service's saved sampler
weights). Exit codes follow contract 3 (2 = bad configuration).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlparse

from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic import ValidationError
from rljob.common import caches, revision
from rljob.common.credentials import authorized, run_token
from rljob.common.http import NO_RETRY, HttpError, shared
from rljob.common.ports import free_port
from rljob.common.storage import NoCredentials, join
from rljob.recipes import naming, quantization, topology
from rljob.recipes.failure import EXIT_BAD_CONFIG, EXIT_RESTART, NO_CREDENTIALS
from rljob.recipes.runconfig import (
    ADAPTER_AGENT_PATH,
    ADAPTER_AGENT_PORT_OFFSET,
    CONFIG_ENV,
    NAMED_ADAPTERS_DIR,
    RUN_TOKEN_ENV,
    RUN_TOKEN_SECRET_KEY,
    SAMPLER_PORT,
    RunConfig,
)
from rljob.sampler import ray_replica
from rljob.sampler.adapters import AdapterAgent, AdapterStore, AdapterWatcher, LoraEndpoint, ServerError
from rljob.sampler.front import AppThread, serve_front
from rljob.sampler.vllm import SamplerConfigError, build_command, preflight

log = logging.getLogger("rljob.sampler")


def _port_for(rc: RunConfig, replica: int) -> int:
    urls = rc.endpoints.samplers
    if 0 <= replica < len(urls):
        port = urlparse(urls[replica]).port
        if port:
            return port
    return SAMPLER_PORT


def _wait_healthy(base: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            shared().get(f"{base}/health", timeout=2, retry=NO_RETRY)
            return True
        except HttpError:
            pass
        time.sleep(1.0)
    return False


def status_app(watcher: AdapterWatcher, agent: AdapterAgent, token: str) -> web.Application:
    """GET /rljob/v1/adapter: the watcher's served version; POST ADAPTER_AGENT_PATH {name, uri}: the adapter
    agent (load a PEFT directory from storage under a name; the Tinker service's saved sampler weights).
    Every request must carry ``Authorization: Bearer <token>`` (the run's token, compared in constant time;
    401 before anything else otherwise); the agent then checks every name and uri (AdapterAgent.check: 400
    naming the field)."""
    if not token:
        raise ValueError("status_app: no token (the adapter agent never serves without one)")

    def reply(code: int, payload: Any) -> web.Response:
        return web.json_response(payload, status=code)

    @web.middleware
    async def require_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not authorized(request.headers.get("Authorization"), token):
            return reply(401, {"error": "Authorization: missing or not accepted"})
        return await handler(request)

    async def get(request: web.Request) -> web.Response:
        return reply(200 if request.path_qs == "/rljob/v1/adapter" else 404, watcher.status())

    async def post(request: web.Request) -> web.Response:
        if request.path_qs != ADAPTER_AGENT_PATH:
            return reply(404, {"error": f"no route {request.path_qs}"})
        size = request.content_length or 0
        if not 0 < size <= 64 * 1024:
            return reply(400, {"error": "body: a JSON object {name, uri} of at most 64 KiB"})
        try:
            req = json.loads(await request.read())
            name, uri = str(req["name"]), str(req["uri"])
        except (ValueError, KeyError, TypeError):
            return reply(400, {"error": "body: a JSON object {name, uri}"})
        try:
            # Downloads and a load into the server: blocking, so on a thread of the loop's pool.
            loaded = await asyncio.to_thread(agent.ensure, name, uri)
        except (ValueError, FileNotFoundError) as e:
            return reply(400, {"error": str(e)})
        except (OSError, ServerError) as e:  # storage errors are OSErrors
            return reply(502, {"error": f"{type(e).__name__}: {e}"})
        return reply(200, {"name": name, "loaded": loaded})

    app = web.Application(client_max_size=64 * 1024 + 1, middlewares=[require_token])
    app.router.add_get("/{tail:.*}", get)
    app.router.add_post("/{tail:.*}", post)
    return app


class StatusServer(AppThread):
    """:func:`status_app` served on ``host:port`` from an event loop in a thread of its own; raises OSError
    when the port is taken."""

    def __init__(
        self,
        port: int,
        watcher: AdapterWatcher,
        agent: AdapterAgent,
        host: str = "0.0.0.0",
        *,
        token: str,
    ) -> None:
        super().__init__(status_app(watcher, agent, token), host, port, "adapter-status")


def _status_server(
    port: int, watcher: AdapterWatcher, agent: AdapterAgent, token: str, host: str = "0.0.0.0"
) -> StatusServer:
    """The adapter status route and the adapter agent (:func:`status_app`) on ``port``, behind ``token``."""
    return StatusServer(port, watcher, agent, host, token=token)


def served_revision(rc: RunConfig, timeout_s: float, poll_s: float = 5.0) -> str | None:
    """The revision of spec.model.name that `vllm serve` loads: spec.model.revision where it is a commit
    hash, else the commit the trainer pinned for the run, waited for up to ``timeout_s``
    (rljob.common.revision; PinTimeout after that). None where the sampler serves the quantized checkpoint
    spec.sampler.weights names, at its own revision."""
    if quantization.get(rc.spec.sampler.weights.quantization).vllm_method is not None:
        return None
    m = rc.spec.model
    if not revision.is_commit(m.revision):
        log.warning(
            "waiting for the trainer to pin %s@%s to a commit (up to %.0f s)", m.name, m.revision, timeout_s
        )
    return revision.wait(rc.storage.root, m.name, m.revision, timeout_s=timeout_s, poll_s=poll_s)


def run_vllm(
    rc: RunConfig, watcher_for: WatcherFactory, port: int, status_port: int, revision_wait_s: float
) -> int:
    reason = preflight()
    if reason:
        print(f"sampler preflight: {reason}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        pinned = served_revision(rc, revision_wait_s)
    except revision.PinTimeout as e:  # a counted restart: the trainer may be late, or restarting
        print(str(e), file=sys.stderr, flush=True)
        return EXIT_RESTART
    # vLLM listens on loopback only; the pod's port is the front's, which requires the run's token on every
    # route but /health (rljob.sampler.front: vLLM's own key check guards /v1, /v2, /inference, /cohere).
    backend = free_port()
    try:
        cmd = build_command(
            rc,
            port=backend,
            download_dir=str(caches.local_root() / caches.HF),
            api_key=watcher_for.token,
            pinned=pinned,
        )
        layout = ray_replica.layout_from_env(os.environ)
    except (SamplerConfigError, ray_replica.BootstrapError) as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_CONFIG
    # The model download and tpu-inference's XLA cache, restored from storage.cache to local disk: on
    # every host of a replica, since each Ray worker loads its weights and compiles from its own disk (vLLM
    # copies VLLM_* variables such as VLLM_XLA_CACHE_PATH to its Ray workers). The head seeds them back.
    syncs = [
        caches.CacheSync(n, rc.storage.cache, caches.local_root()) for n in (caches.HF, caches.JAX_SAMPLER)
    ]
    for s in syncs:
        s.restore()
    env = {**os.environ, **cmd.env, "VLLM_XLA_CACHE_PATH": str(syncs[1].local)}
    if layout is not None and not layout.is_head:
        log.warning("ray worker of %s (pod %d of %d)", layout.address, layout.pod_index, layout.hosts)
        return ray_replica.run_worker(layout, env)
    replica: ray_replica.RayReplica | None = None
    if layout is not None:
        # The head: every worker joins before `vllm serve` starts (its /health covers the whole replica).
        replica = ray_replica.RayReplica(layout, env)
        replica.start_head()
        if not replica.wait_for_workers():
            replica.stop()
            return ray_replica.EXIT_REPLICA_LOST
        argv = [*cmd.argv, *ray_replica.RAY_EXECUTOR_ARGS]
        log.warning("exec on the ray head: %s", " ".join(argv))
        proc = replica.start_serve(argv, env)
    else:
        log.warning("exec: %s", " ".join(cmd.argv))
        proc = subprocess.Popen(cmd.argv, env=env)

    def forward(sig: int, _f: FrameType | None) -> None:
        proc.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    base = f"http://127.0.0.1:{backend}"
    try:
        serve_front(base, watcher_for.token, port)
    except OSError as e:  # the port is taken: a restart (exit 1, counted, retried) may find it free
        print(f"sampler: cannot listen on :{port}: {e}", file=sys.stderr, flush=True)
        proc.terminate()
        proc.wait()
        return 1
    if _wait_healthy(base, proc, timeout=3600):
        watcher = watcher_for(base)
        _status_server(status_port, watcher, watcher_for.agent(base), watcher_for.token)
        if rc.spec.service is None:  # a service run publishes no LATEST: its adapters come by name
            watcher.start()
        for s in syncs:  # seed storage with what this start downloaded and compiled
            s.start()
    code = proc.wait()
    for s in syncs:
        s.close()
    return replica.finish(code) if replica is not None else code


class WatcherFactory:
    """The adapter watcher and agent of the server at a base URL, calling it with the run's ``token``."""

    def __init__(self, rc: RunConfig, adapter_dir: Path, poll_s: float, token: str) -> None:
        self.rc, self.adapter_dir, self.poll_s, self.token = rc, adapter_dir, poll_s, token

    def agent(self, base_url: str) -> AdapterAgent:
        """The adapter agent of the server at ``base_url`` (up to spec.sampler.maxLoras adapters)."""
        allowed = join(self.rc.storage.adapters, NAMED_ADAPTERS_DIR)
        return AdapterAgent(
            LoraEndpoint(base_url, token=self.token),
            self.adapter_dir / "named",
            self.rc.sampler.max_loras,
            allowed,
        )

    def __call__(self, base_url: str) -> AdapterWatcher:
        return AdapterWatcher(
            AdapterStore(self.rc.storage.adapters),
            LoraEndpoint(base_url, token=self.token),
            self.adapter_dir,
            self.rc.name,
            poll_s=self.poll_s,
        )


def cpu_policy(rc: RunConfig, model: str = "tiny") -> Any:
    """The cpu backend's model: the CPU loop's tiny policy with the run's LoRA shape and the trainer's base
    weights (spec.model.checkpoint when the run config names one). Raises
    rljob.trainer.model.CheckpointError (``spec.model.checkpoint: ...``) if that checkpoint is missing or
    does not fit."""
    from rljob.trainer.model import Policy
    from rljob.trainer.tinypolicy import cpu_model_spec, cpu_shape, miniature_spec

    lora, checkpoint = rc.spec.lora, rc.spec.model.checkpoint
    if model == "miniature":  # rljob drill: the trainer's miniature model (one process: its default mesh)
        return Policy(miniature_spec(rc, mesh=False, checkpoint=checkpoint))
    vocab, max_len = cpu_shape(rc)
    return Policy(
        cpu_model_spec(lora.rank, lora.alpha, checkpoint=checkpoint, vocab_size=vocab, max_len=max_len)
    )


async def serve_behind_front(
    app: web.Application, token: str, host: str, port: int, backend: int
) -> tuple[web.AppRunner, AppThread]:
    """The cpu backend's ``app`` on 127.0.0.1:``backend`` and the front (rljob.sampler.front) on
    ``host:port``, as run_vllm serves vLLM: the pod's port requires the run's token on every route but
    /health. OSError (nothing left listening) when a port is taken."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", backend).start()
        front = await asyncio.to_thread(serve_front, f"http://127.0.0.1:{backend}", token, port, host)
    except OSError:
        await runner.cleanup()
        raise
    return runner, front


def run_cpu(
    rc: RunConfig,
    watcher_for: WatcherFactory,
    host: str,
    port: int,
    status_port: int,
    watch: bool = True,
    seed: int = 0,
    model: str = "tiny",
) -> int:
    # JAX's compilation cache, restored from storage.cache: a restart compiles nothing it compiled before.
    # First, before any import that may compile (JAX decides once, at its first compilation, whether a
    # persistent cache is in use).
    import jax

    sync = caches.jax_compilation_cache(
        caches.JAX_SAMPLER, rc.storage.cache, caches.local_root(), jax.config.update
    )
    from rljob.sampler.cpu_server import CpuSampler
    from rljob.trainer.model import CheckpointError

    try:
        policy = cpu_policy(rc, model)
    except CheckpointError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_CONFIG
    # As vLLM (run_vllm): the server listens on loopback only, behind the front on the pod's port.
    backend = free_port()
    base = f"http://127.0.0.1:{backend}"
    watcher = watcher_for(base)
    server = CpuSampler(
        policy, max_loras=rc.sampler.max_loras, status=watcher.status, seed=seed, token=watcher_for.token
    )

    async def serve() -> None:
        try:
            runner, front = await serve_behind_front(server.app(), watcher_for.token, host, port, backend)
            _status_server(status_port, watcher, watcher_for.agent(base), watcher_for.token, host)
        except OSError as e:  # a port is taken: a restart (exit 1, counted, retried) may find it free
            print(
                f"sampler: cannot listen on {host}:{port} and :{status_port}: {e}",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1) from None
        log.warning("CPU sampler serving on %s:%d", host, port)
        if watch and rc.spec.service is None:
            watcher.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        front.shutdown()
        await runner.cleanup()

    asyncio.run(serve())
    print(f"cache {sync.name}: {sync.close()} new files saved to {sync.uri}", file=sys.stderr, flush=True)
    return 0


def run_cpu_replica(layout: ray_replica.ReplicaLayout, argv: list[str], args: argparse.Namespace) -> int:
    """cpu backend, one pod of a multi-host replica (``rljob drill``): the pods' own Ray bootstrap
    (rljob.sampler.ray_replica.bootstrap: a worker runs its Ray node, the head the Ray head, waits for every
    worker, then the server, and exits EXIT_REPLICA_LOST once a worker is gone), the Ray nodes sized for
    one machine. The head's server is the stand-in for `vllm serve` (``ray_replica standin-serve
    --cpu-sampler``): it checks that the replica's every node is alive, with its CPU, and takes work,
    and only then serves this cpu backend (with ``argv``) in vLLM's place."""
    serve = [
        sys.executable, "-m", "rljob.sampler.ray_replica", "standin-serve", "--expect", str(layout.hosts),
        "--cpus-per-node", str(ray_replica.LOCAL_NODE_CPUS), "--cpu-sampler", "--", *argv,
    ]  # fmt: skip
    if not layout.is_head:
        log.warning("ray worker of %s (pod %d of %d)", layout.address, layout.pod_index, layout.hosts)
        return ray_replica.bootstrap(os.environ, serve, ray_args=list(ray_replica.LOCAL_RAY_ARGS))
    return ray_replica.bootstrap(
        os.environ,
        serve,
        ray_args=[*ray_replica.LOCAL_RAY_ARGS, *ray_replica.local_head_args()],
        join_timeout_s=args.ray_join_timeout_s,
        lost_grace_s=args.ray_lost_grace_s,
        poll_s=args.ray_poll_s,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rljob-sampler", description=__doc__.splitlines()[0])
    p.add_argument(
        "--config", default=os.environ.get(CONFIG_ENV), help="RunConfig JSON (default $RLJOB_CONFIG)"
    )
    p.add_argument(
        "--backend", choices=("vllm", "cpu"), default=os.environ.get(topology.SAMPLER_BACKEND_ENV, "vllm")
    )
    p.add_argument(
        "--replica",
        type=int,
        default=int(os.environ.get("JOB_INDEX", "0")),
        help="sampler replica index (JobSet job index); picks the port from endpoints.samplers",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=None)
    p.add_argument(
        "--status-port",
        type=int,
        default=None,
        help="adapter status and agent port (default port + 1, where the trainer and the tinker service "
        "look for it)",
    )
    p.add_argument("--adapter-dir", default=None, help="local directory for downloaded adapters")
    p.add_argument("--poll-s", type=float, default=0.2, help="LATEST polling interval")
    p.add_argument("--no-watch", action="store_true", help="cpu backend: serve only, no adapter watcher")
    p.add_argument(
        "--seed", type=int, default=0, help="cpu backend: the server's sampling seed (as vLLM's --seed)"
    )
    p.add_argument(
        "--model",
        choices=("tiny", "miniature"),
        default="tiny",
        help="cpu backend: the CPU loop's tiny model, or the miniature of the run's model (rljob drill)",
    )
    ray = "cpu backend, a pod of a multi-host replica (RLJOB_SAMPLER_HOSTS > 1): "
    p.add_argument(
        "--ray-join-timeout-s",
        type=float,
        default=1800.0,
        help=ray + "seconds the head waits for every worker to join",
    )
    p.add_argument(
        "--ray-lost-grace-s",
        type=float,
        default=30.0,
        help=ray + "seconds the head waits, once a worker is gone, before it exits 1",
    )
    p.add_argument("--ray-poll-s", type=float, default=2.0, help=ray + "how often the head counts the nodes")
    p.add_argument(
        "--revision-wait-s",
        type=float,
        default=3600.0,
        help="vllm backend: seconds to wait for the trainer to pin a moving spec.model.revision to a commit "
        "(rljob.common.revision) before exiting for a counted restart",
    )
    return p


def main(argv: list[str] | None = None, *, replica: bool = True) -> int:
    """rljob-sampler. ``replica`` False: serve here even where the environment describes a pod of a
    multi-host replica (the cpu backend's server on the replica's head, rljob.sampler.ray_replica)."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if not args.config:
        print("--config: no run config (pass --config or set RLJOB_CONFIG)", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        rc = RunConfig.load(args.config)
    except (OSError, ValidationError) as e:
        print(f"--config {args.config}: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        return _run(args, rc, argv, replica)
    except NoCredentials:
        print(f"rljob-sampler: {NO_CREDENTIALS}", file=sys.stderr, flush=True)
        return 1


def _run(args: argparse.Namespace, rc: RunConfig, argv: list[str], replica: bool) -> int:
    token = run_token()
    if token is None:
        print(
            f"{RUN_TOKEN_ENV}: not set: the run's token (key {RUN_TOKEN_SECRET_KEY} of the Secret "
            f"{naming.credentials_secret(rc.name)}, which the operator creates for the run) is required; the "
            "sampler serves nothing without it",
            file=sys.stderr,
        )
        return EXIT_BAD_CONFIG
    port = args.port or _port_for(rc, args.replica)
    status_port = args.status_port or port + ADAPTER_AGENT_PORT_OFFSET
    adapter_dir = Path(args.adapter_dir or tempfile.mkdtemp(prefix=f"rljob-adapters-{rc.name}-"))
    factory = WatcherFactory(rc, adapter_dir, args.poll_s, token)
    if args.backend == "cpu":
        try:
            layout = ray_replica.layout_from_env(os.environ) if replica else None
        except ray_replica.BootstrapError as e:
            print(str(e), file=sys.stderr)
            return EXIT_BAD_CONFIG
        if layout is not None:
            return run_cpu_replica(layout, argv, args)
        return run_cpu(
            rc,
            factory,
            args.host,
            port,
            status_port,
            watch=not args.no_watch,
            seed=args.seed,
            model=args.model,
        )
    return run_vllm(rc, factory, port, status_port, args.revision_wait_s)


if __name__ == "__main__":
    sys.exit(main())
