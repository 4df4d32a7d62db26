"""Kubernetes' own validation of the values a pod template passes on, so that what `rljob validate` accepts
the API server admits (the JobSet controller's Job create is otherwise refused, and JobSet only posts an
event).

The rules are those of the API server's pod validation (k8s.io/kubernetes pkg/apis/core/validation and
k8s.io/apimachinery pkg/util/validation), for the fields a template may set:

- object names: a Secret, ConfigMap or PersistentVolumeClaim name is a DNS-1123 subdomain
  (`ValidateSecretName`, `ValidateConfigMapName`);
- keys: a Secret or ConfigMap key is at most 253 of `[-._a-zA-Z0-9]`, not `.`/`..`, not starting with `..`
  (`IsConfigMapKey`); an item's `path` and a mount's `subPath` are relative, without a `..` element
  (`validateLocalDescendingPath`); modes are 0..0777;
- quantities: never negative (`ValidateResourceQuantityValue`); an extended resource (a name with a domain
  other than kubernetes.io) must have a limit, its request equal to it, and whole numbers
  (`ValidateResourceRequirements`); a resource name without a domain is one of the standard ones;
- qualified names (`IsQualifiedName`): toleration keys, node-selector and label-selector keys, topology keys;
  a toleration with no key must use `Exists`;
- operators: node selector requirements In/NotIn (values), Exists/DoesNotExist (no values), Gt/Lt (one
  integer); matchFields only `metadata.name` with In/NotIn and one value; label selectors
  In/NotIn/Exists/DoesNotExist; weights 1..100;
- env: `fieldRef.fieldPath` one the downward API serves, `resourceFieldRef.resource` one it serves.

Every problem is a `spec.<role>.template.spec.<field>: message` line. The shapes (unknown fields, types)
were checked before against JobSet's embedded pod schema (rljob.recipes.schema); here only values.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Final

from rljob.recipes import syntax

CONFIG_KEY_MAX: Final = 253
_CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_CSI_DRIVER = re.compile(r"^[a-zA-Z0-9]([-a-zA-Z0-9.]{0,61}[a-zA-Z0-9])?$")
MODE_MAX: Final = 0o777
STANDARD_RESOURCES: Final = frozenset({"cpu", "memory", "ephemeral-storage"})
FIELD_PATHS: Final = frozenset(
    {
        "metadata.name",
        "metadata.namespace",
        "metadata.uid",
        "spec.nodeName",
        "spec.serviceAccountName",
        "status.hostIP",
        "status.hostIPs",
        "status.podIP",
        "status.podIPs",
    }
)
"""`fieldRef.fieldPath`s the downward API serves in env (besides metadata.labels['k'] and
metadata.annotations['k']): pkg/apis/core/validation validEnvDownwardAPIFieldPathExpressions."""
RESOURCE_FIELDS: Final = frozenset(
    f"{kind}.{res}" for kind in ("limits", "requests") for res in ("cpu", "memory", "ephemeral-storage")
)
NODE_OPERATORS: Final = frozenset({"In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"})
LABEL_OPERATORS: Final = frozenset({"In", "NotIn", "Exists", "DoesNotExist"})
_SUBDOMAIN_WHY = syntax.DESCRIPTIONS[syntax.DNS1123_SUBDOMAIN]
_QUALIFIED_WHY = (
    "must be a qualified name [prefix/]name (name: at most 63 letters, digits, '-', '_', '.', starting and "
    "ending with a letter or digit; prefix: a DNS-1123 subdomain)"
)
_QUANTITY = re.compile(
    r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
_SUFFIX: Final = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
}


# ------------------------------------------------------------------------------------ the name rules


def subdomain(value: Any, required: bool = False) -> str | None:
    """Why `value` is not a DNS-1123 subdomain (an object name), or None. A missing value is the schema's
    to report (a required property) unless `required` (a field the schema leaves optional)."""
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        return "required, " + _SUBDOMAIN_WHY
    if len(value) > syntax.DNS1123_SUBDOMAIN_MAX or not syntax.matches(syntax.DNS1123_SUBDOMAIN, value):
        return f"{_show(value)} {_SUBDOMAIN_WHY}, at most {syntax.DNS1123_SUBDOMAIN_MAX}"
    return None


def config_key(value: Any) -> str | None:
    """Why `value` is not a Secret or ConfigMap key (apimachinery IsConfigMapKey), or None."""
    if value is None:
        return None  # the schema's required property
    if not isinstance(value, str) or not value:
        return "required: a key of the Secret or ConfigMap"
    if len(value) > CONFIG_KEY_MAX or not _CONFIG_KEY.match(value):
        return f"{_show(value)} must be at most {CONFIG_KEY_MAX} letters, digits, '-', '_' and '.'"
    if value in (".", "..") or value.startswith(".."):
        return f"{_show(value)} may not be '.' or '..' or start with '..'"
    return None


def qualified_name(value: Any) -> str | None:
    """Why `value` is not a qualified name (label keys, toleration and topology keys), or None."""
    if not isinstance(value, str) or not value:
        return "required, " + _QUALIFIED_WHY
    prefix, slash, name = value.rpartition("/")
    if (
        len(name) > syntax.DNS1123_LABEL_MAX
        or not _QUALIFIED_NAME.match(name)
        or (
            slash
            and (not prefix or len(prefix) > 253 or not syntax.matches(syntax.DNS1123_SUBDOMAIN, prefix))
        )
    ):
        return f"{_show(value)} {_QUALIFIED_WHY}"
    return None


def descending_path(value: Any) -> str | None:
    """Why `value` is not a relative path inside its volume (validateLocalDescendingPath), or None."""
    if not isinstance(value, str):
        return "must be a path"
    if value.startswith("/"):
        return f"{_show(value)} must be relative (a path inside the volume)"
    if ".." in value.split("/"):
        return f"{_show(value)} may not contain '..'"
    return None


def quantity(value: Any) -> Decimal | None:
    """A resource quantity's value, or None for what is not one (apimachinery resource.Quantity's forms)."""
    m = _QUANTITY.match(str(value)) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if m is None:
        return None
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return number * Decimal(10) ** Decimal(suffix[1:])
        return number * _SUFFIX[suffix]
    except (InvalidOperation, OverflowError):
        return None


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else '"' + value.replace('"', '\\"') + '"'
    return text if len(text) <= 80 else text[:76] + '..."'


def _mode(where: str, value: Any) -> list[str]:
    if value is None:
        return []
    if type(value) is not int or not 0 <= value <= MODE_MAX:
        return [f"{where}: {_show(value)} must be a file mode between 0 and 0777 (511)"]
    return []


def _why(where: str, why: str | None) -> list[str]:
    return [f"{where}: {why}"] if why else []


# ---------------------------------------------------------------------------------------------- env


def env_value_from(where: str, value_from: dict[str, Any]) -> list[str]:
    """An env var's valueFrom (its shape already checked)."""
    out: list[str] = []
    for kind in ("secretKeyRef", "configMapKeyRef"):
        ref = value_from.get(kind)
        if isinstance(ref, dict):
            out += _why(f"{where}.{kind}.name", subdomain(ref.get("name"), required=True))
            out += _why(f"{where}.{kind}.key", config_key(ref.get("key")))
    field = value_from.get("fieldRef")
    if isinstance(field, dict):
        path = field.get("fieldPath")
        ok = isinstance(path, str) and (
            path in FIELD_PATHS
            or re.fullmatch(r"metadata\.(labels|annotations)\['[^']+'\]", path) is not None
        )
        if not ok:
            out.append(
                f"{where}.fieldRef.fieldPath: {_show(path)} is not served in env; one of "
                f"{', '.join(sorted(FIELD_PATHS))}, metadata.labels['KEY'], metadata.annotations['KEY']"
            )
        if field.get("apiVersion") not in (None, "v1"):
            out.append(f"{where}.fieldRef.apiVersion: {_show(field.get('apiVersion'))} must be v1")
    res = value_from.get("resourceFieldRef")
    if isinstance(res, dict):
        if res.get("resource") not in RESOURCE_FIELDS:
            out.append(
                f"{where}.resourceFieldRef.resource: {_show(res.get('resource'))} must be one of "
                f"{', '.join(sorted(RESOURCE_FIELDS))}"
            )
        if res.get("containerName"):
            out.append(
                f"{where}.resourceFieldRef.containerName: the TPU containers' names are rljob's; leave it "
                "empty (the container's own)"
            )
        divisor = res.get("divisor")
        if divisor is not None and (quantity(divisor) is None or quantity(divisor) == 0):
            out.append(f"{where}.resourceFieldRef.divisor: {_show(divisor)} must be a positive quantity")
    return out


