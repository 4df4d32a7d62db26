"""Pod overrides (`spec.trainer.template`, `spec.sampler.template`): checked against the TPU placement and
merged into the rendered pods.

The shape is a pod template's, metadata {labels, annotations} and spec, as in KubeRay's group `template`
and Kubeflow Trainer's podTemplateOverrides; the container fields (env, envFrom, volumeMounts, resources)
apply to every TPU container of the role. `problems` refuses, every problem at once with its field named,
what would break the run rljob renders:

- node selection on the TPU keys (the slice's accelerator, topology and workload policy are rljob's, from
  `tpu`), in nodeSelector or in required/preferred node affinity;
- google.com/tpu in resources (the chips come from the slice shape), and a request above its limit;
- env names the render sets (RLJOB_CONFIG, the JAX/megascale coordinates, the pod's index...), which a
  second definition would silently replace;
- labels and annotations of rljob, JobSet and Job (the JobSet controller and the env read them);
- volume names and mount paths rljob uses (the run config at /etc/rljob, /dev/shm), mounts of volumes the
  template does not define, a volume with no source or two;
- a GCS FUSE CSI volume without the pod annotation gke-gcsfuse/volumes: "true" that injects its sidecar
  (https://cloud.google.com/kubernetes-engine/docs/how-to/persistent-volumes/cloud-storage-fuse-csi-driver-sidecar).

The free-form parts (valueFrom, envFrom, volumes, affinity) are checked against the Kubernetes pod schema
that JobSet's CRD embeds (rljob.recipes.schema), so a typo in them is refused here rather than pruned by
the API server.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Final

from rljob.recipes import k8s_rules, libtpu, schema, syntax, topology
from rljob.recipes.api import PodTemplate
from rljob.recipes.runconfig import (
    API_KEYS_ENV,
    CACHE_VOLUME,
    CONFIG_DIR,
    CONFIG_ENV,
    LOCAL_CACHE_DEFAULT,
    RAY_AUTH_MODE_ENV,
    RAY_AUTH_TOKEN_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    VLLM_API_KEY_ENV,
)
from rljob.recipes.syntax import key_path
from rljob.recipes.tpu import ACCELERATOR_LABEL, PLACEMENT_POLICY_LABEL, TOPOLOGY_LABEL, TPU_RESOURCE

RESERVED_ENV: Final = frozenset(
    {
        CONFIG_ENV,
        topology.NAME_ENV,
        topology.ROLE_ENV,
        topology.CONTAINER_INDEX_ENV,
        topology.CONTAINERS_ENV,
        topology.TENSORBOARD_DIR_ENV,
        "POD_NAME",
        "POD_NAMESPACE",
        "JOBSET_NAME",
        "JOB_INDEX",
        "POD_INDEX",
        topology.COORDINATOR_ENV,
        API_KEYS_ENV,
        RAY_AUTH_MODE_ENV,
        RAY_AUTH_TOKEN_ENV,
        VLLM_API_KEY_ENV,
    }
)
"""Env names the render sets (a test checks every rendered name is here), and RLJOB_TENSORBOARD_DIR, which the
trainer reads as its own setting."""
TRAINER_RESERVED_ENV: Final = frozenset({libtpu.ENV})
"""Env names the render sets in the trainer's containers only (a sampler's template may set them)."""
RESERVED_ENV_PREFIXES: Final = ("MEGASCALE_", "RLJOB_")
"""Every RLJOB_* name is rljob's own (the entrypoints read them; the render sets most), and MEGASCALE_* is
the multi-slice runtime's."""
USER_ENV: Final = frozenset({TLS_CERT_ENV, TLS_KEY_ENV})
"""RLJOB_* names a template sets itself: the Tinker API's TLS certificate and key (docs/tinker.md)."""

RESERVED_VOLUMES: Final = frozenset({"run-config", "dshm", CACHE_VOLUME})
RESERVED_MOUNTS: Final = (CONFIG_DIR, "/dev/shm", LOCAL_CACHE_DEFAULT)
TPU_NODE_KEYS: Final = (ACCELERATOR_LABEL, TOPOLOGY_LABEL, PLACEMENT_POLICY_LABEL)
RESERVED_LABELS: Final = frozenset(
    {
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/component",
        "controller-uid",
        "job-name",
    }
)
RESERVED_PREFIXES: Final = (
    "rljob.dev/",
    "jobset.sigs.k8s.io/",
    "alpha.jobset.sigs.k8s.io/",
    "batch.kubernetes.io/",
    "kueue.x-k8s.io/",
)
GCSFUSE_DRIVER: Final = "gcsfuse.csi.storage.gke.io"
GCSFUSE_ANNOTATION: Final = "gke-gcsfuse/volumes"

