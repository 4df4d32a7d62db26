"""Who is calling, and what is theirs (docs/tinker.md, "Security").

Every request but healthz needs one of the run's keys (ServiceConfig.api_keys; the service does not start
without one unless ``dev_any_key``). What a key creates (sessions, models, checkpoints, sampler weights,
sampling sessions, futures) is its own: it is recorded under the key's owner id (:func:`key_owner`, a
digest: the registry and indexes never hold a key), and to another key it does not exist (404, the same
answer as an unknown id; 410 for a future).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json

from aiohttp import web

__all__ = [
    "KEY_PREFIX",
    "OWNER",
    "authenticate",
    "key_owner",
    "not_found",
    "parse_api_keys",
    "storage_key",
]

KEY_PREFIX = "tml-"  # the SDK sends only keys that start with it
MAX_KEY_BYTES = 512

# The owner id of the request being handled (set by the auth middleware; a task per request keeps it).
OWNER: contextvars.ContextVar[str] = contextvars.ContextVar("rljob_tinker_owner", default="")


def parse_api_keys(raw: str) -> tuple[frozenset[str], list[str]]:
    """The keys of the Secret's ``api-keys`` value (comma-separated) and the problems of the value, one line
    each (an entry that does not start with ``tml-``, or is ``tml-`` alone). Keys are never echoed."""
    keys, problems = set(), []
    for i, k in enumerate(x.strip() for x in raw.split(",")):
        if not k:
            continue
        if not k.startswith(KEY_PREFIX) or len(k) == len(KEY_PREFIX):
            problems.append(
                f"entry {i + 1} is not a key: it must start with {KEY_PREFIX} and go on (the SDK's rule)"
            )
            continue
        keys.add(k)
    return frozenset(keys), problems


def key_owner(key: str) -> str:
    """The owner of what a key creates: a digest of the key (the registry and indexes never hold a key)."""
    return "k-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def authenticate(key: str | None, allowed: frozenset[str], dev_any_key: bool = False) -> str | None:
    """The owner id of ``X-API-Key`` when it is accepted, else None. ``dev_any_key`` (make tinker-cpu and
    tests only) accepts any ``tml-`` key; each key still owns only what it creates."""
    if not key or not key.startswith(KEY_PREFIX) or len(key) > MAX_KEY_BYTES:
        return None
    if dev_any_key:
        return key_owner(key)
    ok = False
    for k in allowed:  # every key compared, each in constant time
        ok |= hmac.compare_digest(k.encode(), key.encode())
    return key_owner(key) if ok else None


def not_found(message: str) -> web.HTTPNotFound:
    """What another key's object (or an unknown id) answers."""
    return web.HTTPNotFound(text=json.dumps({"error": message}), content_type="application/json")


_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")


def storage_key(model_id: str) -> str:
    """A model id as one storage path segment, one-to-one: letters, digits and '-' stay, every other byte
    is ``_xx`` (hex), '_' and '.' included, so no two ids share a folder and none is '.', '..' or has '/'."""
    return "".join(chr(b) if chr(b) in _SAFE else f"_{b:02x}" for b in model_id.encode())
