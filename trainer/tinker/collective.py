"""The Tinker service's device work, run alike on every process of the trainer (one host or several).

A trainer of several hosts runs one SPMD program: each jitted call on the models' sharded arrays, each
orbax save or restore of a sharded state and each gather of one (``process_allgather``) is a collective
that every process must enter, in the same order. Process 0 serves HTTP (rljob.trainer.tinker.server) and
its worker thread touches the devices only through :class:`Compute`, a fixed set of operations. With one
process each operation is a direct call on the :class:`~rljob.trainer.tinker.engine.Engine`. With several,
process 0 first sends the operation's name and arguments to the others (:class:`Channel`), then runs it;
every other process runs :meth:`Compute.follow`: receive the next operation, run it on its own Engine,
drop the result, until process 0 sends ``stop``.

The operations are deterministic given their arguments and what earlier operations left behind (the
models, their steps, the cached adapters), so every process holds the same state: a request refused
inside an operation (RequestError) is refused on every process at the same point, and the followers go on
to the next one. What is random (a new model's seed) is drawn on process 0 and sent as an argument;
everything else the service keeps (sessions, owners, the registry and indexes on storage) lives on
process 0 only.

Transport: process 0 announces operation n under the coordination service's key ``rljob-tinker/op/n``
(the other processes wait on that key, so no collective idles between requests), then broadcasts the
pickled operation (``multihost_utils.broadcast_one_to_all``, length first, as
rljob.trainer.runtime.share_from_first does for a loop step's rollouts; padded to a power of two so the
broadcast compiles for a few sizes only) and deletes the key once every process has received it. The
payload comes from the run's own process 0 over the job's coordination service, never from a client.
"""

from __future__ import annotations

import logging
import pickle
import secrets
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from rljob.trainer.checkpoint import Checkpointer
from rljob.trainer.tinker.engine import AdamHP, DatumIn, Engine, LossSpec, RequestError, TrainingModel
from safetensors.numpy import load as st_load

__all__ = ["Channel", "Compute"]

log = logging.getLogger("rljob.trainer.tinker")

KEY_PREFIX = "rljob-tinker/op"
WAIT_MS = 60_000  # a follower's wait for the next operation, renewed while the service is idle
MIN_PAYLOAD = 4096


class Channel:
    """Process 0's operations to every other process, in order (module docstring: transport)."""

    def __init__(self) -> None:
        from jax._src import distributed  # the client jax.distributed.initialize made

        client = distributed.global_state.client
        if client is None:
            raise RuntimeError("a multi-process Tinker service needs jax.distributed.initialize first")
        self.client = client
        self.n = 0

    @staticmethod
    def _broadcast(payload: bytes | None) -> bytes:
        from jax.experimental import multihost_utils

        first = jax.process_index() == 0
        size = max(MIN_PAYLOAD, 1 << (len(payload) + 8 - 1).bit_length()) if payload is not None else 0
        n = int(multihost_utils.broadcast_one_to_all(np.int64(size if first else 0)))
        if first:
            assert payload is not None
            buf = np.zeros(n, np.uint8)
            buf[:8] = np.frombuffer(np.int64(len(payload)).tobytes(), np.uint8)
            buf[8 : 8 + len(payload)] = np.frombuffer(payload, np.uint8)
        else:
            buf = np.zeros(n, np.uint8)
        out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
        length = int(np.frombuffer(out[:8].tobytes(), np.int64)[0])
        return out[8 : 8 + length].tobytes()

    def send(self, payload: bytes) -> None:
        key = f"{KEY_PREFIX}/{self.n}"
        self.client.key_value_set(key, "1")
        self._broadcast(payload)
        self.client.key_value_delete(key)  # every process entered the broadcast: it read the key
        self.n += 1

    def receive(self) -> bytes:
        key = f"{KEY_PREFIX}/{self.n}"
        while True:
            try:
                self.client.blocking_key_value_get(key, WAIT_MS)
                break
            except Exception as e:  # the wait's deadline: the service is idle; anything else ends us
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        out = self._broadcast(None)
        self.n += 1
        return out