# Kubernetes qualified names (label and annotation keys): [prefix/]name, prefix a DNS-1123 subdomain.
_QUALIFIED = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_ANNOTATIONS_MAX = 256 * 1024  # apimachinery's TotalAnnotationSizeLimitB


def _qualified(key: str) -> str | None:
    """Why `key` is not a Kubernetes qualified name, or None."""
    prefix, _, name = key.rpartition("/")
    if not _QUALIFIED.match(key) or len(name) > 63 or len(prefix) > 253:
        return (
            "must be a qualified name [prefix/]name (name: at most 63 letters, digits, '-', '_', '.', "
            "starting and ending with a letter or digit; prefix: a DNS-1123 subdomain)"
        )
    return None


def _reserved_key(key: str) -> bool:
    return key in RESERVED_LABELS or key.startswith(RESERVED_PREFIXES)


_SUFFIX: Final = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
}
_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9.]+)?$"
)


def quantity(value: str | int) -> Decimal:
    """A resource quantity's value (apimachinery's resource.Quantity: binary, decimal and exponent forms);
    the field's pattern has already been checked."""
    m = _QUANTITY.match(str(value))
    if m is None:
        raise ValueError(f"not a quantity: {value!r}")
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    if suffix[:1] in ("e", "E"):
        return number * Decimal(10) ** Decimal(suffix[1:])
    return number * _SUFFIX[suffix]


