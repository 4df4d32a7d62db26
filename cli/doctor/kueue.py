"""Kueue: the LocalQueue named by spec.queueName exists and is active, and Kueue's WaitForPodsReady
timeout leaves the run's pods the time they need to be ready."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import yaml
from rljob.cli.doctor.common import Obj, _conditions
from rljob.cli.doctor.findings import Finding, ok, problem, warning
from rljob.cli.doctor.needs import Needs
from rljob.cli.doctor.nodepools import tpu_pools

KUEUE_GROUP = "kueue.x-k8s.io"


LOCALQUEUE_CRD = f"localqueues.{KUEUE_GROUP}"


TESTED_KUEUE_VERSION = "v0.19.2"


def check_queue(
    crds: Mapping[str, Obj], local_queues: Sequence[Obj] | None, needs: Needs | None
) -> list[Finding]:
    if needs is None or not needs.queue_name:
        return []
    check = "kueue.localqueue"
    q, ns = needs.queue_name, needs.namespace
    create = (
        f"kubectl apply -f - <<EOF\napiVersion: {KUEUE_GROUP}/v1beta2\nkind: LocalQueue\n"
        f"metadata: {{name: {q}, namespace: {ns}}}\nspec: {{clusterQueue: CLUSTER_QUEUE}}\nEOF"
    )
    if LOCALQUEUE_CRD not in crds:
        return [
            problem(
                check,
                f"spec.queueName is {q!r} but Kueue is not installed (no CRD {LOCALQUEUE_CRD})",
                "install Kueue: kubectl apply --server-side -f https://github.com/kubernetes-sigs/kueue/"
                f"releases/download/{TESTED_KUEUE_VERSION}/manifests.yaml, then create a ClusterQueue and "
                "the LocalQueue (docs/gke.md), or drop spec.queueName",
            )
        ]
    if local_queues is None:
        return [warning(check, f"cannot list LocalQueues in {ns} (forbidden)")]
    match = [lq for lq in local_queues if lq.get("metadata", {}).get("name") == q]
    if not match:
        return [problem(check, f"spec.queueName: no LocalQueue {q!r} in namespace {ns}", create)]
    active = _conditions(match[0]).get("Active")
    if active is not None and active.get("status") != "True":
        reason = f"{active.get('reason', '')}: {active.get('message', '')}".strip(": ")
        cq = match[0].get("spec", {}).get("clusterQueue", "?")
        return [
            problem(
                check,
                f"LocalQueue {ns}/{q} is not active ({reason})",
                f"kubectl get clusterqueue {cq} -o yaml  # the ClusterQueue must exist and be active",
            )
        ]
    return [ok(check, f"LocalQueue {ns}/{q} exists" + (" and is active" if active is not None else ""))]


# Kueue's configuration as its release manifests install it: ConfigMap `kueue-manager-config` in
# `kueue-system`, key `controller_manager_config.yaml` (config/components/manager in the Kueue module).
KUEUE_CONFIG_NAMESPACE = "kueue-system"
KUEUE_CONFIG_MAP = "kueue-manager-config"
KUEUE_CONFIG_KEY = "controller_manager_config.yaml"
# The defaults of WaitForPodsReady (Kueue v0.19.2, apis/config/*/defaults.go): config v1beta2 has it
# always on with a 30-minute timeout; v1beta1 has it off unless `enable: true`, then 5 minutes. The
# recovery timeout defaults to the timeout in both.
DEFAULT_TIMEOUT_SECONDS = {"v1beta2": 30 * 60, "v1beta1": 5 * 60}

# What a pod of an RLJob waits for before it is Ready, which is all Kueue's PodsReady counts (rljob's
# containers have no readiness probe: the weights' download and the XLA compile come after Ready). These
# are assumptions, stated in docs/gke.md, not measurements: the trainer image (JAX, libtpu, MaxText) and
# the sampler image (vLLM's TPU build) are several GB each, pulled by a node that has neither yet; and a
# TPU node pool scaled to zero creates a slice's nodes before the pods can be scheduled.
IMAGE_PULL_SECONDS = 10 * 60
SLICE_CREATE_SECONDS = 15 * 60

_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str) -> float | None:
    """Seconds of a Go duration string (`time.ParseDuration`: "30m", "1h30m", "90s", "0"), or None."""
    s = text.strip()
    if s in ("0", "+0", "-0"):
        return 0.0
    sign = -1.0 if s.startswith("-") else 1.0
    s = s.lstrip("+-")
    if not s:
        return None
    total, pos = 0.0, 0
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if m is None:
            return None
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    return sign * total


def format_minutes(seconds: float) -> str:
    return f"{math.ceil(seconds / 60)}m"


@dataclass(frozen=True)
class PodsReady:
    """Kueue's WaitForPodsReady as its configuration sets it."""

    enabled: bool
    timeout: float = 0.0  # seconds
    recovery: float = 0.0  # seconds; 0: no recovery timeout


