"""What one RLJob manifest needs from the cluster (its TPU slices, queue, the objects its pod overrides
name), resolved with the same plan `rljob render` uses; and the check of those named objects."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rljob.cli.doctor.common import Obj
from rljob.cli.doctor.findings import Finding, ok, problem, warning
from rljob.recipes import naming
from rljob.recipes.runconfig import TpuPlan


@dataclass(frozen=True)
class RoleNeed:
    """The slices one role of the RLJob needs."""

    role: str  # trainer | sampler
    tpu: TpuPlan
    slices: int
    cache_bytes: int = 0  # the ephemeral storage one pod of the role asks for its caches (the plan's)

    @property
    def disk_gb(self) -> int | None:
        """The smallest node boot disk that holds the caches' request (recipes/disk.py)."""
        from rljob.recipes import disk

        return disk.boot_disk_gb(self.cache_bytes) if self.cache_bytes else None


@dataclass(frozen=True)
class Reference:
    """An object a pod override names, which must exist in the RLJob's namespace before its pods start."""

    kind: str  # Secret | ConfigMap | ServiceAccount | PersistentVolumeClaim | CSIDriver (cluster-scoped)
    name: str
    field: str  # where the manifest names it
    key: str | None = None  # a Secret's or ConfigMap's key
    optional: bool = False


def template_references(spec: Any) -> list[Reference]:
    """Every object the roles' pod overrides name (rljob.recipes.api.PodTemplate), in manifest order."""
    out: list[Reference] = []
    for role in (naming.TRAINER, naming.SAMPLER):
        template = getattr(getattr(spec, role, None), "template", None)
        pod = template.spec if template is not None else None
        if pod is None:
            continue
        base = f"spec.{role}.template.spec"
        for i, env in enumerate(pod.env or []):
            src = env.value_from or {}
            for kind, ref in (("Secret", src.get("secretKeyRef")), ("ConfigMap", src.get("configMapKeyRef"))):
                if isinstance(ref, dict) and ref.get("name"):
                    field_ = f"{base}.env[{i}].valueFrom"
                    out.append(
                        Reference(kind, ref["name"], field_, ref.get("key"), bool(ref.get("optional")))
                    )
        for i, src in enumerate(pod.env_from or []):
            for kind, ref in (("Secret", src.get("secretRef")), ("ConfigMap", src.get("configMapRef"))):
                if isinstance(ref, dict) and ref.get("name"):
                    out.append(
                        Reference(kind, ref["name"], f"{base}.envFrom[{i}]", None, bool(ref.get("optional")))
                    )
        for i, vol in enumerate(pod.volumes or []):
            where = f"{base}.volumes[{i}]"
            secret, cm, pvc, csi = (
                vol.get(k) or {} for k in ("secret", "configMap", "persistentVolumeClaim", "csi")
            )
            if secret.get("secretName"):
                out.append(
                    Reference("Secret", secret["secretName"], where, None, bool(secret.get("optional")))
                )
            if cm.get("name"):
                out.append(Reference("ConfigMap", cm["name"], where, None, bool(cm.get("optional"))))
            if pvc.get("claimName"):
                out.append(Reference("PersistentVolumeClaim", pvc["claimName"], where))
            if csi.get("driver"):
                out.append(Reference("CSIDriver", csi["driver"], where))
        if pod.service_account_name:
            out.append(Reference("ServiceAccount", pod.service_account_name, f"{base}.serviceAccountName"))
    return out


_CREATE = {
    "Secret": "kubectl -n {ns} create secret generic {name} --from-literal={key}=...",
    "ConfigMap": "kubectl -n {ns} create configmap {name} --from-literal={key}=...",
    "ServiceAccount": "kubectl -n {ns} create serviceaccount {name}",
    "PersistentVolumeClaim": "create the PersistentVolumeClaim {name} in namespace {ns}",
    "CSIDriver": "enable the driver on the cluster (for GCS FUSE: gcloud container clusters update CLUSTER "
    "--update-addons GcsFuseCsiDriver=ENABLED)",
}


def check_references(
    references: Sequence[Reference], found: Mapping[tuple[str, str], Obj | bool | None], namespace: str
) -> list[Finding]:
    """`found[(kind, name)]`: the object (a Secret's or ConfigMap's data keys are checked), None when it
    does not exist, False when doctor may not read it."""
    out: list[Finding] = []
    for ref in references:
        what = f"{ref.kind} {ref.name}" + (f" (key {ref.key})" if ref.key else "") + f", named by {ref.field}"
        got = found.get((ref.kind, ref.name), False)
        fix = _CREATE[ref.kind].format(ns=namespace, name=ref.name, key=ref.key or "KEY")
        if got is False:
            out.append(warning("pods.references", f"cannot read {what}: not checked"))
        elif got is None:
            if ref.optional:
                out.append(ok("pods.references", f"{what}: missing, but optional"))
            else:
                where = "on the cluster" if ref.kind == "CSIDriver" else f"in namespace {namespace}"
                out.append(
                    problem("pods.references", f"{what}: not found {where}; the pods cannot start", fix)
                )
        elif (
            ref.key
            and isinstance(got, dict)
            and ref.key not in {**(got.get("data") or {}), **(got.get("binaryData") or {})}
        ):
            if ref.optional:
                out.append(ok("pods.references", f"{what}: no such key, but optional"))
            else:
                out.append(problem("pods.references", f"{what}: the object has no key {ref.key}", fix))
        else:
            out.append(ok("pods.references", f"{what}: exists"))
    return out


@dataclass(frozen=True)
class Needs:
    """What one RLJob manifest needs from the cluster."""

    name: str
    namespace: str
    roles: tuple[RoleNeed, ...]
    queue_name: str | None = None
    # The manifest as parsed (camelCase JSON): doctor dry-runs it through the operator's webhook.
    manifest: Mapping[str, Any] | None = field(default=None, compare=False)
    # What the pod overrides (spec.*.template) name in the namespace: Secrets, ConfigMaps, ...
    references: tuple[Reference, ...] = ()


class BadInput(Exception):
    """The manifest is wrong; one `spec.path: message` line per problem."""


def needs_from_manifest(path: Path) -> Needs:
    """Resolve FILE with the recipe core (the same plan `rljob render` uses) into what it needs."""
    from rljob.recipes import disk, podpolicy
    from rljob.recipes.plan import PlanError, parse_manifest, resolve

    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        job = parse_manifest(text)
        # The operator's pod policy is the operator's to apply: doctor dry-runs the RLJob through its webhook.
        run = resolve(job, podpolicy.ALLOW_ALL)
    except PlanError as exc:
        raise BadInput("\n".join(exc.problems)) from None
    return Needs(
        run.name,
        run.namespace,
        tuple(
            RoleNeed(
                role,
                plan.tpu,
                count,
                disk.pod_bytes(plan.cache_disk),
            )
            for role, plan, count in (
                ("trainer", run.trainer, run.trainer.slices),
                ("sampler", run.sampler, run.sampler.replicas),
            )
        ),
        run.spec.queue_name,
        job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"}),
        tuple(template_references(run.spec)),
    )
