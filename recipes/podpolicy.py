"""The operator's pod policy: what an RLJob's pod templates and images may ask for.

Creating an RLJob is creating pods: the operator creates them with its own permissions, so without a
policy an RLJob could ask for what its author may not (a hostPath volume, another workload's
ServiceAccount, a system PriorityClass). The policy is an input of the plan (rljob.recipes.plan.resolve),
so the admission webhook, the reconcile and `rljob validate` refuse the same manifests: the operator reads
it from RLJOB_POD_POLICY (JSON, the chart's `podPolicy` values), `rljob validate --pod-policy FILE` from a
file of the same shape; without either, DEFAULT applies. docs/operator.md ("Pod policy") documents each
field.

Each refusal is one `spec.<field>: ... (the operator's pod policy: <key>)` line, naming the policy key an
operator would change to allow it.
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel
from rljob.recipes import schema
from rljob.recipes.api import PodTemplate
from rljob.recipes.syntax import key_path

GCSFUSE_DRIVER: Final = "gcsfuse.csi.storage.gke.io"
DEFAULT_VOLUME_TYPES: Final = ("configMap", "secret", "emptyDir", "persistentVolumeClaim", "csi")
DEFAULT_REFUSED_ENV: Final = (
    "LD_*",
    "GCONV_PATH",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONUSERBASE",
    "PYTHONINSPECT",
    "BASH_ENV",
    "ENV",
)
"""Variables that make a process load code it was not built with: the dynamic loader's (LD_PRELOAD,
LD_AUDIT, LD_LIBRARY_PATH, ...), glibc's iconv modules, Python's module path and start-up files, the
shell's start-up file."""
SYSTEM_PRIORITY_PREFIX: Final = "system-"
"""Kubernetes reserves PriorityClass names starting with system- (system-node-critical,
system-cluster-critical) for its own components."""
ENV = "RLJOB_POD_POLICY"


class PodPolicy(BaseModel):
    """What an RLJob's pods may ask for; the defaults are the safe ones (see each field)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, validate_by_name=True, validate_by_alias=True
    )

    volume_types: tuple[str, ...] = Field(
        default=DEFAULT_VOLUME_TYPES,
        description="Volume sources a template may use (the Kubernetes Volume field names; '*': any). "
        "hostPath and projected (which can mount a ServiceAccount token) are not among the defaults.",
    )
    csi_drivers: tuple[str, ...] = Field(
        default=(GCSFUSE_DRIVER,),
        description="CSI drivers a csi volume may name (when csi is allowed; '*': any).",
    )
    allow_service_account_tokens: bool = Field(
        default=False,
        description="Whether a projected volume may hold a serviceAccountToken source (when projected is "
        "allowed): a token of the pod's ServiceAccount even where rljob renders "
        "automountServiceAccountToken: false.",
    )
    service_accounts: tuple[str, ...] = Field(
        default=(),
        description="ServiceAccounts a template's serviceAccountName may name besides the run's own "
        "(<name>-rljob). '*' allows any.",
    )
    image_prefixes: tuple[str, ...] = Field(
        default=(),
        description="Prefixes spec.trainer.image and spec.sampler.image must start with (e.g. "
        "'us-docker.pkg.dev/my-project/rl/'); empty: any image.",
    )
    priority_classes: tuple[str, ...] | None = Field(
        default=None,
        description="PriorityClasses spec.priorityClassName may name ('*': any); null: any but the system- "
        "ones.",
    )
    refused_env: tuple[str, ...] = Field(
        default=DEFAULT_REFUSED_ENV,
        description="Env names a template may not set (shell-style patterns, LD_* for every name starting "
        "LD_); an envFrom must then have a prefix that cannot form one of them.",
    )
    allow_env_from_without_prefix: bool = Field(
        default=False,
        description="Whether an envFrom may have no prefix (its Secret or ConfigMap's keys, unknown to the "
        "plan, then become variables as they are, LD_PRELOAD included).",
    )
    allow_tolerate_everything: bool = Field(
        default=False,
        description="Whether a toleration may have operator Exists and no key (tolerating every taint, "
        "NoExecute and the control plane's included).",
    )


DEFAULT: Final = PodPolicy()
ALLOW_ALL: Final = PodPolicy(
    volume_types=("*",),
    csi_drivers=("*",),
    allow_service_account_tokens=True,
    service_accounts=("*",),
    priority_classes=("*",),
    refused_env=(),
    allow_env_from_without_prefix=True,
    allow_tolerate_everything=True,
)
"""No limit: for `rljob doctor`, which reads what a manifest needs and leaves the operator's own policy to
the operator's webhook (its dry run of the RLJob)."""


