"""Training routes: create_model, get_info, forward / forward_backward, optim_step, save_weights (save_state),
load_weights, and the automatic checkpoints of every training client."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import numpy as np
from aiohttp import web
from rljob.trainer.tinker import wire
from rljob.trainer.tinker.engine import (
    LOSS_INPUTS,
    REQUIRED_INPUTS,
    AdamHP,
    LossSpec,
    RequestError,
    TrainingModel,
)
from rljob.trainer.tinker.server.auth import OWNER
from rljob.trainer.tinker.server.core import ServiceCore
from rljob.trainer.tinker.server.quotas import MAX_DATUMS_PER_REQUEST, MAX_TOKENS_PER_REQUEST, clip, echo
from tinker import types

__all__ = ["NAME", "TrainingRoutes", "check_request_size"]

log = logging.getLogger("rljob.trainer.tinker")

# A checkpoint name is one path segment: not all dots ("." and ".." would name the model's own folder,
# where a save_state with overwrite=True would first delete the automatic checkpoints).
NAME = re.compile(r"^(?!\.+$)[A-Za-z0-9._-]{1,128}$")


def check_request_size(call: wire.ForwardBackwardCall) -> None:
    """Refuse a forward / forward_backward beyond MAX_DATUMS_PER_REQUEST datums or MAX_TOKENS_PER_REQUEST
    tokens before any datum is decoded (the worker every key shares runs it)."""
    if len(call.data) > MAX_DATUMS_PER_REQUEST:
        raise RequestError(
            f"data: {len(call.data)} datums; this service takes at most {MAX_DATUMS_PER_REQUEST} per request"
        )
    tokens = sum(len(c.encoded_text.tokens) // 4 for d in call.data for c in d.model_input)
    if tokens > MAX_TOKENS_PER_REQUEST:
        raise RequestError(
            f"data: {tokens} model_input tokens; this service takes at most {MAX_TOKENS_PER_REQUEST} "
            "per request"
        )


class TrainingRoutes(ServiceCore):
    def _check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.cfg.base_model:
            raise RequestError(f"base_model: {echo(base_model)}; this service serves {self.cfg.base_model!r}")

    def _creating(self, kind: str, model_id: str, fn: Any) -> web.Response:
        """A request that creates training client ``model_id`` (create_model, create-via-load), within the
        key's share of the pool (429 beyond it)."""
        self._admit_model(model_id, OWNER.get())

        def work() -> Any:
            try:
                return fn()
            finally:
                self.creating.pop(model_id, None)

        try:
            return self._training(kind, None, None, work)
        except BaseException:
            self.creating.pop(model_id, None)
            raise

    async def create_model(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.CreateModelRequest)
        sid = self._own_session(req.session_id)
        model_id = f"{sid}:train:{int(req.model_seq_id)}"
        owner = OWNER.get()
        self._check_base(req.base_model)
        lc = req.lora_config
        if lc is None:
            raise RequestError("lora_config: this service trains LoRA adapters only")
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise RequestError(
                f"optimizer_config.type: {echo(req.optimizer_config.type)}; this service runs adamw"
            )

        def work() -> dict[str, Any]:
            self._check_live(sid)  # a finish_session queued before this ran: no model outlives its session
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

        return self._creating("create_model", model_id, work)

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
        owner = OWNER.get()

        def work() -> bytes:  # checked in turn: a refused request still takes its place in seq_id order
            check_request_size(call)
            loss = LossSpec.parse(call.loss_fn, call.loss_fn_config)
            record = self._admit_variant(owner, loss)
            data = wire.datums_of(call, LOSS_INPUTS[loss.kind], REQUIRED_INPUTS[loss.kind])
            total, lps = self.compute.forward(call.model_id, data, loss, backward=backward)
            record()
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
                raise RequestError(f"optim_params: {clip(str(kind))} is not supported (AdamParams only)")
            hp = AdamHP(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
            metrics = self.compute.optim_step(req.model_id, hp)
            m = self.engine.model(req.model_id)
            self._auto_checkpoint(m)
            self._report()
            # Namespaced: a client merges these into its own metrics (the Cookbook's rows have a "step").
            return {"metrics": {f"optim/{k}": v for k, v in {**metrics, "step": float(m.step)}.items()}}

        return self._training("optim_step", req.model_id, req.seq_id, work)

    def _weights_dir(self, model_id: str, name: str) -> str:
        return self.state.model_dir(model_id, "weights", name)

    def _parse_path(self, path: str, kind: str) -> tuple[str, str]:
        """(model id, name) of ``tinker://MODEL/{kind}/NAME``; the model id reaches storage only through
        storage_key (one path segment), the name only when it is one (NAME: no '/', not all dots)."""
        m = re.fullmatch(rf"tinker://(?P<model>[^/]+)/{kind}/(?P<name>[A-Za-z0-9._-]+)", path)
        if not m or not NAME.match(m.group("name")):
            raise RequestError(f"path: {echo(path)} is not a tinker://MODEL/{kind}/NAME path of this service")
        return m.group("model"), m.group("name")

    async def save_weights(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.SaveWeightsRequest)
        self._own_model(req.model_id)

        def work() -> dict[str, Any]:
            m = self.engine.model(req.model_id)
            name = req.path or f"step-{m.step:06d}"
            if not NAME.match(name):
                raise RequestError(f"path: {echo(name)}; a checkpoint name is 1-128 of A-Z a-z 0-9 . _ -")
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

    def _index_put(self, m: TrainingModel, checkpoint_id: str, path: str, uri: str | None = None) -> None:
        """Record a saved checkpoint (worker thread: saves and deletes of a model never race), with the
        run's owner (what decides who may list, load, sample and delete it after the run ended) and, for
        sampler weights, the version's directory."""
        index = self.state.index(m.model_id)
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
        self.state.write_index(m.model_id, index)

    def _restore_state(self, directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.compute.restore(directory)  # one process only (tests): not an operation

    def _auto_checkpoint(self, m: TrainingModel, force: bool = False) -> None:
        """Save ``m``'s automatic checkpoint when its step is due (``force``: now). Automatic checkpoints
        are numbered by save, not by optimizer step (that is in their metadata): a state loaded into a
        live client is saved as the newest even when its step is older than, or equal to, one already
        saved, with no window in which the client has no checkpoint; a restart restores the newest."""
        every = self.cfg.checkpoint_every
        if force or (every > 0 and m.step % every == 0):
            directory = self.state.model_dir(m.model_id, "auto")
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
        owner = OWNER.get()
        sid = ""
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
            if new:
                self._check_live(sid)
            self.compute.load_state(model_id, directory, new=new, optimizer=req.optimizer, path=req.path)
            if new:
                self.model_session[model_id] = sid
                self.model_owner[model_id] = owner
                self.next_seq[model_id] = 1
            m = self.engine.model(model_id)
            # The loaded state becomes the client's newest automatic checkpoint: a restart restores it.
            self._auto_checkpoint(m, force=True)
            return {"path": req.path, "model_id": model_id, "type": "load_weights"}

        if req.session_id is not None:
            return self._creating("load_weights", model_id, work)
        return self._training("load_weights", model_id if seq else None, seq, work)
