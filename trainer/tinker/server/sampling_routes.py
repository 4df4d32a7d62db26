"""Sampling routes: save_weights_for_sampler, create_sampling_session, get_sampler, asample; the table of
sampling sessions (one object each on storage, each key within its share: its own least recently used
are dropped, never another key's)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web
from rljob.common.storage import join, open_store
from rljob.recipes.runconfig import named_adapter
from rljob.trainer.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rljob.trainer.tinker import wire
from rljob.trainer.tinker.engine import RequestError, TrainingModel
from rljob.trainer.tinker.server.auth import OWNER, not_found
from rljob.trainer.tinker.server.core import SamplingSession
from rljob.trainer.tinker.server.quotas import QuotaExceeded, clip, echo, per_key_share
from rljob.trainer.tinker.server.training import NAME, TrainingRoutes
from safetensors.numpy import save as st_save
from tinker import types

__all__ = ["MAX_SAMPLES", "MAX_SEED", "SamplingRoutes", "sampling_problems"]

MAX_SAMPLES = 128
MAX_SEED = (1 << 63) - 1  # the samplers' seed is a signed 64-bit integer
MAX_STOPS = 16


def bad_request(problems: list[str]) -> web.HTTPBadRequest:
    """HTTP 400 with every problem of the request, one per line: the SDK raises it at once, no retry."""
    return web.HTTPBadRequest(
        text=json.dumps({"error": "\n".join(problems)}), content_type="application/json"
    )


def sampling_problems(prompt: np.ndarray, sp: Any, vocab: int | None) -> list[str]:
    """What a sampler must never be sent: token ids outside the vocabulary, non-finite or negative
    temperatures, top_p outside (0, 1], top_k below -1, seeds outside 0..MAX_SEED, stop lists too long."""
    problems = []
    if vocab is not None and prompt.size and (prompt.min() < 0 or prompt.max() >= vocab):
        bad = int(np.flatnonzero((prompt < 0) | (prompt >= vocab))[0])
        problems.append(f"prompt: token {int(prompt[bad])} at {bad} is outside the vocabulary [0, {vocab})")
    t = float(sp.temperature)
    if not math.isfinite(t) or t < 0:
        problems.append(f"sampling_params.temperature: {t}; a finite number >= 0")
    p = float(sp.top_p)
    if not math.isfinite(p) or not 0 < p <= 1:
        problems.append(f"sampling_params.top_p: {p}; in (0, 1]")
    if int(sp.top_k) < -1:
        problems.append(f"sampling_params.top_k: {int(sp.top_k)}; -1 (off) or more")
    if sp.seed is not None and not 0 <= int(sp.seed) <= MAX_SEED:
        problems.append(f"sampling_params.seed: {clip(str(int(sp.seed)))}; 0..2^63-1")
    stop = sp.stop
    if stop is not None and not isinstance(stop, str):
        if len(stop) > MAX_STOPS:
            problems.append(f"sampling_params.stop: {len(stop)} entries; at most {MAX_STOPS}")
        ids = [x for x in stop if isinstance(x, int)]
        if vocab is not None and any(not 0 <= x < vocab for x in ids):
            problems.append(f"sampling_params.stop: token ids must lie in [0, {vocab})")
    return problems


class SamplingRoutes(TrainingRoutes):
    def _sampler_version(self, entry: dict[str, Any], model_id: str, name: str) -> tuple[str, str]:
        """(PEFT directory, adapter name) of an index entry of sampler weights (an entry written before
        versions existed: the name's folder itself)."""
        uri = str(entry.get("uri") or self.state.sampler_dir(model_id, name))
        return uri, named_adapter(uri)

    async def save_weights_for_sampler(self, request: web.Request) -> web.Response:
        req = await self._body(request, types.SaveWeightsForSamplerRequest)
        if req.path is None and req.sampling_session_seq_id is None:
            raise RequestError("save_weights_for_sampler: needs path or sampling_session_seq_id")
        self._own_model(req.model_id)
        session = self.model_session.get(req.model_id, "s-unknown")
        owner = OWNER.get()

        def work() -> dict[str, Any]:
            m = self.engine.model(req.model_id)
            name = req.path or f"ephemeral-{m.step:06d}-{uuid.uuid4().hex[:8]}"
            if not NAME.match(name):
                raise RequestError(f"path: {echo(name)}; a name is 1-128 of A-Z a-z 0-9 . _ -")
            path, uri, adapter = self._save_sampler_weights(m, name)
            if req.path is not None:
                return {"path": path, "type": "save_weights_for_sampler"}
            sid = f"{session}:sample:{req.sampling_session_seq_id}:{uuid.uuid4().hex[:6]}"
            self._add_sampling(SamplingSession(sid, m.base_model, path, adapter, uri, owner, session))
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
        uri = join(self.state.sampler_dir(m.model_id, name), digest)
        store = open_store(uri)
        store.write(ADAPTER_WEIGHTS, weights)
        store.write(ADAPTER_CONFIG, config)
        adapter = named_adapter(uri)
        self.compute.cache_lora(adapter, m.model_id)
        cid = f"sampler_weights/{name}"
        old = self.state.index(m.model_id).get(cid)
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

    def _add_sampling(self, s: SamplingSession) -> None:
        """Keep (and persist, one object each) a sampling session. A key holds at most its share of
        ``max_sampling_sessions``: beyond it the key's own least recently used are dropped; a service full
        of other keys' sessions refuses (QuotaExceeded), never dropping theirs (thread or worker)."""
        s.used = time.time()
        cap = self.cfg.max_sampling_sessions
        share = per_key_share(cap, self.cfg.keys)
        with self._sampling_lock:  # the worker (save_weights_for_sampler) and request threads add at once
            new = s.sampler_id not in self.sampling
            mine = sorted(
                (x for x in self.sampling.values() if x.owner == s.owner and x.sampler_id != s.sampler_id),
                key=lambda x: x.used,
            )
            drop = max(0, len(mine) + 1 - share)
            if new and len(self.sampling) - drop >= cap:
                drop += 1  # the service is full: the key makes room from its own
            if drop > len(mine):
                raise QuotaExceeded(
                    f"sampling sessions: the service holds its limit of {cap} (other API keys' sessions are "
                    "never dropped for this key); end sessions or wait for them to expire"
                )
            oldest = mine[:drop]
            for o in oldest:
                self.sampling.pop(o.sampler_id, None)
            self.sampling[s.sampler_id] = s
        self.state.put_sampling(s.sampler_id, dataclasses.asdict(s))
        self.state.drop_sampling([o.sampler_id for o in oldest])

    async def _session_for(self, sid: str, model_path: str | None, base_model: str | None) -> SamplingSession:
        owner = OWNER.get()
        if model_path is None:
            self._check_base(base_model or self.cfg.base_model)
            return SamplingSession(sid, self.cfg.base_model, None, None, None, owner)
        model_id, name = self._parse_path(model_path, "sampler_weights")
        index = await asyncio.to_thread(self._own_index, model_id)  # another key's weights: 404
        entry = index.get(f"sampler_weights/{name}")
        if entry is None:
            raise RequestError(f"model_path: no sampler weights at {clip(model_path)}")
        uri, adapter = self._sampler_version(entry, model_id, name)
        exists = await asyncio.to_thread(lambda: open_store(uri).exists(ADAPTER_CONFIG))
        if not exists:
            raise RequestError(f"model_path: no sampler weights at {clip(model_path)}")
        return SamplingSession(sid, self.cfg.base_model, model_path, adapter, uri, owner)

    async def get_sampler(self, request: web.Request) -> web.Response:
        s = self.sampling.get(request.match_info["sampler_id"])
        if s is None or s.owner != OWNER.get():
            return web.json_response({"error": "no such sampler"}, status=404)
        return web.json_response(
            {"sampler_id": s.sampler_id, "base_model": s.base_model, "model_path": s.model_path}
        )

    def _vocab(self) -> int | None:
        policy = getattr(self.engine, "policy", None)
        return getattr(policy, "vocab_size", None)

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
            if session is None or session.owner != OWNER.get():
                raise not_found(
                    f"sampling_session_id: {clip(req.sampling_session_id)} is not a sampler of this API key"
                )
            session.used = time.time()
        else:
            session = await self._session_for("direct", req.model_path, req.base_model)
        prompt = wire.tokens_of(req.prompt, "prompt")
        n = int(req.num_samples)
        sp = req.sampling_params
        problems = sampling_problems(prompt, sp, self._vocab())
        if problems:
            raise bad_request(problems)
        f = self._new_future("sample", lambda: self._sample(session, prompt, n, sp, req, unsupported))
        return self._future_response(f, sample_sequence_ids=[f"{f.request_id}-{i}" for i in range(max(n, 0))])

    async def _sample(
        self, s: SamplingSession, prompt: np.ndarray, n: int, sp: Any, req: Any, unsupported: list[str]
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
        self, s: SamplingSession, prompt: np.ndarray, last_n: int | None
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
