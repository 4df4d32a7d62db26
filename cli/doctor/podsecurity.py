"""Pod Security Admission in the RLJob's namespace: creating an RLJob is creating pods (docs/operator.md,
"Pod policy"), so the namespace should enforce a Pod Security Standards level
(https://kubernetes.io/docs/concepts/security/pod-security-admission/). rljob's pods meet `baseline` in
full and `restricted` but for running as root (docs/gke.md, section 5): `baseline` enforced, `restricted`
warned is what fits."""

from __future__ import annotations

from rljob.cli.doctor.common import Obj
from rljob.cli.doctor.findings import Finding, ok, problem, warning

ENFORCE = "pod-security.kubernetes.io/enforce"
CHECK = "namespace.pod-security"


def _fix(namespace: str) -> str:
    return (
        f"kubectl label namespace {namespace} {ENFORCE}=baseline "
        "pod-security.kubernetes.io/warn=restricted pod-security.kubernetes.io/audit=restricted"
    )


def check_pod_security(ns: Obj | bool | None, namespace: str) -> list[Finding]:
    """`ns`: the Namespace object, None when it does not exist, False when doctor may not read it."""
    if ns is False:
        return [
            warning(
                CHECK, f"cannot read namespace {namespace} (forbidden): its Pod Security level is unknown"
            )
        ]
    if ns is None or ns is True:
        return []  # a missing namespace is reported by the checks that need it
    level = ((ns.get("metadata") or {}).get("labels") or {}).get(ENFORCE)
    if level in (None, "", "privileged"):
        return [
            warning(
                CHECK,
                f"namespace {namespace} enforces no Pod Security level ({ENFORCE}: {level or 'unset'}): "
                "creating an RLJob is creating pods, and nothing but the operator's pod policy limits what "
                "they ask for (unless the API server's AdmissionConfiguration sets a default, which doctor "
                "cannot read)",
                _fix(namespace),
            )
        ]
    if level == "restricted":
        return [
            problem(
                CHECK,
                f"namespace {namespace} enforces restricted: rljob's TPU pods run as root (docs/gke.md, "
                "section 5), so the Jobs' pods would be refused and the run stay Pending",
                _fix(namespace),
            )
        ]
    return [ok(CHECK, f"namespace {namespace} enforces Pod Security level {level}")]
