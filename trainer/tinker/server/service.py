"""The Tinker HTTP API (aiohttp): the route table, the middleware (the key, the body's size, how a refusal
is answered), the session routes and retrieve_future.

A refused request is a failed future on the routes whose answer is a future (the SDK raises
``RequestFailedError``), else HTTP 422; a key over a quota HTTP 429 naming the limit; a body over its
route's limit HTTP 413; sampling inputs a sampler must never see HTTP 400. Routes the service does not
serve answer 404 with a message naming them (docs/tinker.md, "The SDK's surface"); an unexpected exception
in a route that answers directly is HTTP 400, never 5xx, which the SDK retries for minutes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web
from rljob.trainer.tinker import wire
from rljob.trainer.tinker.engine import RequestError
from rljob.trainer.tinker.server.auth import OWNER, authenticate
from rljob.trainer.tinker.server.futures import POLL_S
from rljob.trainer.tinker.server.quotas import MAX_BODY, QuotaExceeded, body_limit, bounded, clip
from rljob.trainer.tinker.server.rest import RestRoutes
from tinker import types

__all__ = ["FUTURE_ROUTES", "SESSIONS_PER_KEY", "Service"]

log = logging.getLogger("rljob.trainer.tinker")

SESSIONS_PER_KEY = 1024  # live client sessions of one key (a ServiceClient is one)
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


class Service(RestRoutes):
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._auth])
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
            OWNER.set(owner)
        limit = body_limit(request.path)
        size = request.content_length or 0
        if size <= limit and request.body_exists:  # no length, or a length that may lie: what came
            size = len(await request.read())  # (at most client_max_size: aiohttp answers 413 beyond)
        if size > limit:
            msg = f"body: {size} bytes; {clip(request.path)} takes at most {limit}"
            return web.json_response({"error": msg}, status=413)
        try:
            return await handler(request)
        except QuotaExceeded as e:
            return e.response()
        except RequestError as e:
            if request.path in FUTURE_ROUTES:  # the SDK's error shape: a failed future
                return self._failed(request.path, str(e), "user")
            return web.json_response({"error": bounded(str(e))}, status=422)
        except web.HTTPException:
            raise
        except Exception as e:
            # A failure of the service answers at once: the SDK retries HTTP 5xx for minutes.
            log.error("%s %s failed:\n%s", request.method, request.path, traceback.format_exc())
            msg = f"{request.method} {request.path} failed in the service: {type(e).__name__}: {e}"
            if request.path in FUTURE_ROUTES:
                return self._failed(request.path, msg, "server")
            return web.json_response({"error": bounded(msg)}, status=400)

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
        must be one of these of the same key. Stored as an object of its own (a restart keeps it)."""
        await self._body(request, types.CreateSessionRequest)
        owner = OWNER.get()
        live = sum(1 for s in self.sessions if self.session_owner.get(s) == owner)
        if live >= SESSIONS_PER_KEY:
            raise QuotaExceeded(
                f"sessions: this API key has {live} live sessions (the service's per-key limit "
                f"{SESSIONS_PER_KEY}); end some first"
            )
        sid = f"s-{uuid.uuid4().hex}"
        self.sessions[sid] = time.monotonic()
        self.session_owner[sid] = owner
        await asyncio.to_thread(self.state.put_session, sid, owner)
        return web.json_response({"type": "create_session", "session_id": sid})

    async def heartbeat(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.SessionHeartbeatRequest)
        if req.session_id in self.finished and self.session_owner.get(req.session_id) == OWNER.get():
            return web.json_response({"error": f"session {req.session_id} has finished"}, status=410)
        self.sessions[self._own_session(req.session_id)] = time.monotonic()
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        await self._end_session(self._own_session(request.match_info["session_id"]))
        return web.json_response({})

    async def unsupported(self, request: web.Request) -> web.Response:
        msg = (
            f"{request.method} {clip(request.path)}: not supported by this Tinker service (rljob); "
            "docs/tinker.md lists what it serves"
        )
        self._pass_turn(await request.read())
        return web.json_response({"error": msg}, status=404)

    def _pass_turn(self, body: bytes) -> None:
        """A refused training call (save_weights_external) still took a seq_id of its client: pass that
        turn, or the client's next request would wait GAP_S for it. Only for a live model of this key."""
        try:
            req = json.loads(body) if body else None
        except ValueError:
            return
        if not isinstance(req, dict):
            return
        model_id, seq_id = req.get("model_id"), req.get("seq_id")
        if not (isinstance(model_id, str) and isinstance(seq_id, int) and not isinstance(seq_id, bool)):
            return
        try:
            self._own_model(model_id)
        except web.HTTPNotFound:
            return
        if seq_id >= 1 and (model_id, seq_id) not in self.dedup:
            self._spawn(self._in_turn(model_id, seq_id, lambda: None))

    # ================================================================== futures

    async def retrieve_future(self, request: web.Request) -> web.StreamResponse:
        req = await self._body(request, types.FutureRetrieveRequest)
        f = self.futures.get(req.request_id, OWNER.get())
        if f is None:
            return web.json_response(
                {"error": f"request {clip(req.request_id)} is unknown (expired, or the service restarted)"},
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