def _node_terms(affinity: dict[str, Any]) -> list[tuple[str, Any]]:
    """(path, matchExpressions/matchFields list) of every node-affinity term, required and preferred."""
    node = affinity.get("nodeAffinity")
    if not isinstance(node, dict):
        return []
    out: list[tuple[str, Any]] = []
    required = node.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    if isinstance(required, dict):
        for i, term in enumerate(required.get("nodeSelectorTerms") or []):
            if isinstance(term, dict):
                base = f"nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{i}]"
                out += [(f"{base}.{k}", term.get(k)) for k in ("matchExpressions", "matchFields")]
    for i, pref in enumerate(node.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
        if isinstance(pref, dict) and isinstance(pref.get("preference"), dict):
            base = f"nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[{i}].preference"
            out += [(f"{base}.{k}", pref["preference"].get(k)) for k in ("matchExpressions", "matchFields")]
    return out


def problems(path: str, template: PodTemplate | None) -> list[str]:
    """Every problem of one role's template, as `spec.<role>.template.<field>: message` lines."""
    if template is None:
        return []
    out: list[str] = []
    meta, spec = template.metadata, template.spec
    annotations: dict[str, str] = {}
    if meta is not None:
        for kind, values in (("labels", meta.labels), ("annotations", meta.annotations)):
            for key, value in (values or {}).items():
                where = key_path(f"{path}.metadata.{kind}", key)
                why = _qualified(key)
                if why:
                    out.append(f"{where}: {why}")
                elif _reserved_key(key):
                    out.append(f"{where}: set by rljob, JobSet or Job (may not be overridden)")
                if kind == "labels" and not syntax.matches(syntax.LABEL_VALUE, value):
                    out.append(f"{where}: {syntax.DESCRIPTIONS[syntax.LABEL_VALUE]}")
        annotations = meta.annotations or {}
        size = sum(len(k) + len(v) for k, v in annotations.items())
        if size > _ANNOTATIONS_MAX:
            out.append(f"{path}.metadata.annotations: {size} bytes, over Kubernetes' {_ANNOTATIONS_MAX}")
    if spec is None:
        return out
    sp = f"{path}.spec"

    # ---- env
    seen: set[str] = set()
    for i, env in enumerate(spec.env or []):
        where = f"{sp}.env[{i}]"
        reserved = env.name in RESERVED_ENV or env.name.startswith(RESERVED_ENV_PREFIXES)
        if reserved and env.name not in USER_ENV:
            out.append(f"{where}.name: {env.name} is set by rljob (the run's own coordinates)")
        elif env.name in TRAINER_RESERVED_ENV and path.startswith("spec.trainer"):
            out.append(f"{where}.name: {env.name} is set by rljob from {libtpu.FIELD} (set the flags there)")
        if env.name in seen:
            out.append(f"{where}.name: {env.name} is defined twice")
        seen.add(env.name)
        if env.value is not None and env.value_from is not None:
            out.append(f"{where}: value and valueFrom are exclusive")
        if env.value_from is not None:
            out += schema.validate_pod_part("valueFrom", env.value_from, f"{where}.valueFrom")
            if len(env.value_from) != 1:
                out.append(f"{where}.valueFrom: must name exactly one source")
            out += k8s_rules.env_value_from(f"{where}.valueFrom", env.value_from)
    for i, source in enumerate(spec.env_from or []):
        out += schema.validate_pod_part("envFrom", source, f"{sp}.envFrom[{i}]")
        if len({"configMapRef", "secretRef"} & set(source)) != 1:
            out.append(f"{sp}.envFrom[{i}]: must name exactly one of configMapRef, secretRef")
        out += k8s_rules.env_from(f"{sp}.envFrom[{i}]", source)

    # ---- volumes and mounts
    names: set[str] = set()
    gcsfuse = False
    for i, volume in enumerate(spec.volumes or []):
        where = f"{sp}.volumes[{i}]"
        out += schema.validate_pod_part("volumes", volume, where)
        name = volume.get("name")
        if not isinstance(name, str) or not syntax.matches(syntax.DNS1123_LABEL, name):
            out.append(f"{where}.name: required, {syntax.DESCRIPTIONS[syntax.DNS1123_LABEL]}")
            continue
        if name in RESERVED_VOLUMES:
            out.append(f"{where}.name: {name} is rljob's ({', '.join(sorted(RESERVED_VOLUMES))})")
        if name in names:
            out.append(f"{where}.name: {name} is defined twice")
        names.add(name)
        sources = [k for k in volume if k != "name"]
        if len(sources) != 1:
            out.append(f"{where}: must have exactly one volume source, has {len(sources)}")
        out += k8s_rules.volume(where, volume)
        csi = volume.get("csi")
        if isinstance(csi, dict) and csi.get("driver") == GCSFUSE_DRIVER:
            gcsfuse = True
    if gcsfuse and annotations.get(GCSFUSE_ANNOTATION) != "true":
        out.append(
            f'{path}.metadata.annotations: a {GCSFUSE_DRIVER} volume needs {GCSFUSE_ANNOTATION}: "true" '
            "(it injects the GCS FUSE sidecar)"
        )
    paths: set[str] = set()
    for i, mount in enumerate(spec.volume_mounts or []):
        where = f"{sp}.volumeMounts[{i}]"
        if mount.name not in names:
            out.append(f"{where}.name: no volume {mount.name} in {sp}.volumes")
        clean = mount.mount_path.rstrip("/") or "/"
        if any(clean == r or clean.startswith(r + "/") or r.startswith(clean + "/") for r in RESERVED_MOUNTS):
            out.append(
                f"{where}.mountPath: {mount.mount_path} overlaps rljob's {' or '.join(RESERVED_MOUNTS)}"
            )
        if clean in paths:
            out.append(f"{where}.mountPath: {mount.mount_path} is mounted twice")
        out += k8s_rules.sub_path(f"{where}.subPath", mount.sub_path)
        paths.add(clean)

    # ---- resources
    if spec.resources is not None:
        requests, limits = spec.resources.requests or {}, spec.resources.limits or {}
        for kind, quantities in (("requests", requests), ("limits", limits)):
            if TPU_RESOURCE in quantities:
                out.append(
                    f'{sp}.resources.{kind}["{TPU_RESOURCE}"]: the chips come from spec.*.tpu (the slice '
                    "shape); remove it"
                )
        mine = {TPU_RESOURCE}
        out += k8s_rules.resources(
            f"{sp}.resources",
            {k: v for k, v in requests.items() if k not in mine},
            {k: v for k, v in limits.items() if k not in mine},
        )
        for res, limit in limits.items():
            if res in requests and res != TPU_RESOURCE and quantity(requests[res]) > quantity(limit):
                out.append(
                    f"{key_path(f'{sp}.resources.requests', res)}: {requests[res]} is above its limit {limit}"
                )

    # ---- scheduling
    for key, value in (spec.node_selector or {}).items():
        where = key_path(f"{sp}.nodeSelector", key)
        if key in TPU_NODE_KEYS:
            out.append(f"{where}: the TPU node pool is chosen by spec.*.tpu; remove it")
        elif why := _qualified(key):
            out.append(f"{where}: {why}")
        if not syntax.matches(syntax.LABEL_VALUE, value):
            out.append(f"{where}: {syntax.DESCRIPTIONS[syntax.LABEL_VALUE]}")
    if spec.affinity is not None:
        out += schema.validate_pod_part("affinity", spec.affinity, f"{sp}.affinity")
        out += k8s_rules.affinity(f"{sp}.affinity", spec.affinity)
        for where, exprs in _node_terms(spec.affinity):
            for j, expr in enumerate(exprs if isinstance(exprs, list) else []):
                if isinstance(expr, dict) and expr.get("key") in TPU_NODE_KEYS:
                    out.append(
                        f"{sp}.affinity.{where}[{j}].key: {expr['key']} is chosen by spec.*.tpu; remove the "
                        "term"
                    )
    for i, tol in enumerate(spec.tolerations or []):
        out += k8s_rules.toleration(f"{sp}.tolerations[{i}]", tol.key, tol.operator, tol.value)
        if tol.operator == "Exists" and tol.value:
            out.append(f"{sp}.tolerations[{i}].value: must be empty with operator Exists")
        if tol.toleration_seconds is not None and tol.effect != "NoExecute":
            out.append(f"{sp}.tolerations[{i}].tolerationSeconds: only read with effect NoExecute")
    return out


# ------------------------------------------------------------------------------------------- merge


def pod_labels(template: PodTemplate | None) -> dict[str, str]:
    return dict((template and template.metadata and template.metadata.labels) or {})


def pod_annotations(template: PodTemplate | None) -> dict[str, str]:
    return dict((template and template.metadata and template.metadata.annotations) or {})


def _dump(items: list[Any] | None) -> list[dict[str, Any]]:
    return [i if isinstance(i, dict) else i.model_dump(mode="json", exclude_none=True) for i in items or []]


def env(template: PodTemplate | None) -> list[dict[str, Any]]:
    return _dump(template.spec.env) if template and template.spec else []


def env_from(template: PodTemplate | None) -> list[dict[str, Any]]:
    return _dump(template.spec.env_from) if template and template.spec else []


def volumes(template: PodTemplate | None) -> list[dict[str, Any]]:
    return _dump(template.spec.volumes) if template and template.spec else []


def volume_mounts(template: PodTemplate | None) -> list[dict[str, Any]]:
    return _dump(template.spec.volume_mounts) if template and template.spec else []


def tolerations(template: PodTemplate | None) -> list[dict[str, Any]]:
    return _dump(template.spec.tolerations) if template and template.spec else []


def node_selector(template: PodTemplate | None) -> dict[str, str]:
    return dict((template and template.spec and template.spec.node_selector) or {})


def affinity(template: PodTemplate | None) -> dict[str, Any] | None:
    return template.spec.affinity if template and template.spec else None


def service_account(template: PodTemplate | None) -> str | None:
    return template.spec.service_account_name if template and template.spec else None


def resources(base: dict[str, Any], template: PodTemplate | None) -> dict[str, Any]:
    """rljob's container resources (`base`: the CPU/memory floor and the chips) with the template's: its
    requests win over the floor, a limit without a request sets the request (as Kubernetes defaults it),
    the chips stay."""
    res = template and template.spec and template.spec.resources
    if not res:
        return base
    user_req, user_lim = dict(res.requests or {}), dict(res.limits or {})
    requests = {**base["requests"], **user_lim, **user_req}
    limits = {**user_lim, **base["limits"]}
    # The chips last, so the order of keys is the floor's, then the user's, then google.com/tpu.
    requests[TPU_RESOURCE] = requests.pop(TPU_RESOURCE)
    limits[TPU_RESOURCE] = limits.pop(TPU_RESOURCE)
    return {"requests": requests, "limits": limits}