class PolicyError(ValueError):
    """An unreadable policy: `problems` as `path: message` lines."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def parse(data: Any, source: str) -> PodPolicy:
    """A policy from JSON/YAML data (the chart's `podPolicy` values); None or {} is DEFAULT."""
    if data is None:
        return DEFAULT
    try:
        return PodPolicy.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors(include_url=False):
            where = ".".join(str(p) for p in e["loc"]) or "(root)"
            lines.append(f"{source}: {where}: {e['msg']}")
        raise PolicyError(lines) from None


def from_env(environ: dict[str, str]) -> PodPolicy:
    text = environ.get(ENV, "").strip()
    if not text:
        return DEFAULT
    try:
        return parse(json.loads(text), ENV)
    except json.JSONDecodeError as e:
        raise PolicyError([f"{ENV}: not JSON: {e}"]) from None


def _why(key: str) -> str:
    return f"(the operator's pod policy: {key})"


def _could_form(prefix: str, pattern: str) -> bool:
    """Whether `prefix` + some key can match `pattern` (patterns are literals with at most a trailing *)."""
    literal = pattern.split("*", 1)[0]
    return literal.startswith(prefix) or prefix.startswith(literal)


def template_problems(path: str, template: PodTemplate | None, own_sa: str, policy: PodPolicy) -> list[str]:
    """One role's template against the policy."""
    if template is None or template.spec is None:
        return []
    out: list[str] = []
    sp = f"{path}.spec"
    spec = template.spec
    for i, volume in enumerate(spec.volumes or []):
        # Unknown fields are the schema's to report (rljob.recipes.overrides); the policy judges sources.
        for kind in (k for k in volume if k in schema.volume_sources()):
            where = key_path(f"{sp}.volumes[{i}]", kind)
            if kind not in policy.volume_types and "*" not in policy.volume_types:
                out.append(
                    f"{where}: {kind} volumes are not allowed (allowed: {', '.join(policy.volume_types)}) "
                    f"{_why('volumeTypes')}"
                )
                continue
            source = volume[kind]
            driver = source.get("driver") if isinstance(source, dict) else None
            if (
                kind == "csi"
                and driver is not None
                and driver not in policy.csi_drivers
                and "*" not in policy.csi_drivers
            ):
                out.append(
                    f"{where}.driver: {source.get('driver')!r} is not an allowed CSI driver (allowed: "
                    f"{', '.join(policy.csi_drivers) or 'none'}) {_why('csiDrivers')}"
                )
            if kind == "projected" and isinstance(source, dict) and not policy.allow_service_account_tokens:
                for j, src in enumerate(source.get("sources") or []):
                    if isinstance(src, dict) and "serviceAccountToken" in src:
                        out.append(
                            f"{where}.sources[{j}].serviceAccountToken: a ServiceAccount token is not "
                            f"allowed {_why('allowServiceAccountTokens')}"
                        )
    sa = spec.service_account_name
    if (
        sa is not None
        and sa != own_sa
        and "*" not in policy.service_accounts
        and sa not in policy.service_accounts
    ):
        allowed = ", ".join([own_sa, *policy.service_accounts])
        out.append(
            f"{sp}.serviceAccountName: {sa} is not allowed (allowed: {allowed}) {_why('serviceAccounts')}"
        )
    for i, env in enumerate(spec.env or []):
        hit = next((p for p in policy.refused_env if fnmatch.fnmatchcase(env.name, p)), None)
        if hit is not None:
            out.append(f"{sp}.env[{i}].name: {env.name} is refused (matches {hit}) {_why('refusedEnv')}")
    for i, source in enumerate(spec.env_from or []):
        prefix = source.get("prefix") if isinstance(source, dict) else None
        if not prefix:
            if not policy.allow_env_from_without_prefix and policy.refused_env:
                out.append(
                    f"{sp}.envFrom[{i}].prefix: required (the keys of a Secret or ConfigMap become variables "
                    f"as they are, {policy.refused_env[0]} included); or name each key in env with valueFrom "
                    f"{_why('allowEnvFromWithoutPrefix')}"
                )
        elif isinstance(prefix, str):
            hit = next((p for p in policy.refused_env if _could_form(prefix, p)), None)
            if hit is not None:
                out.append(
                    f"{sp}.envFrom[{i}].prefix: {prefix} could form a refused name ({hit}) "
                    f"{_why('refusedEnv')}"
                )
    for i, tol in enumerate(spec.tolerations or []):
        if tol.operator == "Exists" and not tol.key and not policy.allow_tolerate_everything:
            out.append(
                f"{sp}.tolerations[{i}]: operator Exists with no key tolerates every taint "
                f"{_why('allowTolerateEverything')}"
            )
    return out


def image_problems(field: str, image: str | None, policy: PodPolicy) -> list[str]:
    if image is None or not policy.image_prefixes or image.startswith(policy.image_prefixes):
        return []
    return [
        f"{field}: {image} does not start with an allowed prefix ({', '.join(policy.image_prefixes)}) "
        f"{_why('imagePrefixes')}"
    ]


def priority_class_problems(name: str | None, policy: PodPolicy) -> list[str]:
    if name is None:
        return []
    if policy.priority_classes is None:
        if name.startswith(SYSTEM_PRIORITY_PREFIX):
            return [
                f"spec.priorityClassName: {name} is Kubernetes' own (the system- PriorityClasses keep nodes "
                f"and the cluster running) {_why('priorityClasses')}"
            ]
        return []
    if name not in policy.priority_classes and "*" not in policy.priority_classes:
        return [
            f"spec.priorityClassName: {name} is not allowed (allowed: "
            f"{', '.join(policy.priority_classes) or 'none'}) {_why('priorityClasses')}"
        ]
    return []
