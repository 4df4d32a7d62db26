"""The reconcile's work queue: de-duplicating, one worker per key at a time (client-go's semantics)."""

from __future__ import annotations

import asyncio

from rljob.operator import metrics

Key = tuple[str, str]  # (namespace, RLJob name)


class WorkQueue:
    """De-duplicating queue of keys (client-go workqueue semantics, without rate limiting)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._active: set[Key] = set()
        self._dirty: set[Key] = set()

    def add(self, key: Key) -> None:
        if key in self._queued:
            return
        if key in self._active:
            self._dirty.add(key)
            return
        self._queued.add(key)
        self._queue.put_nowait(key)
        metrics.QUEUE_DEPTH.set(len(self._queued))

    def add_after(self, key: Key, delay: float) -> None:
        asyncio.get_running_loop().call_later(delay, self.add, key)

    async def get(self) -> Key:
        key = await self._queue.get()
        self._queued.discard(key)
        self._active.add(key)
        metrics.QUEUE_DEPTH.set(len(self._queued))
        return key

    def done(self, key: Key) -> None:
        self._active.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def __len__(self) -> int:
        return len(self._queued)

    def idle(self) -> bool:
        return not self._queued and not self._active
