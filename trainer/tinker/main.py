"""The Tinker API service of an RLJob with ``spec.service.api: tinker`` (``rljob-trainer`` runs it).

Builds the run's model (the run config's MaxText keys, or with ``--model tiny`` the CPU model of
rljob.trainer.tinypolicy, shaped like the CPU sampler's), the :class:`~rljob.trainer.tinker.engine.Engine`
on the run's packed shape, restores the models of a previous attempt (rljob.trainer.tinker.server), and
serves the API on ``spec.service.port`` until SIGTERM / SIGINT. Once it answers it prints one JSON line
``{"event": "serving", "url": ..., "base_model": ..., "processes": ...}``.

A trainer of several processes (hosts; jax.distributed from the JobSet's environment, or RLJOB_NUM_PROCESSES
/ RLJOB_PROCESS_ID / RLJOB_COORDINATOR locally, as the loop mode) serves from process 0 only: every other
process builds the same Engine and runs process 0's device operations in turn
(rljob.trainer.tinker.collective), until process 0 stops.

  python -m rljob.trainer.tinker.main --config run.json --model tiny --host 127.0.0.1 --port 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import ssl
import sys
import tempfile
from typing import Any

from rljob.common.credentials import run_token
from rljob.recipes import topology
from rljob.recipes.failure import EXIT_BAD_CONFIG, EXIT_OK
from rljob.recipes.runconfig import (
    API_KEYS_ENV,
    CONFIG_ENV,
    CONFIG_PATH,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    ResolvedService,
    RunConfig,
)

__all__ = ["build", "build_engine", "follow", "main", "parser", "serve", "tls_context"]

log = logging.getLogger("rljob.trainer.tinker")


def _service(rc: RunConfig) -> ResolvedService:
    """spec.service of a service-mode run config; BadConfig without one."""
    from rljob.trainer.main import BadConfig

    if rc.spec.service is None:
        raise BadConfig("spec.service: not set; this run config runs the RL loop, not an API service")
    return rc.spec.service


def build_engine(rc: RunConfig, model: str, policy: Any = None) -> tuple[Any, Any, str]:
    """(Engine, its StepConfig, the model's arch name) of the run config (``model``: "config" or "tiny");
    raises BadConfig naming the field."""
    from rljob.trainer.main import BadConfig, model_setup, prepare_base_weights
    from rljob.trainer.model import CheckpointError, Policy
    from rljob.trainer.sync import align
    from rljob.trainer.tinker.engine import Engine
    from rljob.trainer.tinypolicy import cpu_model_spec, cpu_shape
    from rljob.trainer.train_step import StepConfig

    svc = _service(rc)
    if model == "tiny":
        lora = rc.spec.lora
        vocab, max_len = cpu_shape(rc)
        spec = cpu_model_spec(
            lora.rank, lora.alpha, checkpoint=rc.spec.model.checkpoint, vocab_size=vocab, max_len=max_len
        )
        step_cfg = StepConfig(
            budget=max_len, rows=4, micro_batches=4, segment_align=1, token_tile=32, vocab_chunk=64
        )
        arch = "tiny-qwen3"
    else:
        spec, step_cfg, _ = model_setup(rc, "config", None)
        arch = str(rc.trainer.maxtext.get("model_name", ""))
        if policy is None:
            spec = dataclasses.replace(spec, checkpoint=prepare_base_weights(rc, spec.maxtext))
    if policy is None:
        align("rljob-policy")  # the policy's first collective, with every process there (rljob.trainer.sync)
    try:
        policy = policy or Policy(spec)
    except CheckpointError as e:
        raise BadConfig(str(e)) from e
    return Engine(policy, step_cfg, max_models=svc.max_training_clients), step_cfg, arch


def follow(rc: RunConfig, model: str) -> None:
    """A process other than 0 of a multi-process trainer: run process 0's device operations until it
    stops (rljob.trainer.tinker.collective)."""
    from rljob.trainer.tinker.collective import Channel, Compute

    engine, _, _ = build_engine(rc, model)
    Compute(engine, Channel()).follow()


def build(
    rc: RunConfig,
    model: str,
    reporter: Any = None,
    policy: Any = None,
    *,
    dev_any_key: bool = False,
    api_keys: str | None = None,
    sampler_token: str | None = None,
) -> Any:
    """(Service, restored model ids) for the run config (``policy``: an already built model of the same
    spec, e.g. the one an in-process test sampler serves); raises BadConfig naming the field.

    The API fails closed: the keys come from spec.service.apiKeySecret's Secret (env API_KEYS_ENV, or
    ``api_keys``), and a value with no key, or an entry that is not one, refuses to start.
    ``dev_any_key`` (`make tinker-cpu`, tests) accepts any ``tml-`` key instead. ``sampler_token``: the
    run's token the samplers require (default: this process's, rljob.common.credentials.run_token)."""
    import jax
    from rljob.trainer.main import BadConfig
    from rljob.trainer.tinker.collective import Channel, Compute
    from rljob.trainer.tinker.server import Service, ServiceConfig, parse_api_keys

    svc = _service(rc)
    keys, problems = parse_api_keys(os.environ.get(API_KEYS_ENV, "") if api_keys is None else api_keys)
    if not dev_any_key and (problems or not keys):
        why = "; ".join(problems) or "it lists no key"
        raise BadConfig(
            f"spec.service.apiKeySecret: the Secret's key `api-keys` (env {API_KEYS_ENV}): {why}; the "
            "Tinker API accepts only the keys listed there (comma-separated, each starting with tml-)"
        )
    if dev_any_key:
        log.warning("--dev-any-key: any tml- key is accepted (local development only)")
    engine, step_cfg, arch = build_engine(rc, model, policy)
    base_model = rc.spec.model.name
    cfg = ServiceConfig(
        base_model=base_model,
        checkpoints=rc.storage.checkpoints,
        adapters=rc.storage.adapters,
        samplers=list(rc.endpoints.samplers),
        max_context=min(int(step_cfg.budget), int(rc.sampler.max_model_len)),
        arch=arch,
        tokenizer_id=None if model == "tiny" else base_model,
        checkpoint_every=svc.checkpoint_every,
        api_keys=keys,
        sampler_token=sampler_token or run_token(),
        dev_any_key=dev_any_key,
    )
    channel = Channel() if jax.process_count() > 1 else None
    service = Service(engine, cfg, reporter, Compute(engine, channel))
    restored = service.restore()
    return service, restored


def tls_context(env: Any = None) -> ssl.SSLContext | None:
    """The server's TLS context when TLS_CERT_ENV and TLS_KEY_ENV hold a PEM certificate chain and its key
    (docs/tinker.md, "Security"), else None (plain HTTP); BadConfig naming the variable when only one is
    set or they do not load. TLS 1.2 at least."""
    from rljob.trainer.main import BadConfig

    env = os.environ if env is None else env
    cert, key = env.get(TLS_CERT_ENV, ""), env.get(TLS_KEY_ENV, "")
    if not cert and not key:
        return None
    if not cert or not key:
        missing = TLS_CERT_ENV if not cert else TLS_KEY_ENV
        raise BadConfig(f"{missing}: not set; TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    with tempfile.TemporaryDirectory(prefix="rljob-tls-") as d:  # 0700: load_cert_chain reads files only
        paths = [os.path.join(d, "tls.crt"), os.path.join(d, "tls.key")]
        for path, pem in zip(paths, (cert, key), strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(pem)
        try:
            ctx.load_cert_chain(paths[0], paths[1])
        except (ssl.SSLError, ValueError) as e:
            raise BadConfig(
                f"{TLS_CERT_ENV}/{TLS_KEY_ENV}: not a PEM certificate and its key ({e})"
            ) from None
    return ctx


async def serve(
    service: Any,
    host: str,
    port: int,
    ready: Any = None,
    stop: asyncio.Event | None = None,
    tls: ssl.SSLContext | None = None,
) -> None:
    """Serve until ``stop`` is set (default: SIGTERM / SIGINT); ``ready(url)`` once listening; HTTPS with
    ``tls`` (tls_context)."""
    from aiohttp import web

    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls)
    await site.start()
    bound = runner.addresses[0][1]
    scheme = "https" if tls is not None else "http"
    url = f"{scheme}://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{bound}"
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(url)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rljob.trainer.tinker.main", description=__doc__.splitlines()[0]
    )
    p.add_argument("--config", default=os.environ.get(CONFIG_ENV, CONFIG_PATH), help="run.json path")
    p.add_argument(
        "--model", choices=["config", "tiny"], default=os.environ.get(topology.TRAINER_MODEL_ENV, "config")
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=None, help="default spec.service.port")
    p.add_argument(
        "--dev-any-key",
        action="store_true",
        help="local development only (make tinker-cpu): accept any tml- key instead of the Secret's keys",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get(topology.LOG_LEVEL_ENV, "WARNING"))
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    from rljob.trainer.main import BadConfig, distributed_env, initialize_distributed, load_config
    from rljob.trainer.progress import Reporter, sink_for

    try:
        args = parser().parse_args(argv)
    except SystemExit as e:
        return EXIT_BAD_CONFIG if e.code not in (0, None) else EXIT_OK
    try:
        rc = load_config(args.config)
        denv = distributed_env(rc)
        initialize_distributed(denv, rc.trainer.maxtext, rc.trainer)
        if denv.process_id != 0:
            follow(rc, args.model)
            return EXIT_OK
        reporter = Reporter(sink_for(rc, in_cluster="KUBERNETES_SERVICE_HOST" in os.environ))
        tls = tls_context()
        service, restored = build(rc, args.model, reporter, dev_any_key=args.dev_any_key)
    except BadConfig as e:
        print(f"rljob-trainer: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG
    port = args.port if args.port is not None else _service(rc).port

    def ready(url: str) -> None:
        line = {
            "event": "serving",
            "url": url,
            "base_model": service.cfg.base_model,
            "restored": restored,
            "processes": denv.num_processes,
        }
        print(json.dumps(line), flush=True)

    asyncio.run(serve(service, args.host, port, ready, tls=tls))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
