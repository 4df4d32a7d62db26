"""A run's own credential: one random token that every port of the run asks for.

The operator creates it, once per run, in the Secret `<rljob>-credentials` (key RUN_TOKEN_SECRET_KEY,
owned by the RLJob), and the render gives it to every trainer and sampler container as env RUN_TOKEN_ENV
(a secretKeyRef). A sampler's adapter agent and its vLLM server (`VLLM_API_KEY`) require it as
`Authorization: Bearer <token>`; the trainer's sampler client, the adapter hot-swap and the Tinker
service's sampling send it; a multi-host replica's Ray cluster uses it as its auth token. Local runs
(`make rl-cpu`, `make tinker-cpu`, `rljob drill`, the tests) draw one with :func:`new_token` and pass it
in the same variable. docs/operator.md, "Credentials", says which port asks for what.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping

from rljob.recipes.runconfig import RUN_TOKEN_ENV

__all__ = ["authorized", "bearer", "new_token", "run_token", "token_env"]


def new_token() -> str:
    """A fresh run token: 32 random bytes, URL-safe base64 (43 characters, no padding)."""
    return secrets.token_urlsafe(32)


def token_env(token: str | None = None) -> dict[str, str]:
    """The environment that gives a local process the run's token (a new one unless given)."""
    return {RUN_TOKEN_ENV: token or new_token()}


def run_token(environ: Mapping[str, str] = os.environ) -> str | None:
    """This process's run token (env RUN_TOKEN_ENV), or None where it is unset or empty."""
    return environ.get(RUN_TOKEN_ENV) or None


def bearer(token: str | None) -> dict[str, str]:
    """The request headers that carry ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``token``; compared in constant time."""
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())
