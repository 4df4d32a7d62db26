"""spec.service.apiKeySecret: the Tinker API fails closed (docs/tinker.md, "Security").

A service-mode RLJob names the Secret whose key ``api-keys`` lists the accepted API keys; without one the
plan refuses the job (the service itself also refuses to start on a value with no key). Only
``make tinker-cpu`` runs the service with its local development switch instead.
"""

from __future__ import annotations

from rljob.recipes.api import RLJobSpec
from rljob.recipes.runconfig import API_KEYS_SECRET_KEY

__all__ = ["problems"]


def problems(spec: RLJobSpec) -> list[str]:
    """One line when spec.service is set without spec.service.apiKeySecret."""
    svc = spec.service
    if svc is None or svc.api_key_secret:
        return []
    return [
        "spec.service.apiKeySecret: required: name a Secret (same namespace) whose key "
        f"`{API_KEYS_SECRET_KEY}` lists the accepted API keys, comma-separated, each starting with tml- "
        f"(kubectl create secret generic NAME --from-literal={API_KEYS_SECRET_KEY}=tml-...); "
        "the Tinker API does not run without keys"
    ]
