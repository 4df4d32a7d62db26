"""The Tinker HTTP API (aiohttp) over an :class:`~rljob.trainer.tinker.engine.Engine` and the run's samplers,
one module per policy:

- :mod:`.service`: the route table and middleware (keys, body sizes, how refusals are answered), sessions;
- :mod:`.auth`: the run's keys, the owner of what a key creates, storage-safe ids;
- :mod:`.futures`: the futures every request that starts work answers with, and retrieve_future's table;
- :mod:`.quotas`: what one key may hold and send (docs/tinker.md, "Limits");
- :mod:`.worker`: the one worker thread that owns every JAX call, taken in turn by the keys;
- :mod:`.state`: the service's objects on storage (registry, sessions, sampling sessions, indexes);
- :mod:`.core`: the in-memory tables, seq_id order, ownership checks, the sweep;
- :mod:`.training`, :mod:`.sampling_routes`, :mod:`.rest`: the routes of training clients, sampling and
  RestClient.

A restarted service restores the registry, the sessions, the sampling sessions and each model's newest
auto checkpoint, so training clients continue where they were (futures in flight are lost: the SDK's poll
then gets 410).

Security (docs/tinker.md, "Security"): every request but healthz needs one of the run's keys, and what a
key creates is its own: another key gets 404 (410 for a future).
"""

from __future__ import annotations

from rljob.trainer.tinker.server.auth import authenticate, key_owner, parse_api_keys, storage_key
from rljob.trainer.tinker.server.core import MAX_SAMPLING_SESSIONS, ServiceConfig
from rljob.trainer.tinker.server.futures import POLL_S
from rljob.trainer.tinker.server.service import Service
from rljob.trainer.tinker.server.state import CHECKPOINTS_INDEX, SAMPLING_DIR, SESSIONS_DIR

__all__ = [
    "CHECKPOINTS_INDEX",
    "MAX_SAMPLING_SESSIONS",
    "POLL_S",
    "SAMPLING_DIR",
    "SESSIONS_DIR",
    "Service",
    "ServiceConfig",
    "authenticate",
    "key_owner",
    "parse_api_keys",
    "storage_key",
]

_key = storage_key