def env_from(where: str, source: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for kind in ("secretRef", "configMapRef"):
        ref = source.get(kind)
        if isinstance(ref, dict):
            out += _why(f"{where}.{kind}.name", subdomain(ref.get("name"), required=True))
    prefix = source.get("prefix")
    if prefix is not None and (
        not isinstance(prefix, str) or (prefix and not re.fullmatch(r"[-._a-zA-Z][-._a-zA-Z0-9]*", prefix))
    ):
        out.append(f"{where}.prefix: {_show(prefix)} must start a valid variable name ([-._a-zA-Z]...)")
    return out


# ------------------------------------------------------------------------------------------ volumes


def _items(where: str, items: Any) -> list[str]:
    out: list[str] = []
    for i, item in enumerate(items if isinstance(items, list) else []):
        if not isinstance(item, dict):
            continue
        out += _why(f"{where}[{i}].key", config_key(item.get("key")))
        path = item.get("path")
        if not isinstance(path, str) or not path:
            out.append(f"{where}[{i}].path: required, a relative path")
        else:
            out += _why(f"{where}[{i}].path", descending_path(path))
        out += _mode(f"{where}[{i}].mode", item.get("mode"))
    return out


def volume(where: str, vol: dict[str, Any]) -> list[str]:
    """One volume's source values (its name and shape are checked by rljob.recipes.overrides)."""
    out: list[str] = []
    secret = vol.get("secret")
    if isinstance(secret, dict):
        out += _why(f"{where}.secret.secretName", subdomain(secret.get("secretName"), required=True))
        out += _items(f"{where}.secret.items", secret.get("items"))
        out += _mode(f"{where}.secret.defaultMode", secret.get("defaultMode"))
    cm = vol.get("configMap")
    if isinstance(cm, dict):
        out += _why(f"{where}.configMap.name", subdomain(cm.get("name"), required=True))
        out += _items(f"{where}.configMap.items", cm.get("items"))
        out += _mode(f"{where}.configMap.defaultMode", cm.get("defaultMode"))
    pvc = vol.get("persistentVolumeClaim")
    if isinstance(pvc, dict):
        out += _why(f"{where}.persistentVolumeClaim.claimName", subdomain(pvc.get("claimName")))
    empty = vol.get("emptyDir")
    if isinstance(empty, dict) and empty.get("sizeLimit") is not None:
        q = quantity(empty["sizeLimit"])
        if q is None or q < 0:
            out.append(f"{where}.emptyDir.sizeLimit: {_show(empty['sizeLimit'])} must be a quantity >= 0")
    csi = vol.get("csi")
    if isinstance(csi, dict):
        driver = csi.get("driver")
        if driver is not None and (not isinstance(driver, str) or not _CSI_DRIVER.match(driver)):
            out.append(
                f"{where}.csi.driver: {_show(driver)} must be a CSI driver name (at most 63 letters, digits, "
                "'-' and '.', starting and ending with a letter or digit)"
            )
    host = vol.get("hostPath")
    if isinstance(host, dict) and not host.get("path"):
        out.append(f"{where}.hostPath.path: required")
    projected = vol.get("projected")
    if isinstance(projected, dict):
        out += _mode(f"{where}.projected.defaultMode", projected.get("defaultMode"))
        for i, src in enumerate(projected.get("sources") or []):
            if not isinstance(src, dict):
                continue
            base = f"{where}.projected.sources[{i}]"
            if len(src) != 1:
                out.append(f"{base}: must have exactly one source, has {len(src)}")
            for kind, name_key in (("secret", "name"), ("configMap", "name")):
                ref = src.get(kind)
                if isinstance(ref, dict):
                    out += _why(f"{base}.{kind}.{name_key}", subdomain(ref.get(name_key), required=True))
                    out += _items(f"{base}.{kind}.items", ref.get("items"))
            token = src.get("serviceAccountToken")
            if isinstance(token, dict):
                if not token.get("path"):
                    out.append(f"{base}.serviceAccountToken.path: required")
                else:
                    out += _why(f"{base}.serviceAccountToken.path", descending_path(token["path"]))
                seconds = token.get("expirationSeconds")
                if seconds is not None and (type(seconds) is not int or not 600 <= seconds <= 2**32):
                    out.append(
                        f"{base}.serviceAccountToken.expirationSeconds: {_show(seconds)} must be at least "
                        "600 (10 minutes)"
                    )
    return out


def sub_path(where: str, value: str | None) -> list[str]:
    return _why(where, descending_path(value)) if value else []


# ---------------------------------------------------------------------------------------- resources


def _extended(name: str) -> bool:
    """An extended resource: a name with a domain other than kubernetes.io (IsExtendedResourceName)."""
    return "/" in name and "kubernetes.io/" not in name and not name.startswith("requests.")


def resources(where: str, requests: dict[str, Any], limits: dict[str, Any]) -> list[str]:
    """Container requests and limits as the API server validates them (ValidateResourceRequirements)."""
    out: list[str] = []
    for kind, values in (("requests", requests), ("limits", limits)):
        for name, value in values.items():
            at = syntax.key_path(f"{where}.{kind}", name)
            if "/" not in name:
                if name not in STANDARD_RESOURCES and not name.startswith("hugepages-"):
                    out.append(
                        f"{at}: not a standard resource ({', '.join(sorted(STANDARD_RESOURCES))}, "
                        "hugepages-*); an extended resource is named DOMAIN/NAME"
                    )
                    continue
            elif why := qualified_name(name):
                out.append(f"{at}: {why}")
                continue
            elif "kubernetes.io/" in name:
                out.append(f"{at}: no kubernetes.io/ resource may be requested by a container")
                continue
            q = quantity(value)
            if q is None:
                continue  # the field's pattern refused it
            if q < 0:
                out.append(f"{at}: {value} must be greater than or equal to 0")
            elif _extended(name) and q != q.to_integral_value():
                out.append(f"{at}: {value} must be a whole number (an extended resource)")
    for name, value in requests.items():
        if not _extended(name) and not name.startswith("hugepages-"):
            continue
        at = syntax.key_path(f"{where}.requests", name)
        if name not in limits:
            out.append(f"{at}: a limit must be set too, equal to the request (not overcommitable)")
        elif quantity(value) != quantity(limits[name]):
            out.append(f"{at}: {value} must equal its limit {limits[name]} (not overcommitable)")
    return out


# --------------------------------------------------------------------------------------- scheduling


def toleration(where: str, key: str | None, operator: str | None, value: str | None) -> list[str]:
    out: list[str] = []
    if key:
        out += _why(f"{where}.key", qualified_name(key))
    elif operator != "Exists":
        out.append(f"{where}.operator: must be Exists when key is empty (which tolerates every taint)")
    if value and not syntax.matches(syntax.LABEL_VALUE, value):
        out.append(f"{where}.value: {syntax.DESCRIPTIONS[syntax.LABEL_VALUE]}")
    return out


def _node_requirement(where: str, req: Any, fields: bool) -> list[str]:
    if not isinstance(req, dict):
        return []
    out: list[str] = []
    op, values = req.get("operator"), req.get("values") or []
    values = values if isinstance(values, list) else []
    if fields:
        if req.get("key") != "metadata.name":
            out.append(f"{where}.key: {_show(req.get('key'))} must be metadata.name (the only node field)")
        if op not in ("In", "NotIn"):
            out.append(f"{where}.operator: {_show(op)} must be In or NotIn for matchFields")
        if len(values) != 1:
            out.append(f"{where}.values: must hold exactly one value for matchFields")
        return out
    out += _why(f"{where}.key", qualified_name(req.get("key")))
    if op not in NODE_OPERATORS:
        out.append(f"{where}.operator: {_show(op)} must be one of {', '.join(sorted(NODE_OPERATORS))}")
    elif op in ("In", "NotIn") and not values:
        out.append(f"{where}.values: required with operator {op}")
    elif op in ("Exists", "DoesNotExist") and values:
        out.append(f"{where}.values: must be empty with operator {op}")
    elif op in ("Gt", "Lt") and (
        len(values) != 1 or not isinstance(values[0], str) or not re.fullmatch(r"-?[0-9]+", values[0])
    ):
        out.append(f"{where}.values: must hold exactly one integer with operator {op}")
    if op in ("In", "NotIn"):
        for j, v in enumerate(values):
            if not isinstance(v, str) or not syntax.matches(syntax.LABEL_VALUE, v) or len(v) > 63:
                out.append(f"{where}.values[{j}]: {syntax.DESCRIPTIONS[syntax.LABEL_VALUE]}, at most 63")
    return out


def _node_term(where: str, term: Any) -> list[str]:
    if not isinstance(term, dict):
        return []
    out: list[str] = []
    for kind in ("matchExpressions", "matchFields"):
        for j, req in enumerate(term.get(kind) or []):
            out += _node_requirement(f"{where}.{kind}[{j}]", req, kind == "matchFields")
    return out


def _weight(where: str, value: Any) -> list[str]:
    if type(value) is not int or not 1 <= value <= 100:
        return [f"{where}: {_show(value)} must be between 1 and 100"]
    return []


def label_selector(where: str, sel: Any) -> list[str]:
    if not isinstance(sel, dict):
        return []
    out: list[str] = []
    for key, value in (sel.get("matchLabels") or {}).items():
        at = syntax.key_path(f"{where}.matchLabels", key)
        out += _why(at, qualified_name(key))
        if not isinstance(value, str) or not syntax.matches(syntax.LABEL_VALUE, value) or len(value) > 63:
            out.append(f"{at}: {syntax.DESCRIPTIONS[syntax.LABEL_VALUE]}, at most 63")
    for j, req in enumerate(sel.get("matchExpressions") or []):
        if not isinstance(req, dict):
            continue
        at = f"{where}.matchExpressions[{j}]"
        out += _why(f"{at}.key", qualified_name(req.get("key")))
        op, values = req.get("operator"), req.get("values") or []
        if op not in LABEL_OPERATORS:
            out.append(f"{at}.operator: {_show(op)} must be one of {', '.join(sorted(LABEL_OPERATORS))}")
        elif op in ("In", "NotIn") and not values:
            out.append(f"{at}.values: required with operator {op}")
        elif op in ("Exists", "DoesNotExist") and values:
            out.append(f"{at}.values: must be empty with operator {op}")
    return out


def _pod_term(where: str, term: Any) -> list[str]:
    if not isinstance(term, dict):
        return []
    out = _why(f"{where}.topologyKey", qualified_name(term.get("topologyKey")))
    out += label_selector(f"{where}.labelSelector", term.get("labelSelector"))
    out += label_selector(f"{where}.namespaceSelector", term.get("namespaceSelector"))
    for j, ns in enumerate(term.get("namespaces") or []):
        if not isinstance(ns, str) or not syntax.matches(syntax.DNS1123_LABEL, ns) or len(ns) > 63:
            out.append(f"{where}.namespaces[{j}]: {syntax.DESCRIPTIONS[syntax.DNS1123_LABEL]}")
    for kind in ("matchLabelKeys", "mismatchLabelKeys"):
        for j, key in enumerate(term.get(kind) or []):
            out += _why(f"{where}.{kind}[{j}]", qualified_name(key))
    return out


def affinity(where: str, aff: dict[str, Any]) -> list[str]:
    """A pod's affinity (its shape checked against the pod schema already)."""
    out: list[str] = []
    node = aff.get("nodeAffinity")
    if isinstance(node, dict):
        base = f"{where}.nodeAffinity"
        required = node.get("requiredDuringSchedulingIgnoredDuringExecution")
        if isinstance(required, dict):
            terms = required.get("nodeSelectorTerms") or []
            if not terms:
                out.append(
                    f"{base}.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms: required"
                )
            for i, term in enumerate(terms):
                out += _node_term(
                    f"{base}.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[{i}]", term
                )
        for i, pref in enumerate(node.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
            if isinstance(pref, dict):
                at = f"{base}.preferredDuringSchedulingIgnoredDuringExecution[{i}]"
                out += _weight(f"{at}.weight", pref.get("weight"))
                out += _node_term(f"{at}.preference", pref.get("preference"))
    for kind in ("podAffinity", "podAntiAffinity"):
        pod = aff.get(kind)
        if not isinstance(pod, dict):
            continue
        base = f"{where}.{kind}"
        for i, term in enumerate(pod.get("requiredDuringSchedulingIgnoredDuringExecution") or []):
            out += _pod_term(f"{base}.requiredDuringSchedulingIgnoredDuringExecution[{i}]", term)
        for i, pref in enumerate(pod.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
            if isinstance(pref, dict):
                at = f"{base}.preferredDuringSchedulingIgnoredDuringExecution[{i}]"
                out += _weight(f"{at}.weight", pref.get("weight"))
                out += _pod_term(f"{at}.podAffinityTerm", pref.get("podAffinityTerm"))
    return out
