"""The one worker thread that owns every JAX call, shared fairly between keys.

Each key has its own first-in-first-out queue (so one model's requests keep the order they were submitted
in); the thread takes one task from each key with work in turn (round-robin), so a key with a thousand
queued requests delays another key's next request by at most one of them, not a thousand.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["FairWorker"]


class FairWorker:
    def __init__(self, name: str = "tinker-jax") -> None:
        self._queues: dict[
            str, collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        ] = {}
        self._turns: collections.deque[str] = collections.deque()  # keys with work, in turn order
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, key: str, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("the worker has stopped")
            q = self._queues.setdefault(key, collections.deque())
            if not q:
                self._turns.append(key)
            q.append((fn, out))
            self._cond.notify()
        return out

    def _next(self) -> tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None:
        with self._cond:
            while not self._turns and not self._stopped:
                self._cond.wait()
            if not self._turns:
                return None
            key = self._turns.popleft()
            q = self._queues[key]
            task = q.popleft()
            if q:
                self._turns.append(key)  # its next task waits for every other key's turn
            else:
                del self._queues[key]
            return task

    def _run(self) -> None:
        while (task := self._next()) is not None:
            fn, out = task
            if not out.set_running_or_notify_cancel():
                continue
            try:
                out.set_result(fn())
            except BaseException as e:  # delivered to the caller
                out.set_exception(e)

    def shutdown(self, cancel_futures: bool = True) -> None:
        """Stop taking tasks (queued ones are cancelled) and wait for the running one to end."""
        with self._cond:
            self._stopped = True
            if cancel_futures:
                for q in self._queues.values():
                    for _, out in q:
                        out.cancel()
                self._queues.clear()
                self._turns.clear()
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()
