"""kopf handlers: thin. They feed the reconcile service's caches and answer admission reviews.

Every watch handler is an `on.event` (a low-level handler): kopf stores no progress or diff-base
annotations and adds no finalizer for them, so kopf itself never writes to an RLJob. All writes are the
reconcile service's (rljob.operator.reconcile), one status write per reconcile.

kopf settings (set in `configure`, chosen for 1,000s of RLJobs; kopf's own guidance:
https://kopf.readthedocs.io/en/stable/configuration/ and https://kopf.readthedocs.io/en/stable/peering/):
- standalone, no peering: peering is not leader election (same-priority peers all freeze); the chart
  runs one replica with the Recreate strategy instead, so two operators never overlap;
- queueing.worker_limit: kopf's per-object workers here only copy an event into a dict, but on a
  restart every object gets a worker at once; 50 bounds that burst. The API writes are bounded
  separately by the reconcile pool (`RLJOB_WORKERS`, default 8) and the client's 16 connections;
- watching: server_timeout 300 s (streams are renewed before load balancers go silent), the default
  inactivity_timeout 70 s (bookmarks every 60 s) catches frozen streams, reconnect_backoff 1 s stops a
  reconnect storm when the API server restarts, chunk_size 500 pages the initial lists;
- server-side label selectors: only JobSets/ConfigMaps/Pods labelled by rljob are ever sent to us;
- posting: only explicit events (loggers=False) at WARNING and above, so kopf posts nothing per object;
  the reconcile service posts its own transition events after its status write;
- persistence: our own finalizer name and `rljob.dev` annotation prefix (unused by on.event handlers,
  set so that any future state-changing handler does not write kopf.zalando.org annotations);
- scanning disabled: no list/watch on CRDs and Namespaces is needed (least-privilege RBAC); the
  resources are discovered once at startup;
- networking.request_timeout 60 s (default 300 s) so a hung request is retried sooner.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

import kopf
from rljob.operator import conditions as c
from rljob.operator import k8s, metrics
from rljob.operator.config import OperatorConfig
from rljob.operator.jobset_gate import RestartJobGate
from rljob.operator.plans import PlanCache, warm_up
from rljob.operator.reconcile import Reconciler
from rljob.recipes import podpolicy
from rljob.recipes.api import GROUP, PLURAL, VERSION, RLJob
from rljob.recipes.render import render

logger = logging.getLogger(__name__)

WEBHOOK_ID = "validate-rljob"
MUTABLE = frozenset({"suspend", "queueName"})
# Plans the webhook made, reused by the reconcile of the same RLJob (one render per RLJob, not two).
PLANS = PlanCache()
# The operator's pod policy (RLJOB_POD_POLICY), read at start-up: the webhook and the reconcile plan with it.
POLICY: list[podpolicy.PodPolicy] = [podpolicy.DEFAULT]
# Whether the cluster's JobSet admits the failure action RestartJob (RLJOB_JOBSET_RESTART_JOB), set at
# start-up; when it changes, the plans made under the old answer are dropped.
GATE: list[RestartJobGate] = [RestartJobGate()]


def render_with_policy(job: RLJob) -> list[dict[str, Any]]:
    """rljob.recipes.render.render under the operator's pod policy and what the cluster's JobSet admits
    (the one Renderer of this process)."""
    return render(job, POLICY[0], restart_job=GATE[0].admitted)


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Apply the settings explained in the module docstring."""
    settings.peering.standalone = True
    settings.queueing.worker_limit = 50
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.watching.reconnect_backoff = 1.0
    settings.watching.chunk_size = 500
    settings.watching.label_selectors[k8s.JOBSET.group, k8s.JOBSET.plural] = c.LABEL_NAME
    settings.watching.label_selectors["configmaps"] = c.LABEL_PROGRESS
    settings.watching.label_selectors["pods"] = c.LABEL_NAME
    settings.posting.enabled = True
    settings.posting.loggers = False
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=c.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.scanning.disabled = True
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    if config.webhook_enabled:
        settings.admission.server = kopf.WebhookServer(
            addr=config.webhook_addr,
            port=config.webhook_port,
            certfile=config.webhook_cert,
            pkeyfile=config.webhook_key,
            host=config.webhook_host,
        )
        settings.admission.managed = None  # the chart owns the ValidatingWebhookConfiguration


