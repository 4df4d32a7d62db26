"""Operator process configuration, from environment variables (set by the chart's Deployment)."""

from __future__ import annotations

import dataclasses
import os

from rljob.recipes import podpolicy


def _bool(value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True, slots=True)
class OperatorConfig:
    """Every knob of the operator process; `from_env` documents the variable of each."""

    workers: int = 8
    resync_s: float = 600.0
    metrics_addr: str = "0.0.0.0"
    metrics_port: int = 8080
    metrics_auth: bool = False  # only callers the API server authorizes (TokenReview + SubjectAccessReview)
    metrics_cert: str | None = None  # HTTPS for /metrics when set (with metrics_key)
    metrics_key: str | None = None
    webhook_enabled: bool = True
    webhook_addr: str = "0.0.0.0"
    webhook_port: int = 9443
    webhook_host: str | None = None
    webhook_cert: str | None = "/etc/rljob/webhook/tls.crt"
    webhook_key: str | None = "/etc/rljob/webhook/tls.key"
    namespaces: tuple[str, ...] = ()  # () serves every namespace (RLJOB_NAMESPACES: comma-separated)
    # What RLJobs' pods may ask for (RLJOB_POD_POLICY: JSON, the chart's podPolicy values; a bad one stops
    # the operator at start with podpolicy.PolicyError naming the field).
    pod_policy: podpolicy.PodPolicy = podpolicy.DEFAULT
    # Whether the cluster's JobSet admits the failure action RestartJob (RLJOB_JOBSET_RESTART_JOB: auto,
    # enabled or disabled; the chart's jobset.restartJob; rljob.operator.jobset_gate).
    jobset_restart_job: str = "auto"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorConfig:
        e = dict(os.environ if env is None else env)
        d = cls()
        return cls(
            workers=int(e.get("RLJOB_WORKERS", d.workers)),
            resync_s=float(e.get("RLJOB_RESYNC_SECONDS", d.resync_s)),
            metrics_addr=e.get("RLJOB_METRICS_ADDR", d.metrics_addr),
            metrics_port=int(e.get("RLJOB_METRICS_PORT", d.metrics_port)),
            metrics_auth=_bool(e.get("RLJOB_METRICS_AUTH"), d.metrics_auth),
            metrics_cert=e.get("RLJOB_METRICS_CERT") or d.metrics_cert,
            metrics_key=e.get("RLJOB_METRICS_KEY") or d.metrics_key,
            webhook_enabled=_bool(e.get("RLJOB_WEBHOOK_ENABLED"), d.webhook_enabled),
            webhook_addr=e.get("RLJOB_WEBHOOK_ADDR", d.webhook_addr),
            webhook_port=int(e.get("RLJOB_WEBHOOK_PORT", d.webhook_port)),
            webhook_host=e.get("RLJOB_WEBHOOK_HOST") or d.webhook_host,
            webhook_cert=e.get("RLJOB_WEBHOOK_CERT", d.webhook_cert),
            webhook_key=e.get("RLJOB_WEBHOOK_KEY", d.webhook_key),
            namespaces=tuple(n.strip() for n in e.get("RLJOB_NAMESPACES", "").split(",") if n.strip()),
            pod_policy=podpolicy.from_env(e),
            jobset_restart_job=e.get("RLJOB_JOBSET_RESTART_JOB") or d.jobset_restart_job,
        )
