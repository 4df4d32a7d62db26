"""What one key may hold and send (docs/tinker.md, "Limits"): per-key quotas, per-request bounds, bounded
echoes. A key over a quota is answered 429 naming the limit, and never takes another key's state.

- Training clients: each key may hold ``max_models // keys`` of spec.service.maxTrainingClients (at least
  one; a service of one key, or ``dev_any_key``, gives the key the whole pool).
- Sampling sessions: each key holds at most ``max_sampling_sessions // keys``; beyond that its own least
  recently used are dropped (never another key's). A service full of other keys' sessions answers 429.
- Futures: at most PENDING_FUTURES_PER_KEY unfinished (429, which the SDK retries: they free up) and
  FUTURES_PER_KEY kept (beyond it the key's own oldest finished results are dropped); an error message
  kept in a future is at most MAX_MESSAGE characters, so a key keeps a bounded number of bytes.
- PPO clip variants: a key adds at most VARIANTS_PER_KEY of the service's compiled set, and only with a
  request that passed.
- Per request: a body of at most the route's ``body_limit`` (413), MAX_DATUMS_PER_REQUEST datums and
  MAX_TOKENS_PER_REQUEST tokens per forward / forward_backward.
"""

from __future__ import annotations

import json

from aiohttp import web

__all__ = [
    "BODY_LIMIT",
    "FUTURES_PER_KEY",
    "MAX_DATUMS_PER_REQUEST",
    "MAX_ECHO",
    "MAX_MESSAGE",
    "MAX_TOKENS_PER_REQUEST",
    "PENDING_FUTURES_PER_KEY",
    "VARIANTS_PER_KEY",
    "QuotaExceeded",
    "body_limit",
    "bounded",
    "clip",
    "echo",
    "per_key_share",
]

MAX_ECHO = 200  # characters of a request's field that a refusal repeats
MAX_MESSAGE = 1000  # characters of an error message kept in a future or answered
PENDING_FUTURES_PER_KEY = 256
FUTURES_PER_KEY = 4096
VARIANTS_PER_KEY = 4
MAX_DATUMS_PER_REQUEST = 4096
MAX_TOKENS_PER_REQUEST = 1 << 18
BODY_LIMIT = 1 << 20  # a JSON request body
# Routes whose bodies carry token data: a forward_backward of MAX_TOKENS_PER_REQUEST tokens with its three
# per-token loss inputs (about 16 bytes a token) and protobuf framing fits.
_BODY_LIMITS = {"/api/v1/forward_backward": 32 << 20, "/api/v1/forward": 32 << 20, "/api/v1/asample": 4 << 20}
MAX_BODY = max(_BODY_LIMITS.values())  # aiohttp's client_max_size: no route reads more


def body_limit(path: str) -> int:
    return _BODY_LIMITS.get(path, BODY_LIMIT)


def clip(text: str) -> str:
    """``text`` cut to MAX_ECHO characters (saying how long it was): what a refusal repeats of a field."""
    if len(text) <= MAX_ECHO:
        return text
    return f"{text[:MAX_ECHO]}... ({len(text)} characters)"


def echo(value: object) -> str:
    """``repr(value)``, clipped."""
    return clip(repr(value))


def bounded(message: str) -> str:
    """An error message cut to MAX_MESSAGE characters (a field echoed whole by a library's message too)."""
    if len(message) <= MAX_MESSAGE:
        return message
    return f"{message[:MAX_MESSAGE]}... ({len(message)} characters)"


def per_key_share(total: int, keys: int) -> int:
    """A key's share of a pool of ``total`` among ``keys`` keys (at least one each; 0 keys: the pool)."""
    return total if keys <= 1 else max(1, total // keys)


class QuotaExceeded(Exception):
    """A key is over one of its quotas (the message names the limit): HTTP 429. ``retry``: whether waiting
    helps (pending futures finish); the SDK retries a 429 unless told not to (``x-should-retry``)."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry

    def response(self) -> web.Response:
        headers = {"x-should-retry": "true" if self.retry else "false"}
        return web.Response(
            status=429,
            text=json.dumps({"error": str(self)}),
            content_type="application/json",
            headers=headers,
        )