def pods_ready_config(text: str) -> PodsReady | str:
    """WaitForPodsReady from the text of Kueue's configuration file, or why it cannot be read."""
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return f"not YAML ({str(exc).splitlines()[0]})"
    if not isinstance(cfg, dict):
        return "not a mapping"
    version = str(cfg.get("apiVersion", "")).rpartition("/")[2] or "v1beta2"
    if version not in DEFAULT_TIMEOUT_SECONDS:
        return f"apiVersion {cfg.get('apiVersion')!r} is not one doctor knows (v1beta1, v1beta2)"
    wfpr = cfg.get("waitForPodsReady") or {}
    if not isinstance(wfpr, dict):
        return "waitForPodsReady is not a mapping"
    if version == "v1beta1" and not wfpr.get("enable", False):
        return PodsReady(False)
    timeout = float(DEFAULT_TIMEOUT_SECONDS[version])
    if wfpr.get("timeout") not in (None, ""):
        got = parse_duration(str(wfpr["timeout"]))
        if got is None:
            return f"waitForPodsReady.timeout {wfpr['timeout']!r} is not a duration"
        timeout = got or DEFAULT_TIMEOUT_SECONDS[version]  # 0 means the default (defaults.go)
    recovery = timeout
    if wfpr.get("recoveryTimeout") not in (None, ""):
        got = parse_duration(str(wfpr["recoveryTimeout"]))
        if got is None:
            return f"waitForPodsReady.recoveryTimeout {wfpr['recoveryTimeout']!r} is not a duration"
        recovery = got
    return PodsReady(True, timeout, recovery)


def expected_ready_seconds(needs: Needs, nodes: Sequence[Obj]) -> tuple[float, str]:
    """How long this run's pods may take to be Ready after Kueue admits it, and why (the slowest role)."""
    pools = tpu_pools(nodes).values()
    # Roles of the same slice shape share its pools (as the node pool check adds them up).
    wanted: dict[tuple[str, str], int] = {}
    for need in needs.roles:
        shape = (need.tpu.accelerator, need.tpu.topology)
        wanted[shape] = wanted.get(shape, 0) + need.tpu.hosts * need.slices
    worst, why = 0.0, ""
    for need in needs.roles:
        shape = (need.tpu.accelerator, need.tpu.topology)
        ready_nodes = sum(p.ready for p in pools if (p.accelerator, p.topology) == shape)
        seconds, parts = float(IMAGE_PULL_SECONDS), [f"image pull ~{format_minutes(IMAGE_PULL_SECONDS)}"]
        if ready_nodes < wanted[shape]:
            seconds += SLICE_CREATE_SECONDS
            parts.append(f"creating its {need.tpu.type_name} nodes ~{format_minutes(SLICE_CREATE_SECONDS)}")
        if seconds > worst:
            worst, why = seconds, f"{need.role}: " + " + ".join(parts)
    return worst, why


def check_pods_ready_timeout(
    crds: Mapping[str, Obj], config: Obj | bool | None, nodes: Sequence[Obj], needs: Needs | None
) -> list[Finding]:
    """Kueue evicts a Workload whose pods are not all Ready within waitForPodsReady.timeout of admission
    (and within recoveryTimeout after one failed): compare both with how long this run's pods may take.

    ``config``: Kueue's ConfigMap; None when it does not exist, False when it may not be read."""
    if needs is None or not needs.queue_name or LOCALQUEUE_CRD not in crds:
        return []
    check = "kueue.waitforpodsready"
    where = f"ConfigMap {KUEUE_CONFIG_NAMESPACE}/{KUEUE_CONFIG_MAP}"
    expected, why = expected_ready_seconds(needs, nodes)
    want = format_minutes(max(2 * expected, DEFAULT_TIMEOUT_SECONDS["v1beta2"]))
    fix = (
        f"in {where}, key {KUEUE_CONFIG_KEY}: waitForPodsReady: {{timeout: {want}, "
        f"recoveryTimeout: {want}}}, then kubectl -n kueue-system rollout restart "
        "deployment/kueue-controller-manager (docs/gke.md)"
    )
    if config is False:
        return [warning(check, f"cannot read {where} (forbidden): Kueue's WaitForPodsReady timeout unknown")]
    if config is None:
        return [
            warning(
                check,
                f"no {where}: Kueue's WaitForPodsReady timeout unknown (v0.19 default: 30m); this run's "
                f"pods may take ~{format_minutes(expected)} to be ready ({why})",
                fix,
            )
        ]
    assert isinstance(config, dict)
    text = (config.get("data") or {}).get(KUEUE_CONFIG_KEY)
    if text is None:
        return [warning(check, f"{where} has no key {KUEUE_CONFIG_KEY}", fix)]
    got = pods_ready_config(str(text))
    if isinstance(got, str):
        return [problem(check, f"{where}, {KUEUE_CONFIG_KEY}: {got}", fix)]
    if not got.enabled:
        return [ok(check, "Kueue's WaitForPodsReady is off: no admitted run is evicted for slow pods")]
    limits = [("timeout", got.timeout)] + ([("recoveryTimeout", got.recovery)] if got.recovery else [])
    short = [f"waitForPodsReady.{name} {format_minutes(sec)}" for name, sec in limits if sec < expected]
    if short:
        return [
            warning(
                check,
                f"Kueue evicts and requeues this run if its pods are not ready in time ({', '.join(short)}); "
                f"they may take ~{format_minutes(expected)} ({why})",
                fix,
            )
        ]
    told = ", ".join(f"{name} {format_minutes(sec)}" for name, sec in limits)
    return [
        ok(
            check,
            f"Kueue's WaitForPodsReady ({told}) leaves this run's pods ~{format_minutes(expected)} to be "
            f"ready ({why})",
        )
    ]