class Compute:
    """The service's device operations (module docstring); ``channel`` None: one process, direct calls."""

    def __init__(self, engine: Engine, channel: Channel | None = None) -> None:
        self.engine = engine
        self.channel = channel
        self.lora_cache: dict[str, Any] = {}  # adapter name -> LoRA state (prompt log-probs on the trainer)

    def _call(self, op: str, **kwargs: Any) -> Any:
        if self.channel is not None:
            self.channel.send(pickle.dumps((op, kwargs), protocol=pickle.HIGHEST_PROTOCOL))
        return getattr(self, f"_{op}")(**kwargs)

    def follow(self) -> None:
        """Every process but 0: run process 0's operations until it sends ``stop``."""
        assert self.channel is not None
        while True:
            op, kwargs = pickle.loads(self.channel.receive())  # from process 0 of this job only
            if op == "stop":
                return
            try:
                getattr(self, f"_{op}")(**kwargs)
            except RequestError:
                pass  # process 0 refused the same request at the same point
            except Exception:
                log.exception("operation %s failed on process %d", op, jax.process_index())

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.send(pickle.dumps(("stop", {})))
            self.channel = None

    # ------------------------------------------------------------------ operations (process 0 calls these)

    def create(self, model_id: str, *, seed: int | None, **cfg: Any) -> TrainingModel:
        """A new model (Engine.create); a seed the client left unset is drawn here, on process 0."""
        seed = secrets.randbits(31) if seed is None else int(seed)
        model: TrainingModel = self._call("create", model_id=model_id, seed=seed, **cfg)
        return model

    def forward(
        self, model_id: str | None, data: Sequence[DatumIn], loss: LossSpec, *, backward: bool
    ) -> tuple[float, list[np.ndarray]]:
        out: tuple[float, list[np.ndarray]] = self._call(
            "forward", model_id=model_id, data=list(data), loss=loss, backward=backward
        )
        return out

    def optim_step(self, model_id: str, hp: AdamHP) -> dict[str, float]:
        out: dict[str, float] = self._call("optim_step", model_id=model_id, hp=hp)
        return out

    def unload(self, model_ids: list[str]) -> None:
        self._call("unload", model_ids=list(model_ids))

    def save_state(
        self, model_id: str, directory: str, meta: dict[str, Any], *, max_to_keep: int, exists: str | None
    ) -> int:
        """Save the model's state (adapter, Adam moments, count) as the next orbax step of ``directory``;
        ``exists``: the RequestError's message when the folder already holds a step (None: allowed)."""
        step: int = self._call(
            "save_state",
            model_id=model_id,
            directory=directory,
            meta=meta,
            max_to_keep=max_to_keep,
            exists=exists,
        )
        return step

    def load_state(
        self,
        model_id: str,
        directory: str,
        *,
        new: bool,
        optimizer: bool,
        path: str = "",
        registry: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Restore ``directory``'s newest state into the model (``new``: created with the checkpoint's
        config, or ``registry``'s when a restarted service restores it, with its skipped count); returns
        the checkpoint's metadata. ``path`` names the checkpoint in a refusal."""
        meta: dict[str, Any] = self._call(
            "load_state",
            model_id=model_id,
            directory=directory,
            new=new,
            optimizer=optimizer,
            path=path,
            registry=registry,
        )
        return meta

    def peft(self, model_id: str) -> dict[str, np.ndarray]:
        """The model's adapter in the PEFT layout, whole on the host (gathered over the processes)."""
        out: dict[str, np.ndarray] = self._call("peft", model_id=model_id)
        return out

    def cache_lora(self, adapter: str, model_id: str) -> None:
        """Keep a copy of the model's adapter under the sampler adapter name (prompt log-probs)."""
        self._call("cache_lora", adapter=adapter, model_id=model_id)

    def forget_lora(self, adapter: str) -> None:
        if adapter in self.lora_cache:
            self._call("forget_lora", adapter=adapter)

    def prompt_logprobs(
        self, adapter: str | None, uri: str | None, model_path: str | None, tokens: np.ndarray
    ) -> np.ndarray:
        """log p(tokens[i] | tokens[<i]) for i >= 1 under the sampler adapter ``adapter`` (its PEFT
        directory ``uri``, loaded once; None: the base model)."""
        out: np.ndarray = self._call(
            "prompt_logprobs", adapter=adapter, uri=uri, model_path=model_path, tokens=tokens
        )
        return out

    # ------------------------------------------------------------------ the operations (every process)

    def _create(self, model_id: str, **cfg: Any) -> TrainingModel:
        return self.engine.create(model_id, **cfg)

    def _forward(
        self, model_id: str | None, data: list[DatumIn], loss: LossSpec, backward: bool
    ) -> tuple[float, list[np.ndarray]]:
        return self.engine.forward(model_id, data, loss, backward=backward)

    def _optim_step(self, model_id: str, hp: AdamHP) -> dict[str, float]:
        return self.engine.optim_step(model_id, hp)

    def _unload(self, model_ids: list[str]) -> None:
        for m in model_ids:
            self.engine.unload(m)

    def _save_state(
        self, model_id: str, directory: str, meta: dict[str, Any], max_to_keep: int, exists: str | None
    ) -> int:
        m = self.engine.model(model_id)
        ck = Checkpointer(directory, max_to_keep=max_to_keep)
        try:
            steps = ck.all_steps()
            if steps and exists is not None:
                raise RequestError(exists)
            step = max(steps, default=-1) + 1
            ck.save(step, self.engine.state_tree(m), meta)
        finally:
            ck.close()
        return step

    def restore(self, directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(state, metadata) of ``directory``'s newest checkpoint; RequestError when it has none. Every
        process at once (an operation's part, or a test's read on one process)."""
        ck = Checkpointer(directory, max_to_keep=1)
        try:
            restored = ck.restore(self.engine.abstract_state())
        finally:
            ck.close()
        if restored is None:
            raise RequestError(f"path: no checkpoint at {directory}")
        return restored

    def _load_state(
        self,
        model_id: str,
        directory: str,
        new: bool,
        optimizer: bool,
        path: str,
        registry: dict[str, Any] | None,
    ) -> dict[str, Any]:
        tree, meta = self.restore(directory)
        cfg = registry if registry is not None else meta["config"]
        if new:
            m = self.engine.create_from_config(model_id, cfg)
        else:
            m = self.engine.model(model_id)
            if (m.rank, m.train_attn, m.train_mlp) != (cfg["rank"], cfg["train_attn"], cfg["train_mlp"]):
                raise RequestError(f"path: {path} has another LoRA shape than model {model_id}")
        self.engine.set_state(m, tree, optimizer=optimizer)
        m.step = int(meta.get("optim_steps", 0)) if optimizer else 0
        if registry is not None:
            m.skipped = int(meta.get("skipped", 0))
        return meta

    def _peft(self, model_id: str) -> dict[str, np.ndarray]:
        return self.engine.peft(self.engine.model(model_id).lora)

    def _put_cache(self, adapter: str, lora: Any) -> None:
        self.lora_cache[adapter] = jax.tree.map(lambda x: x.copy(), lora)
        while len(self.lora_cache) > max(2, self.engine.max_models):
            self.lora_cache.pop(next(iter(self.lora_cache)))

    def _cache_lora(self, adapter: str, model_id: str) -> None:
        self._put_cache(adapter, self.engine.model(model_id).lora)

    def _forget_lora(self, adapter: str) -> None:
        self.lora_cache.pop(adapter, None)

    def _prompt_logprobs(
        self, adapter: str | None, uri: str | None, model_path: str | None, tokens: np.ndarray
    ) -> np.ndarray:
        if adapter is None:
            lora = self.engine.policy.lora0  # B = 0: the base model
        else:
            if adapter not in self.lora_cache:
                from rljob.common.storage import open_store
                from rljob.trainer.export import ADAPTER_WEIGHTS

                assert uri is not None
                raw = open_store(uri).read(ADAPTER_WEIGHTS)
                if raw is None:
                    raise RequestError(f"model_path: sampler weights {model_path} are gone")
                peft = self.engine.policy.peft.from_peft(dict(st_load(raw)))
                self._put_cache(adapter, self.engine._put(peft))
            lora = self.lora_cache[adapter]
        return self.engine.prompt_logprobs(lora, tokens)