def _ssl(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    if not cert or not key:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


async def login() -> kopf.ConnectionInfo:
    """A kubeconfig (local process, tests) or the pod's ServiceAccount (in the cluster)."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_kubeconfig(settings=settings) or kopf.login_with_service_account(settings=settings)
    if info is None:
        raise kopf.LoginError("no kubeconfig (KUBECONFIG) and no in-cluster ServiceAccount token")
    return info


@kopf.on.login()
async def on_login(**_: Any) -> kopf.ConnectionInfo:
    return await login()


@kopf.on.startup()
async def on_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = OperatorConfig.from_env()
    configure(settings, config)
    POLICY[0] = config.pod_policy
    warm_up(render_with_policy)  # before kopf serves the first admission request
    kube = k8s.Kube(login)
    gate = GATE[0] = RestartJobGate(config.jobset_restart_job)
    await gate.probe(kube, config.namespaces[0] if config.namespaces else "default")
    # The metrics endpoint's reviews go through a client of their own (two connections): a flood of callers
    # never queues behind, nor ahead of, the reconcile's requests.
    memo.metrics_kube = k8s.Kube(login, max_connections=2, timeout_s=10.0)
    memo.metrics_runner = await metrics.start_server(
        config.metrics_addr,
        config.metrics_port,
        auth=metrics.Authorizer(memo.metrics_kube.review) if config.metrics_auth else None,
        ssl_context=_ssl(config.metrics_cert, config.metrics_key),
    )
    reconciler = Reconciler(
        kube,
        render_with_policy,
        workers=config.workers,
        resync_s=config.resync_s,
        plans=PLANS,
        namespaces=config.namespaces,
        gate=gate,
    )
    memo.reconciler = reconciler  # before the first await that may be cancelled: cleanup closes it
    await reconciler.prefill()
    reconciler.start()
    logger.info(
        "rljob operator started: %d workers, %d RLJobs known", config.workers, len(reconciler.caches.rljobs)
    )


@kopf.on.cleanup()
async def on_cleanup(memo: kopf.Memo, **_: Any) -> None:
    reconciler: Reconciler | None = memo.get("reconciler")
    if reconciler is not None:
        await reconciler.stop()
        await reconciler.kube.close()
    runner = memo.get("metrics_runner")
    if runner is not None:
        await runner.cleanup()
    metrics_kube: k8s.Kube | None = memo.get("metrics_kube")
    if metrics_kube is not None:
        await metrics_kube.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_rljob(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.reconciler.observe_rljob(type, body)


@kopf.on.event(k8s.JOBSET.group, k8s.JOBSET.version, k8s.JOBSET.plural, labels={c.LABEL_NAME: kopf.PRESENT})
async def on_jobset(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.reconciler.observe_jobset(type, body)


@kopf.on.event("batch", "v1", "jobs", labels={c.PREFLIGHT_LABEL: kopf.PRESENT, c.LABEL_NAME: kopf.PRESENT})
async def on_preflight(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.reconciler.observe_preflight(type, body)


@kopf.on.event("v1", "configmaps", labels={c.LABEL_PROGRESS: kopf.PRESENT})
async def on_progress(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.reconciler.observe_progress(type, body)


def _pod_failed(body: kopf.Body, **_: Any) -> bool:
    status = body.get("status") or {}
    if status.get("phase") == "Failed":
        return True
    return any(
        x.get("type") == "DisruptionTarget" and x.get("status") == "True"
        for x in status.get("conditions") or []
    )


@kopf.on.event("v1", "pods", labels={c.LABEL_NAME: kopf.PRESENT}, when=_pod_failed)
async def on_pod(type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo.reconciler.observe_pod(type, body)


@kopf.on.validate(GROUP, VERSION, PLURAL, id=WEBHOOK_ID, operations=["CREATE", "UPDATE"])
async def on_validate(body: kopf.Body, **kwargs: Any) -> None:
    """The same parse + plan the reconcile runs; refused with every problem, `spec.path: message`."""
    old: kopf.Body | None = kwargs.get("old")
    operation: str | None = kwargs.get("operation")
    if operation == "UPDATE" and old is not None:
        before, after = dict(old.get("spec") or {}), dict(body.get("spec") or {})
        if before == after:
            return
        # The CRD's CEL rules refuse these first; this also covers values under free-form fields.
        changed = sorted(
            k for k in set(before) | set(after) if k not in MUTABLE and before.get(k) != after.get(k)
        )
        if changed:
            fields = ", ".join(f"spec.{k}" for k in changed)
            raise kopf.AdmissionError(
                f"{fields}: immutable (only spec.suspend and spec.queueName may change)", 422
            )
    plan = PLANS.make_plan(dict(body), render_with_policy)
    if plan.error is not None:
        raise kopf.AdmissionError(plan.error, code=422)
