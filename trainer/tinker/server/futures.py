"""The service's futures: every request that starts work answers ``{"request_id"}`` at once (the SDK's
``UntypedAPIFuture``); ``/api/v1/retrieve_future`` holds the poll open until it ends (at most ``POLL_S``,
then ``{"type": "try_again"}``). A result is the SDK's JSON response model or protobuf bytes; a refused
request is ``{"error", "category": "user"}`` (the SDK raises ``RequestFailedError``), a failure of the service
``"category": "server"``.

A future belongs to the key that started it (another key's poll gets 410, as for an unknown one). A retrieved
result is kept RESULT_TTL_S (the SDK may poll again after a lost reply), an unretrieved one
UNRETRIEVED_TTL_S. Per key at most PENDING_FUTURES_PER_KEY run at once and FUTURES_PER_KEY are kept
(rljob.trainer.tinker.server.quotas); an error message is kept at most MAX_MESSAGE characters long.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

from rljob.trainer.tinker.server.quotas import (
    FUTURES_PER_KEY,
    PENDING_FUTURES_PER_KEY,
    QuotaExceeded,
    bounded,
)

__all__ = ["POLL_S", "RESULT_TTL_S", "UNRETRIEVED_TTL_S", "Future", "FutureTable"]

POLL_S = 30.0  # the SDK gives up a retrieve_future poll after 45 s
RESULT_TTL_S = 300.0
UNRETRIEVED_TTL_S = 3600.0


@dataclasses.dataclass
class Future:
    request_id: str
    kind: str
    done: asyncio.Event
    result: Any = None  # dict (JSON) or bytes (protobuf)
    error: tuple[str, str] | None = None
    created: float = dataclasses.field(default_factory=time.monotonic)
    retrieved: float | None = None
    owner: str = ""  # the key's owner id

    def fail(self, message: str, category: str) -> None:
        self.error = (bounded(message), category)


class FutureTable:
    """The futures of every key, with the per-key bounds (module docstring). Event loop only."""

    def __init__(
        self, pending_per_key: int = PENDING_FUTURES_PER_KEY, kept_per_key: int = FUTURES_PER_KEY
    ) -> None:
        self.pending_per_key, self.kept_per_key = pending_per_key, kept_per_key
        self.futures: dict[str, Future] = {}  # insertion order: oldest first

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.futures

    def __len__(self) -> int:
        return len(self.futures)

    def get(self, request_id: str, owner: str) -> Future | None:
        f = self.futures.get(request_id)
        return f if f is not None and f.owner == owner else None

    def new(self, kind: str, owner: str, *, admit: bool = True) -> Future:
        """A new future of ``owner``. ``admit``: refuse (QuotaExceeded, retryable) when the key already runs
        its share; a refusal answered as a future (``admit`` False) is finished at once and not refused.
        Beyond the kept bound the key's own oldest finished futures are dropped."""
        mine = [f for f in self.futures.values() if f.owner == owner]
        if admit and sum(not f.done.is_set() for f in mine) >= self.pending_per_key:
            raise QuotaExceeded(
                f"futures: this API key has {self.pending_per_key} requests in flight (the service's "
                "per-key limit); wait for some to finish",
                retry=True,
            )
        extra = len(mine) + 1 - self.kept_per_key
        if extra > 0:
            for old in [f for f in mine if f.done.is_set()][:extra]:
                self.futures.pop(old.request_id, None)
        f = Future(request_id=uuid.uuid4().hex, kind=kind, done=asyncio.Event(), owner=owner)
        self.futures[f.request_id] = f
        return f

    def sweep(self, now: float) -> None:
        for rid, f in list(self.futures.items()):
            if (
                f.retrieved is not None and now - f.retrieved > RESULT_TTL_S
            ) or now - f.created > UNRETRIEVED_TTL_S:
                self.futures.pop(rid, None)

    def retained_bytes(self, owner: str) -> int:
        """What a key's futures hold: result bytes and error messages (tests, and a bound's check)."""
        total = 0
        for f in self.futures.values():
            if f.owner != owner:
                continue
            if isinstance(f.result, bytes):
                total += len(f.result)
            elif f.result is not None:
                total += len(repr(f.result))
            if f.error is not None:
                total += len(f.error[0])
        return total
