"""The service's in-memory state and the plumbing every route shares: futures on the fair worker, the
seq_id order of a model's training requests, ownership checks, sessions' ends and the sweep, the registry.

Training requests of one model run in ``seq_id`` order (the SDK numbers them 1, 2, ... per training client
and may send them out of order), one at a time on one worker thread, which owns every JAX call
(rljob.trainer.tinker.server.worker: a queue per key, taken in turn); a request whose predecessor never
arrives runs after ``GAP_S``. A request sent twice (same model and seq_id) gets the first one's future.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from rljob.trainer.progress import Reporter
from rljob.trainer.tinker import wire
from rljob.trainer.tinker.collective import Compute
from rljob.trainer.tinker.engine import Engine, RequestError, TrainingModel
from rljob.trainer.tinker.sampling import SamplerError, SamplerPool
from rljob.trainer.tinker.server.auth import OWNER, not_found
from rljob.trainer.tinker.server.futures import Future, FutureTable
from rljob.trainer.tinker.server.quotas import VARIANTS_PER_KEY, QuotaExceeded, per_key_share
from rljob.trainer.tinker.server.state import State
from rljob.trainer.tinker.server.worker import FairWorker

__all__ = ["GAP_S", "MAX_SAMPLING_SESSIONS", "SamplingSession", "ServiceConfig", "ServiceCore"]

log = logging.getLogger("rljob.trainer.tinker")

GAP_S = 60.0  # a training request waits this long for a missing predecessor seq_id
FINISHED_TTL_S = 3600.0  # an ended session is remembered this long (its client's late heartbeat: 410)
MAX_SAMPLING_SESSIONS = 4096  # in all; each key holds its share (rljob.trainer.tinker.server.quotas)


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

    @property
    def keys(self) -> int:
        """How many keys share the pools (``dev_any_key``: one, each key may use the whole pool)."""
        return 1 if self.dev_any_key else len(self.api_keys)


@dataclasses.dataclass
class SamplingSession:
    sampler_id: str
    base_model: str
    model_path: str | None
    adapter: str | None  # name the samplers serve it under (None: the base model)
    uri: str | None  # its PEFT directory
    owner: str = ""  # the key that created it
    session: str = ""  # the client session that created it (its end drops the sampler)
    used: float = 0.0  # wall time it was created or last sampled (the key's least recently used go first)


class ServiceCore:
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
        self.state = State(cfg.checkpoints, cfg.adapters)
        self.worker = FairWorker()
        self.samplers = SamplerPool(cfg.samplers, token=cfg.sampler_token)
        self.futures = FutureTable()
        self.dedup: dict[tuple[str, int], str] = {}
        self.next_seq: dict[str, int] = {}
        self.seq_cond: asyncio.Condition | None = None
        self.sessions: dict[str, float] = {}  # live session id -> last heartbeat (monotonic)
        self.session_owner: dict[str, str] = {}  # session id -> the key (owner id) that created it
        self.finished: dict[str, float] = {}  # ended session id -> when (monotonic; pruned by the sweep)
        self.model_session: dict[str, str] = {}
        self.model_owner: dict[str, str] = {}  # model id -> owner id
        self.creating: dict[str, str] = {}  # model id -> owner id of a create or load not yet run
        self.variants: dict[str, set[Any]] = {}  # owner id -> the PPO clip settings its requests added
        self.sampling: dict[str, SamplingSession] = {}
        self.last_checkpoint_step: int | None = None
        self.started = time.time()
        self.telemetry_batches = 0
        self.last_request: dict[str, float] = {}  # model id -> wall time of its newest training request
        self._lock = threading.Lock()
        self._sampling_lock = threading.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    # ================================================================== lifecycle

    async def _start(self, _app: web.Application) -> None:
        self.seq_cond = asyncio.Condition()
        self._spawn(self._sweep())

    async def _stop(self, _app: web.Application) -> None:
        for t in list(self._tasks):
            t.cancel()
        await self.samplers.close()
        await asyncio.to_thread(self.worker.shutdown, True)
        self.compute.stop()  # the other processes of a multi-host trainer end too

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            await self.sweep_once(time.monotonic())

    async def sweep_once(self, now: float) -> None:
        """Drop old results and long-ended sessions; expire sessions without heartbeats (their training
        models are unloaded)."""
        self.futures.sweep(now)
        self.dedup = {k: v for k, v in self.dedup.items() if v in self.futures}
        for sid, ended in list(self.finished.items()):
            if now - ended > FINISHED_TTL_S:
                self.finished.pop(sid, None)
                self.session_owner.pop(sid, None)
        for sid, seen in list(self.sessions.items()):
            if now - seen > self.cfg.session_timeout_s:
                log.warning("session %s sent no heartbeat for %.0f s: ending it", sid, now - seen)
                await self._end_session(sid)

    async def _end_session(self, sid: str) -> None:
        """End a session: unload its training clients, drop its sampling sessions (their checkpoints and
        sampler weights stay, owned by the same key). Its models are collected on the worker, after every
        create or load of the session queued before the end: a create racing the end is unloaded here, one
        queued after it finds the session ended."""
        self.sessions.pop(sid, None)
        self.finished[sid] = time.monotonic()
        samplers = [k for k, v in list(self.sampling.items()) if v.session == sid]
        for k in samplers:
            self.sampling.pop(k, None)

        def work() -> None:
            gone = [m for m, s in list(self.model_session.items()) if s == sid]
            for m in gone:
                self.model_session.pop(m, None)
            self._unload(gone, samplers)
            self.state.drop_session(sid)

        await self._on_worker(work, self.session_owner.get(sid, ""))

    def _unload(self, model_ids: list[str], samplers: list[str] | None = None) -> None:
        self.compute.unload(model_ids)
        for m in model_ids:
            self.last_request.pop(m, None)
            self.model_owner.pop(m, None)
            self.next_seq.pop(m, None)
        self.state.drop_sampling(samplers or [])
        self._save_registry()

    def _check_live(self, sid: str) -> None:
        """On the worker, before a model is created in session ``sid``: refuse when it ended meanwhile."""
        if sid in self.finished or sid not in self.sessions:
            raise RequestError(f"session_id: session {sid} ended before the training client was created")

    # ================================================================== worker, futures

    async def _on_worker(self, fn: Callable[[], Any], owner: str | None = None) -> Any:
        return await asyncio.wrap_future(self.worker.submit(OWNER.get() if owner is None else owner, fn))

    def _new_future(self, kind: str, work: Callable[[], Awaitable[Any]]) -> Future:
        f = self.futures.new(kind, OWNER.get())

        async def run() -> None:
            try:
                f.result = await work()
            except (RequestError, QuotaExceeded) as e:
                f.fail(str(e), "user")
            except SamplerError as e:
                f.fail(str(e), "user" if e.user else "server")
            except Exception as e:
                log.error("%s %s failed:\n%s", kind, f.request_id, traceback.format_exc())
                f.fail(f"{type(e).__name__}: {e}", "server")
            finally:
                f.done.set()

        self._spawn(run())
        return f

    def _failed(self, kind: str, message: str, category: str) -> web.Response:
        """A request refused before its work started, as the SDK reads it: a failed future."""
        f = self.futures.new(kind, OWNER.get(), admit=False)
        f.fail(message, category)
        f.done.set()
        return self._future_response(f)

    async def _in_turn(self, model_id: str | None, seq_id: int | None, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker in the model's seq_id order (no model or seq_id: at once)."""
        assert self.seq_cond is not None
        if model_id is None or not seq_id:
            return await self._on_worker(fn)
        cond = self.seq_cond
        owner = OWNER.get()
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
            pending = asyncio.wrap_future(self.worker.submit(owner, fn))  # the key's FIFO: order kept
            self.next_seq[model_id] = max(self.next_seq.get(model_id, 1), seq_id + 1)
            cond.notify_all()
        return await pending

    async def _body(self, request: web.Request, model: type[Any]) -> Any:
        return wire.parse(model, await request.read())

    @staticmethod
    def _future_response(f: Future, **extra: Any) -> web.Response:
        return web.json_response({"request_id": f.request_id, **extra})

    def _training(
        self, kind: str, model_id: str | None, seq_id: int | None, fn: Callable[[], Any]
    ) -> web.Response:
        if model_id is not None:
            self.last_request[model_id] = time.time()
        if model_id is not None and seq_id:
            prior = self.dedup.get((model_id, seq_id))
            if prior is not None and prior in self.futures:
                return self._future_response(self.futures.futures[prior])
        f = self._new_future(kind, lambda: self._in_turn(model_id, seq_id, fn))
        if model_id is not None and seq_id:
            self.dedup[(model_id, seq_id)] = f.request_id
        return self._future_response(f)

    # ================================================================== ownership (docs/tinker.md)
    # Sessions, training models, their checkpoints and sampler weights, sampling sessions and futures belong
    # to the key that created them; to another key they do not exist (404, the same answer as an unknown id).

    def _own_session(self, sid: str | None) -> str:
        """``sid`` when the caller's key created it (server-assigned by create_session) and it is live."""
        if sid is None or sid in self.finished or self.session_owner.get(sid) != OWNER.get():
            raise not_found(f"session_id: no live session {sid} of this API key")
        return sid

    def _own_model(self, model_id: str | None) -> None:
        """404 unless ``model_id`` (None: the base model) is a live training client of the caller's key."""
        if model_id is not None and (
            model_id not in self.engine.models or self.model_owner.get(model_id) != OWNER.get()
        ):
            raise not_found(f"model_id: no training client {model_id} of this API key")

    def _run_owner(self, model_id: str, index: dict[str, Any]) -> str | None:
        """The owner of a training run: the live model's, else its checkpoints' (the index keeps it)."""
        if model_id in self.model_owner:
            return self.model_owner[model_id]
        return next((e.get("owner") for e in index.values()), None)

    def _own_index(self, model_id: str) -> dict[str, Any]:
        """A run's checkpoint index when the caller's key owns the run (worker or a thread: reads storage)."""
        index = self.state.index(model_id)
        if self._run_owner(model_id, index) != OWNER.get():
            raise not_found(f"training_run_id: no training run {model_id} of this API key")
        return index

    # ================================================================== quotas (.quotas)

    def _admit_model(self, model_id: str, owner: str) -> None:
        """Reserve a training client for ``owner`` (QuotaExceeded beyond its share of the pool). A full
        pool is left to the engine's own refusal (spec.service.maxTrainingClients)."""
        total = self.engine.max_models
        held = sum(1 for o in self.model_owner.values() if o == owner)
        held += sum(1 for m, o in self.creating.items() if o == owner and m not in self.model_owner)
        share = per_key_share(total, self.cfg.keys)
        if len(self.engine.models) + len(self.creating) < total and held >= share:
            raise QuotaExceeded(
                f"spec.service.maxTrainingClients: this API key holds {held} training clients, its share "
                f"of the service's {total} among {self.cfg.keys} keys is {share}; unload one first"
            )
        self.creating[model_id] = owner

    def _admit_variant(self, owner: str, loss: Any) -> Callable[[], None]:
        """Worker: refuse a key's PPO clip setting beyond VARIANTS_PER_KEY new ones; the returned call
        records it once the request passed."""
        mine = self.variants.setdefault(owner, set())
        if loss.kind == "ppo" and loss not in mine and len(mine) >= VARIANTS_PER_KEY:
            raise RequestError(
                f"loss_fn_config: this API key already trains {VARIANTS_PER_KEY} distinct PPO clip settings "
                "(the service's per-key limit)"
            )
        return lambda: mine.add(loss) if loss.kind == "ppo" else None

    # ================================================================== registry, progress

    def _save_registry(self) -> None:
        """Write registry.json (the live models, with their sessions and owners). The snapshot is taken and
        written under one lock, so writes land in the order of their snapshots and the last write is the
        newest state (any thread: the worker, the event loop's threads)."""
        with self._lock:
            models = {
                mid: {
                    **m.config(),
                    "session": self.model_session.get(mid),
                    "owner": self.model_owner.get(mid, ""),
                }
                for mid, m in list(self.engine.models.items())
            }
            self.state.write_registry(models)

    def restore(self) -> list[str]:
        """Re-create the stored sessions, sampling sessions and models (from their newest auto checkpoints)
        on start (worker thread or before serving). Returns the model ids restored."""
        reg = self.state.read_registry()
        now = time.monotonic()
        legacy = reg.get("sessions", {})
        for sid, owner in self.state.sessions().items():
            if sid in legacy:  # a registry of an older version listed it: an object of its own now
                self.state.put_session(sid, owner)
            self.session_owner[sid] = owner
            self.sessions[sid] = now  # its client's heartbeats go on; none for session_timeout_s ends it
        fields = {f.name for f in dataclasses.fields(SamplingSession)}
        for obj in self.state.sampling():
            s = SamplingSession(**{f: v for f, v in obj.items() if f in fields})
            self.sampling[s.sampler_id] = s
        restored = []
        for mid, c in reg.get("models", {}).items():
            directory = self.state.model_dir(mid, "auto")
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

    def _model(self, model_id: str) -> TrainingModel:
        return self.engine.model(model_id)
