"""The one module that does Kubernetes I/O for the operator's own writes and startup lists.

Why aiohttp and not the official `kubernetes` client: kopf already talks to the API through aiohttp,
so this adds no import; the official client adds ~28 MiB RSS to the operator process (kopf without it:
47 MiB after imports, with it: 75 MiB; `bench/operator_scale.py` measures the running operator), and
its synchronous calls would need a thread per in-flight request. Credentials come from the same
`kopf.ConnectionInfo` that kopf's login produced (kubeconfig or the pod's ServiceAccount), so the
operator's watches and its writes authenticate as the same identity.

Every write goes through here with the fixed field manager `rljob-operator`:
- `create`: a POST of a whole object we own that the caches say does not exist yet; if it exists after
  all (409 AlreadyExists: a run interrupted half-way), it is read back and, only when its controller owner
  reference names the same owner uid, server-side applied (a JobSet is taken as it is: Kueue may hold its
  spec.suspend; so is the run's credentials Secret: its token is never replaced); an object of that name
  owned by anything else is never adopted or overwritten (`NotOwned`). A create costs
  the API server about a quarter less CPU than an apply of a new object (bench/operator_scale.py);
- `apply`: server-side apply (`application/apply-patch+yaml`, force) of a whole object we own;
- `apply_status`: server-side apply of `.status` through the status subresource (one per reconcile);
- `merge_patch`: a JSON merge patch of a single field we do not own exclusively (JobSet
  `spec.suspend`, which Kueue also writes);
- `post_event`: an events.k8s.io/v1 Event.
Every request is counted in `rljob_operator_api_requests_total{verb,resource,code}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import ssl
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import quote, urlencode

import aiohttp
import kopf
from rljob.operator import metrics
from rljob.operator.conditions import EVENT_COMPONENT, FIELD_MANAGER
from rljob.operator.status.views import controller_uid
from rljob.recipes import naming
from rljob.recipes.api import API_VERSION, GROUP, KIND

logger = logging.getLogger(__name__)

APPLY: Final = "application/apply-patch+yaml"  # JSON is valid YAML: the body is sent as JSON.
MERGE: Final = "application/merge-patch+json"

# Retries of one request on transport errors, 429 and 5xx (API server restarting, overloaded).
RETRY_DELAYS: Final = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0)


@dataclasses.dataclass(frozen=True, slots=True)
class Kind:
    """Where a kind lives on the API."""

    group: str
    version: str
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{quote(namespace)}"
        base += f"/{self.plural}"
        if name:
            base += f"/{quote(name)}"
        if subresource:
            base += f"/{subresource}"
        return base


RLJOB: Final = Kind("rljob.dev", "v1alpha1", "rljobs")
JOBSET: Final = Kind(naming.JOBSET_GROUP, naming.JOBSET_VERSION, "jobsets")
CONFIGMAP: Final = Kind("", "v1", "configmaps")
POD: Final = Kind("", "v1", "pods")
EVENT: Final = Kind("events.k8s.io", "v1", "events")
CORE_EVENT: Final = Kind("", "v1", "events")  # read only: the Job controller's FailedCreate (reconcile)
SERVICEACCOUNT: Final = Kind("", "v1", "serviceaccounts")
ROLE: Final = Kind("rbac.authorization.k8s.io", "v1", "roles")
ROLEBINDING: Final = Kind("rbac.authorization.k8s.io", "v1", "rolebindings")
SERVICE: Final = Kind("", "v1", "services")
NETWORKPOLICY: Final = Kind("networking.k8s.io", "v1", "networkpolicies")
SECRET: Final = Kind("", "v1", "secrets")  # only the run's credentials Secret: created, read back after a 409
# Dry-run for the JobSet's Jobs (Kube.dry_run_create); created only for the compile preflight.
JOB: Final = Kind("batch", "v1", "jobs")

KINDS: Final = {
    (API_VERSION, KIND): RLJOB,
    (naming.JOBSET_API_VERSION, "JobSet"): JOBSET,
    ("v1", "ConfigMap"): CONFIGMAP,
    ("v1", "ServiceAccount"): SERVICEACCOUNT,
    ("rbac.authorization.k8s.io/v1", "Role"): ROLE,
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ROLEBINDING,
    ("v1", "Service"): SERVICE,
    ("networking.k8s.io/v1", "NetworkPolicy"): NETWORKPOLICY,
    ("v1", "Secret"): SECRET,
    ("batch/v1", "Job"): JOB,
}


def kind_of(obj: Mapping[str, Any]) -> Kind:
    key = (str(obj.get("apiVersion")), str(obj.get("kind")))
    try:
        return KINDS[key]
    except KeyError:
        raise ValueError(f"the operator does not write {key[1]} ({key[0]})") from None


class NotOwned(Exception):
    """An object with the name of a child exists, and its controller owner is not the RLJob creating it."""

    def __init__(self, kind: str, namespace: str, name: str, owner: str) -> None:
        self.kind, self.namespace, self.name, self.owner = kind, namespace, name, owner
        by = f"is controlled by uid {owner}" if owner else "has no controller owner"
        super().__init__(f"{kind} {namespace}/{name} exists and {by}, not this RLJob: rename or delete it")


class ApiError(Exception):
    """A non-retryable answer from the API server."""

    def __init__(self, status: int, body: Mapping[str, Any] | str) -> None:
        self.status = status
        self.body = body
        message = body.get("message", "") if isinstance(body, Mapping) else str(body)
        self.reason = str(body.get("reason", "")) if isinstance(body, Mapping) else ""
        super().__init__(f"HTTP {status}: {message}")


LoginFn = Callable[[], Awaitable[kopf.ConnectionInfo]]


class Kube:
    """A small async client: one aiohttp session, bounded connections, retries, field manager fixed."""

    def __init__(self, login: LoginFn, *, max_connections: int = 16, timeout_s: float = 60.0) -> None:
        self._login = login
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ssl: ssl.SSLContext | bool = True
        self._lock = asyncio.Lock()
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=10)

    async def _ensure(self, relogin: bool = False) -> tuple[aiohttp.ClientSession, kopf.ConnectionInfo]:
        async with self._lock:
            if relogin or self._info is None:
                self._info = await self._login()
                if self._info.insecure:
                    self._ssl = False
                else:
                    self._ssl = self._info.as_ssl_context()
                if self._session is not None:
                    await self._session.close()
                    self._session = None
            if self._session is None:
                connector = aiohttp.TCPConnector(limit=self._max_connections, ssl=self._ssl)
                self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
            assert self._info is not None
            return self._session, self._info

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        resource: str,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One API call with retries on transport errors, 429 and 5xx; 401 triggers a re-login once."""
        data = json.dumps(body, separators=(",", ":")) if body is not None else None
        relogged = False
        attempt = 0
        while True:
            session, info = await self._ensure()
            url = info.server.rstrip("/") + path + (f"?{urlencode(params)}" if params else "")
            headers = {"Accept": "application/json", **info.as_http_headers()}
            if data is not None:
                headers["Content-Type"] = content_type
            try:
                async with session.request(method, url, data=data, headers=headers) as resp:
                    text = await resp.text()
                    metrics.API_REQUESTS.labels(method, resource, str(resp.status)).inc()
                    if resp.status == 401 and not relogged:
                        relogged = True
                        await self._ensure(relogin=True)
                        continue
                    if resp.status < 400:
                        return json.loads(text) if text else {}
                    payload: Mapping[str, Any] | str
                    try:
                        payload = json.loads(text)
                    except ValueError:
                        payload = text
                    if (resp.status == 429 or resp.status >= 500) and attempt < len(RETRY_DELAYS):
                        await asyncio.sleep(RETRY_DELAYS[attempt])
                        attempt += 1
                        continue
                    raise ApiError(resp.status, payload)
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                metrics.API_REQUESTS.labels(method, resource, "error").inc()
                if attempt >= len(RETRY_DELAYS):
                    raise
                logger.debug("retrying %s %s after %r", method, path, exc)
                await asyncio.sleep(RETRY_DELAYS[attempt])
                attempt += 1

    async def review(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A TokenReview or SubjectAccessReview (metrics.Authorizer): one POST, no retries of its own."""
        return await self.request(method, path, resource=path.rsplit("/", 1)[-1], body=body)

    # ---------------------------------------------------------------------------------------- reads

    async def list(
        self,
        kind: Kind,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int = 500,
    ) -> list[dict[str, Any]]:
        """Every object of `kind` in `namespace` (None: all namespaces) matching the selectors (paged)."""
        items: list[dict[str, Any]] = []
        cont: str | None = None
        while True:
            params = {"limit": str(limit)}
            if label_selector:
                params["labelSelector"] = label_selector
            if field_selector:
                params["fieldSelector"] = field_selector
            if cont:
                params["continue"] = cont
            page = await self.request("GET", kind.path(namespace), resource=kind.plural, params=params)
            for item in page.get("items") or []:
                item.setdefault("apiVersion", kind.api_version)
                items.append(item)
            cont = (page.get("metadata") or {}).get("continue")
            if not cont:
                return items

    # --------------------------------------------------------------------------------------- writes

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create a whole object we own; when it already exists and has the same controller owner (uid),
        server-side apply it instead; NotOwned when it exists and belongs to anything else."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        try:
            return await self.request(
                "POST",
                kind.path(meta.get("namespace")),
                resource=kind.plural,
                params={"fieldManager": FIELD_MANAGER},
                body=obj,
            )
        except ApiError as exc:
            if exc.status != 409:
                raise
        existing = await self.request(
            "GET", kind.path(meta.get("namespace"), meta["name"]), resource=kind.plural
        )
        owner = controller_uid(existing.get("metadata") or {})
        if not owner or owner != controller_uid(meta):
            raise NotOwned(str(obj.get("kind")), str(meta.get("namespace")), str(meta["name"]), owner)
        if kind == JOBSET:
            # An existing JobSet is taken as it is: its spec is immutable but for suspend, which Kueue may
            # hold (a forced apply of the render's suspend: false would take it from Kueue and start a
            # queued run); _reconcile_mutable then handles suspend and the queue label as for any other.
            return existing
        if kind == SECRET:
            # The run's token: the pods of a run interrupted half-way may hold it already; never replaced.
            return existing
        return await self.apply(obj)

    async def dry_run_create(self, kind: Kind, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST with dryRun=All: the API server validates and admits `obj` (admission webhooks included)
        and persists nothing; ApiError with its message when it would refuse it."""
        meta = obj["metadata"]
        return await self.request(
            "POST",
            kind.path(meta.get("namespace")),
            resource=kind.plural,
            params={"dryRun": "All", "fieldManager": FIELD_MANAGER},
            body=obj,
        )

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply of a whole object (we own every field we send; force resolves conflicts)."""
        kind = kind_of(obj)
        meta = obj["metadata"]
        return await self.request(
            "PATCH",
            kind.path(meta.get("namespace"), meta["name"]),
            resource=kind.plural,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=obj,
            content_type=APPLY,
        )

    async def apply_status(
        self, kind: Kind, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Server-side apply of `.status` (the complete status: fields we stop sending are removed)."""
        api_version = kind.api_version
        body = {
            "apiVersion": api_version,
            "kind": "RLJob" if kind is RLJOB else kind.plural,
            "metadata": {"name": name, "namespace": namespace},
            "status": dict(status),
        }
        return await self.request(
            "PATCH",
            kind.path(namespace, name, "status"),
            resource=f"{kind.plural}/status",
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body=body,
            content_type=APPLY,
        )

    async def merge_patch(
        self, kind: Kind, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> dict[str, Any]:
        return await self.request(
            "PATCH",
            kind.path(namespace, name),
            resource=kind.plural,
            params={"fieldManager": FIELD_MANAGER},
            body=patch,
            content_type=MERGE,
        )

    async def post_event(
        self, regarding: Mapping[str, Any], *, type_: str, reason: str, note: str, action: str = "Reconcile"
    ) -> None:
        """An events.k8s.io/v1 Event about `regarding` (best effort: failures are logged, not raised)."""
        meta = regarding.get("metadata") or {}
        namespace = str(meta.get("namespace") or "default")
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta.get('name', 'rljob')}.{uuid.uuid4().hex[:12]}",
                "namespace": namespace,
            },
            "eventTime": now,
            "reportingController": f"{GROUP}/{EVENT_COMPONENT}",
            "reportingInstance": EVENT_COMPONENT,
            "action": action,
            "reason": reason,
            "note": note[:1024],
            "type": type_,
            "regarding": {
                "apiVersion": regarding.get("apiVersion"),
                "kind": regarding.get("kind"),
                "name": meta.get("name"),
                "namespace": namespace,
                "uid": meta.get("uid"),
            },
        }
        try:
            await self.request("POST", EVENT.path(namespace), resource=EVENT.plural, body=body)
        except (ApiError, aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("could not post event %s on %s/%s: %s", reason, namespace, meta.get("name"), exc)
