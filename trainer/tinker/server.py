"""The Tinker HTTP API (aiohttp) over an :class:`~rljob.trainer.tinker.engine.Engine` and the run's samplers.

Every request that starts work answers ``{"request_id"}`` at once (an ``UntypedAPIFuture``); the work runs
in the background and ``/api/v1/retrieve_future`` holds the poll open until it ends (at most
``POLL_S``, then ``{"type": "try_again"}``). A result is the SDK's JSON response model, or protobuf for
forward / forward_backward and sample; a refused request is ``{"error", "category": "user"}`` (the SDK
raises ``RequestFailedError``), a failure of the service ``"category": "server"``. Routes the service does
not serve answer 404 with a message naming them (docs/tinker.md, "The SDK's surface"); an unexpected
exception in a route that answers directly is HTTP 400, never 5xx, which the SDK retries for minutes.

Training requests of one model run in ``seq_id`` order (the SDK numbers them 1, 2, ... per training client
and may send them out of order), one at a time on one worker thread, which owns every JAX call; a request
whose predecessor never arrives runs after ``GAP_S``. A request sent twice (same model and seq_id) gets the
first one's future.

State on storage (``{storage.checkpoints}/tinker``; ``{model}`` is storage_key(model id), one folder per
id): ``registry.json`` (the live training models and sessions, with their owners), ``sampling/`` (one
object per sampling session), each model's newest state under ``{model}/auto`` (saved after every
``checkpoint_every`` optim steps), the named ``save_state`` checkpoints under ``{model}/weights/{name}`` and
``{model}/checkpoints.json``, the index of its save_state and sampler checkpoints that RestClient lists
(with the owner); sampler weights are PEFT directories under ``{storage.adapters}/tinker/{model}/{name}/
{digest}``, one per content. A restarted service restores the registry, the sampling sessions and each
model's newest auto checkpoint, so training clients continue where they were (futures in flight are
lost: the SDK's poll then gets 410).

Security (docs/tinker.md, "Security"): every request but healthz needs one of the run's keys
(ServiceConfig.api_keys; the service does not start without one unless ``dev_any_key``), and what a key
creates (sessions, models, checkpoints, sampler weights, sampling sessions, futures) is its own: another
key gets 404 (410 for a future).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import datetime
import hashlib
import hmac
import json
import logging
import re
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pydantic
from aiohttp import web
from rljob.common.storage import join, open_store
from rljob.recipes.runconfig import named_adapter
from rljob.trainer.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rljob.trainer.progress import Reporter
from rljob.trainer.tinker import wire
from rljob.trainer.tinker.collective import Compute
from rljob.trainer.tinker.engine import (
    LOSS_INPUTS,
    REQUIRED_INPUTS,
    AdamHP,
    Engine,
    LossSpec,
    RequestError,
    TrainingModel,
)
from rljob.trainer.tinker.sampling import SamplerError, SamplerPool
from safetensors.numpy import save as st_save
from tinker import types

__all__ = ["POLL_S", "Service", "ServiceConfig", "authenticate", "key_owner", "parse_api_keys", "storage_key"]

log = logging.getLogger("rljob.trainer.tinker")

POLL_S = 30.0  # the SDK gives up a retrieve_future poll after 45 s
GAP_S = 60.0  # a training request waits this long for a missing predecessor seq_id
RESULT_TTL_S = 300.0  # a retrieved result is kept this long (the SDK may poll again after a lost reply)
UNRETRIEVED_TTL_S = 3600.0
MAX_SAMPLES = 128
# Routes whose answer is a future: a request refused before its work starts is a failed future, which the
# SDK raises as RequestFailedError (category user), like a failure of the work itself.
FUTURE_ROUTES = frozenset(
    f"/api/v1/{r}"
    for r in (
        "create_model",
        "forward_backward",
        "optim_step",
        "save_weights",
        "save_weights_for_sampler",
        "load_weights",
        "asample",
    )
)
# A checkpoint name is one path segment: not all dots ("." and ".." would name the model's own folder,
# where a save_state with overwrite=True would first delete the automatic checkpoints).
_NAME = re.compile(r"^(?!\.+$)[A-Za-z0-9._-]{1,128}$")
CHECKPOINTS_INDEX = "checkpoints.json"  # per model, next to its weights/ and auto/: what RestClient lists
SAMPLING_DIR = "sampling"  # one object per sampling session (constant work per session, pruned)
MAX_SAMPLING_SESSIONS = 4096  # the least recently used beyond it are dropped
KEY_PREFIX = "tml-"  # the SDK sends only keys that start with it


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat()


def _int_param(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name, str(default))
    if not raw.isdigit():
        raise RequestError(f"{name}: {raw!r}; a non-negative integer")
    return int(raw)


class _WeightsInfoRequest(pydantic.BaseModel):
    tinker_path: str


def parse_api_keys(raw: str) -> tuple[frozenset[str], list[str]]:
    """The keys of the Secret's ``api-keys`` value (comma-separated) and the problems of the value, one line
    each (an entry that does not start with ``tml-``, or is ``tml-`` alone). Keys are never echoed."""
    keys, problems = set(), []
    for i, k in enumerate(x.strip() for x in raw.split(",")):
        if not k:
            continue
        if not k.startswith(KEY_PREFIX) or len(k) == len(KEY_PREFIX):
            problems.append(
                f"entry {i + 1} is not a key: it must start with {KEY_PREFIX} and go on (the SDK's rule)"
            )
            continue
        keys.add(k)
    return frozenset(keys), problems


def key_owner(key: str) -> str:
    """The owner of what a key creates: a digest of the key (the registry and indexes never hold a key)."""
    return "k-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def authenticate(key: str | None, allowed: frozenset[str], dev_any_key: bool = False) -> str | None:
    """The owner id of ``X-API-Key`` when it is accepted, else None. ``dev_any_key`` (make tinker-cpu and
    tests only) accepts any ``tml-`` key; each key still owns only what it creates."""
    if not key or not key.startswith(KEY_PREFIX) or len(key) > 512:
        return None
    if dev_any_key:
        return key_owner(key)
    ok = False
    for k in allowed:  # every key compared, each in constant time
        ok |= hmac.compare_digest(k.encode(), key.encode())
    return key_owner(key) if ok else None


# The owner id of the request being handled (set by the auth middleware; a task per request keeps it).
_OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("rljob_tinker_owner", default="")

_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")


def storage_key(model_id: str) -> str:
    """A model id as one storage path segment, one-to-one: letters, digits and '-' stay, every other byte
    is ``_xx`` (hex), '_' and '.' included, so no two ids share a folder and none is '.', '..' or has '/'."""
    return "".join(chr(b) if chr(b) in _SAFE else f"_{b:02x}" for b in model_id.encode())


_key = storage_key


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    base_model: str  # the name clients pass as base_model
    checkpoints: str  # {storage.checkpoints}
    adapters: str  # {storage.adapters}
    samplers: list[str]
    max_context: int
    arch: str = ""
    tokenizer_id: str | None = None
    checkpoint_every: int = 1
    api_keys: frozenset[str] = frozenset()  # spec.service.apiKeySecret's keys: required (fail closed)
    dev_any_key: bool = False  # make tinker-cpu and tests: any tml- key (each owns what it creates)
    session_timeout_s: float = 600.0
    max_sampling_sessions: int = MAX_SAMPLING_SESSIONS
    sampler_token: str | None = None  # the run's token, which its samplers require (rljob.common.credentials)


@dataclasses.dataclass
class _Future:
    request_id: str
    kind: str
    done: asyncio.Event
    result: Any = None  # dict (JSON) or bytes (protobuf)
    error: tuple[str, str] | None = None
    created: float = dataclasses.field(default_factory=time.monotonic)
    retrieved: float | None = None
    owner: str = ""  # the key's owner id: another key's poll gets 410, as for an unknown request


@dataclasses.dataclass
class _SamplingSession:
    sampler_id: str
    base_model: str
    model_path: str | None
    adapter: str | None  # name the samplers serve it under (None: the base model)
    uri: str | None  # its PEFT directory
    owner: str = ""  # the key that created it
    session: str = ""  # the client session that created it (its end drops the sampler)
    used: float = 0.0  # wall time it was created or last sampled (the least recently used are pruned)


class Service:
    def __init__(
        self,
        engine: Engine,
        cfg: ServiceConfig,
        reporter: Reporter | None = None,
        compute: Compute | None = None,
    ) -> None:
        if not cfg.api_keys and not cfg.dev_any_key:
            raise ValueError(
                "spec.service.apiKeySecret: no API key: the Secret's key `api-keys` must list at least one "
                "non-empty key (comma-separated, each starting with tml-); the service does not run open"
            )
        self.engine, self.cfg, self.reporter = engine, cfg, reporter
        # Every device operation goes through compute (one process: direct calls; several: each process
        # runs it, rljob.trainer.tinker.collective); self.engine is read only (the models, the policy).
        self.compute = compute or Compute(engine)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-jax")
        self.samplers = SamplerPool(cfg.samplers, token=cfg.sampler_token)
        self.futures: dict[str, _Future] = {}
        self.dedup: dict[tuple[str, int], str] = {}
        self.next_seq: dict[str, int] = {}
        self.seq_cond: asyncio.Condition | None = None
        self.sessions: dict[str, float] = {}  # session id -> last heartbeat (monotonic)
        self.session_owner: dict[str, str] = {}  # session id -> the key (owner id) that created it
        self.finished: set[str] = set()
        self.model_session: dict[str, str] = {}
        self.model_owner: dict[str, str] = {}  # model id -> owner id
        self.sampling: dict[str, _SamplingSession] = {}
        self.last_checkpoint_step: int | None = None
        self.started = time.time()
        self.telemetry_batches = 0
        self.last_request: dict[str, float] = {}  # model id -> wall time of its newest training request
        self._lock = threading.Lock()
        self._sampling_lock = threading.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    # ================================================================== plumbing

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._auth])
        r = app.router
        r.add_get("/api/v1/healthz", self.healthz)
        r.add_post("/api/v1/client/config", self.client_config)
        r.add_post("/api/v1/client/dynamic_config", self.dynamic_config)
        r.add_get("/api/v1/get_server_capabilities", self.capabilities)
        r.add_post("/api/v1/create_session", self.create_session)
        r.add_post("/api/v1/session_heartbeat", self.heartbeat)
        r.add_post("/api/v1/sessions/{session_id}/finish", self.finish_session)
        r.add_post("/api/v1/telemetry", self.telemetry)
        r.add_post("/api/v1/create_model", self.create_model)
        r.add_post("/api/v1/get_info", self.get_info)
        r.add_post("/api/v1/forward_backward", self.forward_backward)
        r.add_post("/api/v1/optim_step", self.optim_step)
        r.add_post("/api/v1/save_weights", self.save_weights)
        r.add_post("/api/v1/save_weights_for_sampler", self.save_weights_for_sampler)
        r.add_post("/api/v1/load_weights", self.load_weights)
        r.add_post("/api/v1/create_sampling_session", self.create_sampling_session)
        r.add_get("/api/v1/samplers/{sampler_id}", self.get_sampler)
        r.add_post("/api/v1/asample", self.asample)
        r.add_post("/api/v1/retrieve_future", self.retrieve_future)
        r.add_get("/api/v1/training_runs", self.list_training_runs)
        r.add_get("/api/v1/training_runs/{run_id}", self.get_training_run)
        r.add_get("/api/v1/training_runs/{run_id}/checkpoints", self.list_checkpoints)
        r.add_delete("/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}", self.delete_checkpoint)
        r.add_post("/api/v1/weights_info", self.weights_info)
        r.add_route("*", "/{tail:.*}", self.unsupported)  # last: every other route of the SDK
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path != "/api/v1/healthz":
            owner = authenticate(request.headers.get("X-API-Key"), self.cfg.api_keys, self.cfg.dev_any_key)
            if owner is None:
                return web.json_response({"error": "X-API-Key: missing or not accepted"}, status=401)
            _OWNER.set(owner)
        try:
            return await handler(request)
        except RequestError as e:
            if request.path in FUTURE_ROUTES:  # the SDK's error shape: a failed future
                return self._failed(request.path, str(e), "user")
            return web.json_response({"error": str(e)}, status=422)
        except web.HTTPException:
            raise
        except Exception as e:
            # A failure of the service answers at once: the SDK retries HTTP 5xx for minutes.
            log.error("%s %s failed:\n%s", request.method, request.path, traceback.format_exc())
            msg = f"{request.method} {request.path} failed in the service: {type(e).__name__}: {e}"
            if request.path in FUTURE_ROUTES:
                return self._failed(request.path, msg, "server")
            return web.json_response({"error": msg}, status=400)

    def _failed(self, kind: str, message: str, category: str) -> web.Response:
        f = _Future(request_id=uuid.uuid4().hex, kind=kind, done=asyncio.Event(), owner=_OWNER.get())
        f.error = (message, category)
        f.done.set()
        self.futures[f.request_id] = f
        return self._future_response(f)

    async def _start(self, _app: web.Application) -> None:
        self.seq_cond = asyncio.Condition()
        self._spawn(self._sweep())

    async def _stop(self, _app: web.Application) -> None:
        for t in list(self._tasks):
            t.cancel()
        await self.samplers.close()
        self.worker.shutdown(wait=True, cancel_futures=True)
        self.compute.stop()  # the other processes of a multi-host trainer end too

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _sweep(self) -> None:
        """Drop old results; expire sessions without heartbeats (their training models are unloaded)."""
        while True:
            await asyncio.sleep(5.0)
            now = time.monotonic()
            for rid, f in list(self.futures.items()):
                if (
                    f.retrieved is not None and now - f.retrieved > RESULT_TTL_S
                ) or now - f.created > UNRETRIEVED_TTL_S:
                    self.futures.pop(rid, None)
            self.dedup = {k: v for k, v in self.dedup.items() if v in self.futures}
            for sid, seen in list(self.sessions.items()):
                if now - seen > self.cfg.session_timeout_s:
                    log.warning("session %s sent no heartbeat for %.0f s: ending it", sid, now - seen)
                    await self._end_session(sid)

    async def _end_session(self, sid: str) -> None:
        """End a session: unload its training clients, drop its sampling sessions (their checkpoints and
        sampler weights stay, owned by the same key)."""
        self.sessions.pop(sid, None)
        self.finished.add(sid)
        gone = [m for m, s in self.model_session.items() if s == sid]
        for m in gone:
            self.model_session.pop(m, None)
        samplers = [k for k, v in list(self.sampling.items()) if v.session == sid]
        for k in samplers:
            self.sampling.pop(k, None)
        await self._on_worker(lambda: self._unload(gone, samplers))

    def _unload(self, model_ids: list[str], samplers: list[str] | None = None) -> None:
        self.compute.unload(model_ids)
        for m in model_ids:
            self.last_request.pop(m, None)
            self.model_owner.pop(m, None)
        self._drop_sampling_objects(samplers or [])
        self._save_registry()

    async def _on_worker(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn)

    def _new_future(self, kind: str, work: Callable[[], Awaitable[Any]]) -> _Future:
        f = _Future(request_id=uuid.uuid4().hex, kind=kind, done=asyncio.Event(), owner=_OWNER.get())
        self.futures[f.request_id] = f

        async def run() -> None:
            try:
                f.result = await work()
            except RequestError as e:
                f.error = (str(e), "user")
            except SamplerError as e:
                f.error = (str(e), "user" if e.user else "server")
            except Exception as e:
                log.error("%s %s failed:\n%s", kind, f.request_id, traceback.format_exc())
                f.error = (f"{type(e).__name__}: {e}", "server")
            finally:
                f.done.set()

        self._spawn(run())
        return f

    async def _in_turn(self, model_id: str | None, seq_id: int | None, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker in the model's seq_id order (no model or seq_id: at once)."""
        assert self.seq_cond is not None
        if model_id is None or not seq_id:
            return await self._on_worker(fn)
        cond = self.seq_cond
        async with cond:
            # A model created here starts at 1; one restored after a restart adopts its client's next id.
            nxt = self.next_seq.setdefault(model_id, seq_id)
            if seq_id > nxt:
                try:
                    await asyncio.wait_for(
                        cond.wait_for(lambda: self.next_seq.get(model_id, 1) >= seq_id), GAP_S
                    )
                except TimeoutError:
                    log.warning(
                        "model %s: seq_id %d waited %.0f s for its predecessor; running it",
                        model_id,
                        seq_id,
                        GAP_S,
                    )
            pending = asyncio.get_running_loop().run_in_executor(self.worker, fn)  # FIFO: order kept
            self.next_seq[model_id] = max(self.next_seq.get(model_id, 1), seq_id + 1)
            cond.notify_all()
        return await pending

    def _future_response(self, f: _Future, **extra: Any) -> web.Response:
        return web.json_response({"request_id": f.request_id, **extra})

    def _training(
        self, kind: str, model_id: str | None, seq_id: int | None, fn: Callable[[], Any]
    ) -> web.Response:
        if model_id is not None:
            self.last_request[model_id] = time.time()
        if model_id is not None and seq_id:
            prior = self.dedup.get((model_id, seq_id))
            if prior is not None and prior in self.futures:
                return self._future_response(self.futures[prior])
        f = self._new_future(kind, lambda: self._in_turn(model_id, seq_id, fn))
        if model_id is not None and seq_id:
            self.dedup[(model_id, seq_id)] = f.request_id
        return self._future_response(f)

    async def _body(self, request: web.Request, model: type[Any]) -> Any:
        return wire.parse(model, await request.read())

    # ================================================================== ownership (docs/tinker.md)
    # Sessions, training models, their checkpoints and sampler weights, sampling sessions and futures belong
    # to the key that created them; to another key they do not exist (404, the same answer as an unknown id).

    @staticmethod
    def _not_found(message: str) -> web.HTTPNotFound:
        return web.HTTPNotFound(text=json.dumps({"error": message}), content_type="application/json")

    def _own_session(self, sid: str | None) -> str:
        """``sid`` when the caller's key created it (server-assigned by create_session) and it is live."""
        if sid is None or sid in self.finished or self.session_owner.get(sid) != _OWNER.get():
            raise self._not_found(f"session_id: no live session {sid} of this API key")
        return sid

    def _own_model(self, model_id: str | None) -> None:
        """404 unless ``model_id`` (None: the base model) is a live training client of the caller's key."""
        if model_id is not None and (
            model_id not in self.engine.models or self.model_owner.get(model_id) != _OWNER.get()
        ):
            raise self._not_found(f"model_id: no training client {model_id} of this API key")

    def _run_owner(self, model_id: str, index: dict[str, Any]) -> str | None:
        """The owner of a training run: the live model's, else its checkpoints' (the index keeps it)."""
        if model_id in self.model_owner:
            return self.model_owner[model_id]
        return next((e.get("owner") for e in index.values()), None)

    def _own_index(self, model_id: str) -> dict[str, Any]:
        """A run's checkpoint index when the caller's key owns the run (worker or a thread: reads storage)."""
        index = self._index(model_id)
        if self._run_owner(model_id, index) != _OWNER.get():
            raise self._not_found(f"training_run_id: no training run {model_id} of this API key")
        return index

    # ================================================================== session routes

    async def healthz(self, _r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def client_config(self, _r: web.Request) -> web.Response:
        return web.json_response(
            {
                "pjwt_auth_enabled": False,
                "proto_compress_fwdbwd": False,
                "parallel_fwdbwd_chunks": True,
                "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False,
                "sample_join_sampling_session": False,
            }
        )

    async def dynamic_config(self, _r: web.Request) -> web.Response:
        return web.json_response({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    async def capabilities(self, _r: web.Request) -> web.Response:
        model = {
            "model_name": self.cfg.base_model,
            "max_context_length": self.cfg.max_context,
            "trainable": True,
            "sampleable": True,
        }
        return web.json_response({"supported_models": [model]})

    async def telemetry(self, _r: web.Request) -> web.Response:
        """The SDK's telemetry batches (sent while it runs and when a client closes): counted, discarded."""
        self.telemetry_batches += 1
        return web.json_response({"status": "accepted"})

    async def create_session(self, request: web.Request) -> web.Response:
        """A session id the service assigns (the SDK sends none: CreateSessionRequest has no id), owned by
        the caller's key; every id a client sends later (create_model, load_weights, sampling sessions)
        must be one of these of the same key."""
        await self._body(request, types.CreateSessionRequest)
        sid = f"s-{uuid.uuid4().hex}"
        self.sessions[sid] = time.monotonic()
        self.session_owner[sid] = _OWNER.get()
        await asyncio.to_thread(self._save_registry)  # a restart keeps the session and its owner
        return web.json_response({"type": "create_session", "session_id": sid})

    async def heartbeat(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.SessionHeartbeatRequest)
        if req.session_id in self.finished and self.session_owner.get(req.session_id) == _OWNER.get():
            return web.json_response({"error": f"session {req.session_id} has finished"}, status=410)
        self.sessions[self._own_session(req.session_id)] = time.monotonic()
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        await self._end_session(self._own_session(request.match_info["session_id"]))
        return web.json_response({})

    # ================================================================== training routes

    async def create_model(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.CreateModelRequest)
        sid = self._own_session(req.session_id)
        model_id = f"{sid}:train:{int(req.model_seq_id)}"
        owner = _OWNER.get()
        self._check_base(req.base_model)
        lc = req.lora_config
        if lc is None:
            raise RequestError("lora_config: this service trains LoRA adapters only")
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise RequestError(
                f"optimizer_config.type: {req.optimizer_config.type!r}; this service runs adamw"
            )

        def work() -> dict[str, Any]:
            m = self.compute.create(
                model_id,
                base_model=req.base_model,
                rank=lc.rank,
                seed=lc.seed,
                train_attn=lc.train_attn,
                train_mlp=lc.train_mlp,
                train_unembed=lc.train_unembed,
            )
            if lc.train_unembed:
                log.info("model %s: train_unembed is not supported (frozen output head); ignored", model_id)
            self.model_session[model_id] = sid
            self.model_owner[model_id] = owner
            self.next_seq[model_id] = 1
            self._auto_checkpoint(m, force=True)
            return {"model_id": model_id, "type": "create_model"}

        return self._training("create_model", None, None, work)

    def _check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.cfg.base_model:
            raise RequestError(f"base_model: {base_model!r}; this service serves {self.cfg.base_model!r}")

    async def get_info(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.GetInfoRequest)
        self._own_model(req.model_id)
        m = self.engine.model(req.model_id)
        return web.json_response(
            {
                "type": "get_info",
                "model_data": {
                    "arch": self.cfg.arch or None,
                    "model_name": m.base_model,
                    "tokenizer_id": self.cfg.tokenizer_id,
                },
                "model_id": m.model_id,
                "is_lora": True,
                "lora_rank": m.rank,
                "model_name": m.base_model,
            }
        )

    async def forward_backward(self, request: web.Request) -> web.Response:
        if request.headers.get("Content-Encoding", "identity") not in ("identity", ""):
            raise RequestError("Content-Encoding: compressed bodies are not accepted (client/config says so)")
        call = wire.parse_forward_backward(await request.read())
        self._own_model(call.model_id)
        backward = not call.forward_only

        def work() -> bytes:  # checked in turn: a refused request still takes its place in seq_id order
            loss = LossSpec.parse(call.loss_fn, call.loss_fn_config)
            data = wire.datums_of(call, LOSS_INPUTS[loss.kind], REQUIRED_INPUTS[loss.kind])
            total, lps = self.compute.forward(call.model_id, data, loss, backward=backward)
            weights = [
                d.weights if d.weights is not None else np.ones_like(lp)
                for d, lp in zip(data, lps, strict=True)
            ]
            return wire.forward_backward_output(loss.kind, total, lps, weights)

        return self._training("forward_backward" if backward else "forward", call.model_id, call.seq_id, work)

    async def optim_step(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.OptimStepRequest)
        self._own_model(req.model_id)

        def work() -> dict[str, Any]:
            p = req.optim_params
            if not isinstance(p, types.AdamParams):
                kind = getattr(p, "type", type(p).__name__)
                raise RequestError(f"optim_params: {kind} is not supported (AdamParams only)")
            hp = AdamHP(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
            metrics = self.compute.optim_step(req.model_id, hp)
            m = self.engine.model(req.model_id)
            self._auto_checkpoint(m)
            self._report()
            # Namespaced: a client merges these into its own metrics (the Cookbook's rows have a "step").
            return {"metrics": {f"optim/{k}": v for k, v in {**metrics, "step": float(m.step)}.items()}}

        return self._training("optim_step", req.model_id, req.seq_id, work)

    def _weights_dir(self, model_id: str, name: str) -> str:
        return join(self.cfg.checkpoints, "tinker", _key(model_id), "weights", name)

    def _parse_path(self, path: str, kind: str) -> tuple[str, str]:
        """(model id, name) of ``tinker://MODEL/{kind}/NAME``; the model id reaches storage only through
        storage_key (one path segment), the name only when it is one (_NAME: no '/', not all dots)."""
        m = re.fullmatch(rf"tinker://(?P<model>[^/]+)/{kind}/(?P<name>[A-Za-z0-9._-]+)", path)
        if not m or not _NAME.match(m.group("name")):
            raise RequestError(f"path: {path!r} is not a tinker://MODEL/{kind}/NAME path of this service")
        return m.group("model"), m.group("name")

    async def save_weights(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.SaveWeightsRequest)
        self._own_model(req.model_id)

        def work() -> dict[str, Any]:
            m = self.engine.model(req.model_id)
            name = req.path or f"step-{m.step:06d}"
            if not _NAME.match(name):
                raise RequestError(f"path: {name!r}; a checkpoint name is 1-128 of A-Z a-z 0-9 . _ -")
            path = self._save_named_state(m, name, overwrite=bool(req.overwrite), user=req.user_metadata)
            return {"path": path, "type": "save_weights"}

        return self._training("save_weights", req.model_id, req.seq_id, work)

    def _save_named_state(
        self, m: TrainingModel, name: str, *, overwrite: bool, user: dict[str, Any] | None
    ) -> str:
        """save_state(name): write the new state, then switch to it. orbax commits a step atomically
        (rljob.trainer.checkpoint); the new state is the next step in the name's folder and the old step
        is removed only once the new one committed (max_to_keep 1), and the index is written after, so a
        kill at any point leaves the name's old or new state whole and the index never lists a name whose
        folder holds no committed state."""
        directory = self._weights_dir(m.model_id, name)
        meta = {"config": m.config(), "optim_steps": m.step, "user_metadata": user or {}}
        exists = None if overwrite else f"path: checkpoint {name!r} exists (pass overwrite=True)"
        self.compute.save_state(m.model_id, directory, meta, max_to_keep=1, exists=exists)
        path = f"tinker://{m.model_id}/weights/{name}"
        self._index_put(m, f"weights/{name}", path)
        return path

    def _restore_state(self, directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.compute.restore(directory)  # one process only (tests): not an operation

    def _auto_checkpoint(self, m: TrainingModel, force: bool = False) -> None:
        """Save ``m``'s automatic checkpoint when its step is due (``force``: now). Automatic checkpoints
        are numbered by save, not by optimizer step (that is in their metadata): a state loaded into a
        live client is saved as the newest even when its step is older than, or equal to, one already
        saved, with no window in which the client has no checkpoint; a restart restores the newest."""
        every = self.cfg.checkpoint_every
        if force or (every > 0 and m.step % every == 0):
            directory = join(self.cfg.checkpoints, "tinker", _key(m.model_id), "auto")
            meta = {"config": m.config(), "optim_steps": m.step, "skipped": m.skipped}
            self.compute.save_state(m.model_id, directory, meta, max_to_keep=2, exists=None)
            self.last_checkpoint_step = m.step
        if force:  # a new or reloaded model: the registry changed
            self._save_registry()

    async def load_weights(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.LoadWeightsRequest)
        src_model, name = self._parse_path(req.path, "weights")
        await asyncio.to_thread(self._own_index, src_model)  # another key's checkpoint: 404
        directory = self._weights_dir(src_model, name)
        self._check_base(req.base_model)
        owner = _OWNER.get()
        if req.session_id is not None:  # create-via-load: a new training client
            sid = self._own_session(req.session_id)
            if req.model_seq_id is None:
                raise RequestError("model_seq_id: required with session_id")
            model_id = f"{sid}:train:{int(req.model_seq_id)}"
            seq = None
        else:
            if req.model_id is None:
                raise RequestError(
                    "load_weights: needs model_id (with seq_id) or session_id (with model_seq_id)"
                )
            self._own_model(req.model_id)
            model_id, seq = req.model_id, req.seq_id

        def work() -> dict[str, Any]:
            new = req.session_id is not None
            self.compute.load_state(model_id, directory, new=new, optimizer=req.optimizer, path=req.path)
            if new:
                self.model_session[model_id] = sid
                self.model_owner[model_id] = owner
                self.next_seq[model_id] = 1
            m = self.engine.model(model_id)
            # The loaded state becomes the client's newest automatic checkpoint: a restart restores it.
            self._auto_checkpoint(m, force=True)
            return {"path": req.path, "model_id": model_id, "type": "load_weights"}

        return self._training("load_weights", model_id if seq else None, seq, work)

    # ================================================================== sampling

    def _sampler_dir(self, model_id: str, name: str) -> str:
        """The folder of a name's sampler weights; each saved version is a PEFT directory below it."""
        return join(self.cfg.adapters, "tinker", _key(model_id), name)

    def _sampler_version(self, entry: dict[str, Any], model_id: str, name: str) -> tuple[str, str]:
        """(PEFT directory, adapter name) of an index entry of sampler weights (an entry written before
        versions existed: the name's folder itself)."""
        uri = str(entry.get("uri") or self._sampler_dir(model_id, name))
        return uri, named_adapter(uri)

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.SaveWeightsForSamplerRequest)
        if req.path is None and req.sampling_session_seq_id is None:
            raise RequestError("save_weights_for_sampler: needs path or sampling_session_seq_id")
        self._own_model(req.model_id)
        session = self.model_session.get(req.model_id, "s-unknown")
        owner = _OWNER.get()

        def work() -> dict[str, Any]:
            m = self.engine.model(req.model_id)
            name = req.path or f"ephemeral-{m.step:06d}-{uuid.uuid4().hex[:8]}"
            if not _NAME.match(name):
                raise RequestError(f"path: {name!r}; a name is 1-128 of A-Z a-z 0-9 . _ -")
            path, uri, adapter = self._save_sampler_weights(m, name)
            if req.path is not None:
                return {"path": path, "type": "save_weights_for_sampler"}
            sid = f"{session}:sample:{req.sampling_session_seq_id}:{uuid.uuid4().hex[:6]}"
            self._add_sampling(_SamplingSession(sid, m.base_model, path, adapter, uri, owner, session))
            return {"sampling_session_id": sid, "type": "save_weights_for_sampler"}

        return self._training("save_weights_for_sampler", req.model_id, req.seq_id, work)

    def _save_sampler_weights(self, m: TrainingModel, name: str) -> tuple[str, str, str]:
        """(tinker path, PEFT directory, adapter name) of the model's sampler weights saved as ``name``.
        Each content is a version of its own (``{name}/{digest}``, served under the digest of that
        directory): a re-save under one name is a new directory and a new adapter name, so samplers load
        the new weights, never the one they cached under the old name. Written whole first, then the index
        switches to it, then the old version is removed and the name's sampling sessions follow."""
        tensors = self.compute.peft(m.model_id)
        weights = st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()})
        cfg = {**self.engine.policy.peft.config(), "base_model_name_or_path": m.base_model}
        config = json.dumps(cfg, indent=1, sort_keys=True).encode()
        digest = hashlib.sha256(hashlib.sha256(weights).digest() + config).hexdigest()[:20]
        path = f"tinker://{m.model_id}/sampler_weights/{name}"
        uri = join(self._sampler_dir(m.model_id, name), digest)
        store = open_store(uri)
        store.write(ADAPTER_WEIGHTS, weights)
        store.write(ADAPTER_CONFIG, config)
        adapter = named_adapter(uri)
        self.compute.cache_lora(adapter, m.model_id)
        cid = f"sampler_weights/{name}"
        old = self._index(m.model_id).get(cid)
        self._index_put(m, cid, path, uri=uri)
        if old is not None:
            old_uri, old_adapter = self._sampler_version(old, m.model_id, name)
            if old_uri != uri:
                self.compute.forget_lora(old_adapter)
                old_store = open_store(old_uri)
                for k in old_store.list():
                    if "/" not in k:  # the version's own files, never a newer version below a legacy folder
                        old_store.delete(k)
        for s in [s for s in list(self.sampling.values()) if s.model_path == path and s.uri != uri]:
            self._add_sampling(dataclasses.replace(s, uri=uri, adapter=adapter))
        return path, uri, adapter

    async def create_sampling_session(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.CreateSamplingSessionRequest)
        session = self._own_session(req.session_id)
        sid = f"{session}:sample:{int(req.sampling_session_seq_id)}:{uuid.uuid4().hex[:6]}"
        s = await self._session_for(sid, req.model_path, req.base_model)
        await asyncio.to_thread(self._add_sampling, dataclasses.replace(s, session=session))
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": sid})

    def _sampling_store(self) -> Any:
        return open_store(join(self.cfg.checkpoints, "tinker", SAMPLING_DIR))

    def _add_sampling(self, s: _SamplingSession) -> None:
        """Keep (and persist, one object each) a sampling session; beyond ``max_sampling_sessions`` the
        least recently used are dropped (thread or worker: writes storage)."""
        s.used = time.time()
        with self._sampling_lock:  # the worker (save_weights_for_sampler) and request threads add at once
            self.sampling[s.sampler_id] = s
            extra = len(self.sampling) - self.cfg.max_sampling_sessions
            oldest = sorted(self.sampling.values(), key=lambda x: x.used)[: max(extra, 0)]
            for o in oldest:
                self.sampling.pop(o.sampler_id, None)
        self._sampling_store().write(f"{_key(s.sampler_id)}.json", json.dumps(dataclasses.asdict(s)).encode())
        self._drop_sampling_objects([o.sampler_id for o in oldest])

    def _drop_sampling_objects(self, sids: list[str]) -> None:
        if sids:
            store = self._sampling_store()
            for sid in sids:
                store.delete(f"{_key(sid)}.json")

    async def _session_for(
        self, sid: str, model_path: str | None, base_model: str | None
    ) -> _SamplingSession:
        owner = _OWNER.get()
        if model_path is None:
            self._check_base(base_model or self.cfg.base_model)
            return _SamplingSession(sid, self.cfg.base_model, None, None, None, owner)
        model_id, name = self._parse_path(model_path, "sampler_weights")
        index = await asyncio.to_thread(self._own_index, model_id)  # another key's weights: 404
        entry = index.get(f"sampler_weights/{name}")
        if entry is None:
            raise RequestError(f"model_path: no sampler weights at {model_path}")
        uri, adapter = self._sampler_version(entry, model_id, name)
        exists = await asyncio.to_thread(lambda: open_store(uri).exists(ADAPTER_CONFIG))
        if not exists:
            raise RequestError(f"model_path: no sampler weights at {model_path}")
        return _SamplingSession(sid, self.cfg.base_model, model_path, adapter, uri, owner)

    async def get_sampler(self, request: web.Request) -> web.Response:
        s = self.sampling.get(request.match_info["sampler_id"])
        if s is None or s.owner != _OWNER.get():
            return web.json_response({"error": "no such sampler"}, status=404)
        return web.json_response(
            {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}
        )

    async def asample(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.SampleRequest)
        unsupported = [
            name
            for name, on in (
                ("topk_prompt_logprobs", req.topk_prompt_logprobs > 0),
                ("topk_sample_logprobs", req.topk_sample_logprobs > 0),
                ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                ("prompt_alt_tokens_k", req.prompt_alt_tokens_k > 0),
                ("record_stability_info", bool(req.record_stability_info)),
            )
            if on
        ]
        if req.sampling_session_id is not None:
            session = self.sampling.get(req.sampling_session_id)
            if session is None or session.owner != _OWNER.get():
                raise self._not_found(
                    f"sampling_session_id: {req.sampling_session_id} is not a sampler of this API key"
                )
            session.used = time.time()
        else:
            session = await self._session_for("direct", req.model_path, req.base_model)
        prompt = wire.tokens_of(req.prompt, "prompt")
        n = int(req.num_samples)
        sp = req.sampling_params
        f = self._new_future("sample", lambda: self._sample(session, prompt, n, sp, req, unsupported))
        return self._future_response(f, sample_sequence_ids=[f"{f.request_id}-{i}" for i in range(max(n, 0))])

    async def _sample(
        self, s: _SamplingSession, prompt: np.ndarray, n: int, sp: Any, req: Any, unsupported: list[str]
    ) -> bytes:
        if unsupported:
            raise RequestError(f"{unsupported[0]}: not supported by this server")
        if not 1 <= n <= MAX_SAMPLES:
            raise RequestError(f"num_samples: {n}; 1..{MAX_SAMPLES}")
        if prompt.size == 0 or prompt.size >= self.cfg.max_context:
            raise RequestError(f"prompt: {prompt.size} tokens; 1..{self.cfg.max_context - 1} fit the model")
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.cfg.max_context - int(prompt.size)
        if not 1 <= max_tokens <= self.cfg.max_context - prompt.size:
            raise RequestError(
                f"sampling_params.max_tokens: {max_tokens}; prompt + max_tokens must fit "
                f"{self.cfg.max_context}"
            )
        params: dict[str, Any] = {"max_tokens": int(max_tokens), "temperature": float(sp.temperature)}
        if sp.top_p != 1:
            params["top_p"] = float(sp.top_p)
        if sp.top_k not in (-1, 0):
            params["top_k"] = int(sp.top_k)
        if sp.seed is not None:
            params["seed"] = int(sp.seed)
        stop = sp.stop
        if isinstance(stop, str):
            params["stop"] = [stop]
        elif stop is not None and len(stop) and all(isinstance(x, int) for x in stop):
            params["stop_token_ids"] = [int(x) for x in stop]
        elif stop is not None and len(stop):
            params["stop"] = [str(x) for x in stop]
        model = s.adapter or s.base_model
        comps = await self.samplers.complete(
            [int(t) for t in prompt], n=n, params=params, model=model, adapter_uri=s.uri
        )
        plp = None
        if req.prompt_logprobs:
            plp = await self._prompt_logprobs(s, prompt, req.prompt_logprobs_last_n)
        return wire.sample_response([(c.tokens, c.logprobs, c.stop_reason) for c in comps], plp)

    async def _prompt_logprobs(
        self, s: _SamplingSession, prompt: np.ndarray, last_n: int | None
    ) -> np.ndarray:
        """Prompt log-probs computed on the training chips (the numerics training uses), NaN at 0."""
        if last_n is not None and not 1 <= last_n <= prompt.size - 1:
            raise RequestError(f"prompt_logprobs_last_n: {last_n}; 1..{prompt.size - 1}")

        def work() -> np.ndarray:
            out = np.full(prompt.size, np.nan, np.float32)
            if prompt.size > 1:
                out[1:] = self.compute.prompt_logprobs(s.adapter, s.uri, s.model_path, prompt)
            if last_n is not None:
                out[: prompt.size - last_n] = np.nan
            return out

        result: np.ndarray = await self._on_worker(work)
        return result

    # ================================================================== REST: training runs, checkpoints

    def _index_store(self, model_id: str) -> Any:
        return open_store(join(self.cfg.checkpoints, "tinker", _key(model_id)))

    def _index(self, model_id: str) -> dict[str, Any]:
        """``{checkpoint_id: entry}`` of a model's save_state and sampler weights (CHECKPOINTS_INDEX)."""
        raw = self._index_store(model_id).read(CHECKPOINTS_INDEX)
        return json.loads(raw) if raw else {}

    def _index_put(self, m: TrainingModel, checkpoint_id: str, path: str, uri: str | None = None) -> None:
        """Record a saved checkpoint (worker thread: saves and deletes of a model never race), with the
        run's owner (what decides who may list, load, sample and delete it after the run ended) and, for
        sampler weights, the version's directory."""
        index = self._index(m.model_id)
        kind = "training" if checkpoint_id.startswith("weights/") else "sampler"
        index[checkpoint_id] = {
            "checkpoint_id": checkpoint_id,
            "checkpoint_type": kind,
            "time": time.time(),
            "tinker_path": path,
            "config": m.config(),
            "owner": self.model_owner.get(m.model_id, ""),
            **({"uri": uri} if uri else {}),
        }
        self._index_store(m.model_id).write(CHECKPOINTS_INDEX, json.dumps(index, indent=1).encode())

    @staticmethod
    def _checkpoint_view(e: dict[str, Any]) -> dict[str, Any]:
        return {
            "checkpoint_id": e["checkpoint_id"],
            "checkpoint_type": e["checkpoint_type"],
            "time": _iso(e["time"]),
            "tinker_path": e["tinker_path"],
        }

    def _run_view(self, m: TrainingModel) -> dict[str, Any]:
        index = sorted(self._index(m.model_id).values(), key=lambda e: e["time"])
        newest = {e["checkpoint_type"]: self._checkpoint_view(e) for e in index}
        return {
            "training_run_id": m.model_id,
            "base_model": m.base_model,
            "model_owner": self.model_session.get(m.model_id, ""),
            "is_lora": True,
            "lora_rank": m.rank,
            "last_request_time": _iso(self.last_request.get(m.model_id, self.started)),
            "last_checkpoint": newest.get("training"),
            "last_sampler_checkpoint": newest.get("sampler"),
        }

    async def list_training_runs(self, request: web.Request) -> web.Response:
        """The live training clients (created or loaded, not ended), by id."""
        limit, offset = _int_param(request, "limit", 20), _int_param(request, "offset", 0)
        owner = _OWNER.get()
        ids = sorted(i for i in self.engine.models if self.model_owner.get(i) == owner)
        models = [self.engine.models[i] for i in ids[offset : offset + limit]]
        runs = await asyncio.to_thread(lambda: [self._run_view(m) for m in models])
        cursor = {"offset": offset, "limit": limit, "total_count": len(ids)}
        return web.json_response({"training_runs": runs, "cursor": cursor})

    def _live(self, request: web.Request) -> TrainingModel:
        run_id = request.match_info["run_id"]
        m = self.engine.models.get(run_id)
        if m is None or self.model_owner.get(run_id) != _OWNER.get():
            raise self._not_found(f"training_run_id: no live training client {run_id} of this API key")
        return m

    async def get_training_run(self, request: web.Request) -> web.Response:
        m = self._live(request)
        return web.json_response(await asyncio.to_thread(self._run_view, m))

    async def list_checkpoints(self, request: web.Request) -> web.Response:
        """A run's save_state checkpoints and sampler weights, oldest first (also of an ended run)."""
        run_id = request.match_info["run_id"]
        index = await asyncio.to_thread(self._own_index, run_id)
        entries = sorted(index.values(), key=lambda e: e["time"])
        return web.json_response({"checkpoints": [self._checkpoint_view(e) for e in entries]})

    async def delete_checkpoint(self, request: web.Request) -> web.Response:
        run_id, kind, name = (request.match_info[k] for k in ("run_id", "kind", "name"))
        checkpoint_id = f"{kind}/{name}"
        await asyncio.to_thread(self._own_index, run_id)  # another key's run: 404

        def work() -> bool:
            index = self._index(run_id)
            if (
                checkpoint_id not in index
                or kind not in ("weights", "sampler_weights")
                or not _NAME.match(name)
            ):
                return False
            if kind == "weights":
                store = open_store(self._weights_dir(run_id, name))
            else:
                store = open_store(self._sampler_dir(run_id, name))  # every version
                self.compute.forget_lora(self._sampler_version(index[checkpoint_id], run_id, name)[1])
            for k in store.list():
                store.delete(k)
            del index[checkpoint_id]
            self._index_store(run_id).write(CHECKPOINTS_INDEX, json.dumps(index, indent=1).encode())
            return True

        if not await self._on_worker(work):
            msg = f"checkpoint_id: {run_id} has no checkpoint {checkpoint_id} on this service"
            return web.json_response({"error": msg}, status=404)
        return web.json_response({})

    async def weights_info(self, request: web.Request) -> web.Response:
        body = await self._body(request, _WeightsInfoRequest)
        m = re.fullmatch(r"tinker://(?P<run>[^/]+)/(?P<id>(weights|sampler_weights)/[^/]+)", body.tinker_path)
        if not m:
            raise RequestError(f"tinker_path: {body.tinker_path!r} is not a checkpoint path of this service")
        entry = (await asyncio.to_thread(self._own_index, m.group("run"))).get(m.group("id"))
        if entry is None:
            return web.json_response({"error": f"tinker_path: no checkpoint {body.tinker_path}"}, status=404)
        c = entry["config"]
        return web.json_response(
            {
                "base_model": c["base_model"],
                "is_lora": True,
                "lora_rank": c["rank"],
                "train_unembed": False,  # the output head stays frozen (docs/tinker.md)
                "train_mlp": c["train_mlp"],
                "train_attn": c["train_attn"],
            }
        )

    async def unsupported(self, request: web.Request) -> web.Response:
        msg = (
            f"{request.method} {request.path}: not supported by this Tinker service (rljob); "
            "docs/tinker.md lists what it serves"
        )
        return web.json_response({"error": msg}, status=404)

    # ================================================================== futures

    async def retrieve_future(self, request: web.Request) -> web.StreamResponse:
        req = await self._body(request, types.FutureRetrieveRequest)
        f = self.futures.get(req.request_id)
        if f is None or f.owner != _OWNER.get():
            return web.json_response(
                {"error": f"request {req.request_id} is unknown (expired, or the service restarted)"},
                status=410,
            )
        try:
            await asyncio.wait_for(f.done.wait(), POLL_S)
        except TimeoutError:
            return web.json_response(
                {"type": "try_again", "request_id": f.request_id, "queue_state": "active"}
            )
        f.retrieved = f.retrieved or time.monotonic()
        if f.error is not None:
            return web.json_response(wire.error_body(*f.error))
        if isinstance(f.result, bytes):
            return web.Response(body=f.result, content_type=wire.PROTO_CONTENT_TYPE)
        return web.json_response(f.result)

    # ================================================================== registry, progress

    def _registry_store(self) -> Any:
        return open_store(join(self.cfg.checkpoints, "tinker"))

    def _save_registry(self) -> None:
        """Write registry.json (the live models and sessions, with their owners). The snapshot is taken and
        written under one lock, so writes land in the order of their snapshots and the last write is the
        newest state (any thread: the worker, the event loop's threads)."""
        with self._lock:
            reg = {
                "models": {
                    mid: {
                        **m.config(),
                        "session": self.model_session.get(mid),
                        "owner": self.model_owner.get(mid, ""),
                    }
                    for mid, m in list(self.engine.models.items())
                },
                "sessions": {
                    sid: owner for sid, owner in list(self.session_owner.items()) if sid in self.sessions
                },
            }
            self._registry_store().write("registry.json", json.dumps(reg, indent=1).encode())

    def restore(self) -> list[str]:
        """Re-create the registry's sessions, sampling sessions and models (from their newest auto
        checkpoints) on start (worker thread or before serving). Returns the model ids restored."""
        raw = self._registry_store().read("registry.json")
        reg = json.loads(raw) if raw is not None else {}
        now = time.monotonic()
        for sid, owner in reg.get("sessions", {}).items():
            self.session_owner[sid] = owner
            self.sessions[sid] = now  # its client's heartbeats go on; none for session_timeout_s ends it
        fields = {f.name for f in dataclasses.fields(_SamplingSession)}
        store = self._sampling_store()
        for k in store.list():
            body = store.read(k)
            if body is not None:
                s = _SamplingSession(**{f: v for f, v in json.loads(body).items() if f in fields})
                self.sampling[s.sampler_id] = s
        restored = []
        for mid, c in reg.get("models", {}).items():
            directory = join(self.cfg.checkpoints, "tinker", _key(mid), "auto")
            try:
                self.compute.load_state(mid, directory, new=True, optimizer=True, registry=c)
            except RequestError as e:
                log.warning("model %s: not restored: %s", mid, e)
                continue
            self.model_owner[mid] = str(c.get("owner", ""))
            if c.get("session"):
                self.model_session[mid] = c["session"]
                self.sessions.setdefault(c["session"], now)
            restored.append(mid)
        return restored

    def _report(self) -> None:
        if self.reporter is None:
            return
        steps = sum(m.step for m in self.engine.models.values())
        self.reporter.update(step=steps, last_checkpoint_step=self.last_checkpoint_step)
