"""RestClient's routes: training runs, their checkpoints (list, delete), weights_info."""

from __future__ import annotations

import asyncio
import datetime
import re
from typing import Any

import pydantic
from aiohttp import web
from rljob.common.storage import open_store
from rljob.trainer.tinker.engine import RequestError, TrainingModel
from rljob.trainer.tinker.server.auth import OWNER, not_found
from rljob.trainer.tinker.server.quotas import clip, echo
from rljob.trainer.tinker.server.sampling_routes import SamplingRoutes
from rljob.trainer.tinker.server.training import NAME

__all__ = ["RestRoutes"]


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat()


def _int_param(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name, str(default))
    if not raw.isdigit():
        raise RequestError(f"{name}: {echo(raw)}; a non-negative integer")
    return int(raw)


class _WeightsInfoRequest(pydantic.BaseModel):
    tinker_path: str


class RestRoutes(SamplingRoutes):
    @staticmethod
    def _checkpoint_view(e: dict[str, Any]) -> dict[str, Any]:
        return {
            "checkpoint_id": e["checkpoint_id"],
            "checkpoint_type": e["checkpoint_type"],
            "time": _iso(e["time"]),
            "tinker_path": e["tinker_path"],
        }

    def _run_view(self, m: TrainingModel) -> dict[str, Any]:
        index = sorted(self.state.index(m.model_id).values(), key=lambda e: e["time"])
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
        owner = OWNER.get()
        ids = sorted(i for i in self.engine.models if self.model_owner.get(i) == owner)
        models = [self.engine.models[i] for i in ids[offset : offset + limit]]
        runs = await asyncio.to_thread(lambda: [self._run_view(m) for m in models])
        cursor = {"offset": offset, "limit": limit, "total_count": len(ids)}
        return web.json_response({"training_runs": runs, "cursor": cursor})

    def _live(self, request: web.Request) -> TrainingModel:
        run_id = request.match_info["run_id"]
        m = self.engine.models.get(run_id)
        if m is None or self.model_owner.get(run_id) != OWNER.get():
            raise not_found(f"training_run_id: no live training client {clip(run_id)} of this API key")
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
            index = self.state.index(run_id)
            if (
                checkpoint_id not in index
                or kind not in ("weights", "sampler_weights")
                or not NAME.match(name)
            ):
                return False
            if kind == "weights":
                store = open_store(self._weights_dir(run_id, name))
            else:
                store = open_store(self.state.sampler_dir(run_id, name))  # every version
                self.compute.forget_lora(self._sampler_version(index[checkpoint_id], run_id, name)[1])
            for k in store.list():
                store.delete(k)
            del index[checkpoint_id]
            self.state.write_index(run_id, index)
            return True

        if not await self._on_worker(work):
            msg = f"checkpoint_id: {clip(run_id)} has no checkpoint {clip(checkpoint_id)} on this service"
            return web.json_response({"error": msg}, status=404)
        return web.json_response({})

    async def weights_info(self, request: web.Request) -> web.Response:
        body = await self._body(request, _WeightsInfoRequest)
        m = re.fullmatch(r"tinker://(?P<run>[^/]+)/(?P<id>(weights|sampler_weights)/[^/]+)", body.tinker_path)
        if not m:
            raise RequestError(
                f"tinker_path: {echo(body.tinker_path)} is not a checkpoint path of this service"
            )
        entry = (await asyncio.to_thread(self._own_index, m.group("run"))).get(m.group("id"))
        if entry is None:
            return web.json_response(
                {"error": f"tinker_path: no checkpoint {clip(body.tinker_path)}"}, status=404
            )
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
