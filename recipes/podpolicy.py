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
import posixpath
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel
from rljob.recipes import schema
from rljob.recipes.api import PodTemplate, Toleration
from rljob.recipes.syntax import key_path

GCSFUSE_DRIVER: Final = "gcsfuse.csi.storage.gke.io"
DEFAULT_VOLUME_TYPES: Final = ("configMap", "secret", "emptyDir", "persistentVolumeClaim", "csi")
DEFAULT_REFUSED_ENV: Final = (
    # Python: every PYTHON* variable (PYTHONPATH, PYTHONHOME, PYTHONSTARTUP, PYTHONUSERBASE, PYTHONINSPECT;
    # PYTHONWARNINGS and PYTHONBREAKPOINT import a module they name, PYTHONPYCACHEPREFIX reads bytecode from
    # a directory it names) and the PYTHON_* ones newer interpreters add; the modules that run a program or
    # import a module named by a variable (webbrowser's BROWSER, matplotlib's backend and rc file).
    "PYTHON*",
    "BROWSER",
    "MPLBACKEND",
    "MATPLOTLIBRC",
    "MPLCONFIGDIR",
    # The dynamic loader and the C library: LD_PRELOAD, LD_AUDIT, LD_LIBRARY_PATH, ...; iconv modules,
    # locale files, the loader's tunables; OpenSSL's config (its engines and providers are shared libraries).
    "LD_*",
    "GCONV_PATH",
    "LOCPATH",
    "NLSPATH",
    "GLIBC_TUNABLES",
    "OPENSSL_CONF",
    "OPENSSL_ENGINES",
    "OPENSSL_MODULES",
    # Accelerator runtimes' plugin libraries: libtpu's path, JAX's PJRT plugins, TensorFlow's pluggable
    # devices, NCCL's network and tuner plugins.
    "TPU_LIBRARY_PATH",
    "PJRT_*",
    "TF_PLUGGABLE_DEVICE_LIBRARY_PATH",
    "NCCL_NET_PLUGIN",
    "NCCL_TUNER_PLUGIN",
    "NCCL_PROFILER_PLUGIN",
    # Where programs and per-user start-up files are looked up: the entrypoint and every subprocess by PATH;
    # HOME's user site-packages (.pth files run at interpreter start), rc files.
    "PATH",
    "HOME",
    # Shells and the other interpreters a process may start: start-up files, exported functions, options.
    "BASH_ENV",
    "ENV",
    "BASH_FUNC_*",
    "SHELLOPTS",
    "BASHOPTS",
    "PS4",
    "PROMPT_COMMAND",
    "PERL5OPT",
    "PERL5LIB",
    "PERLLIB",
    "RUBYOPT",
    "RUBYLIB",
    "NODE_OPTIONS",
    "JAVA_TOOL_OPTIONS",
    "_JAVA_OPTIONS",
    "JDK_JAVA_OPTIONS",
    "GIT_*",
)
"""Variables that make a process run or load code the image was not built with, by class (the comments);
docs/operator.md ("Pod policy") says what the list does not promise."""
DEFAULT_MOUNT_ROOTS: Final = ("/data", "/mnt", "/etc/rljob-user")
"""Directories under which a template's volumeMounts may go: none of them is in rljob's images, so a mount
there adds files and never replaces one of the image (its entrypoint, a module, a `.pth` file of its
site-packages), whatever the volume or subPath holds."""
SYSTEM_PRIORITY_PREFIX: Final = "system-"
"""Kubernetes reserves PriorityClass names starting with system- (system-node-critical,
system-cluster-critical) for its own components."""
METADATA_SERVER_LABEL: Final = "iam.gke.io/gke-metadata-server-enabled"
"""The label GKE sets to "true" on the nodes that run the GKE metadata server (node pools with Workload
Identity Federation for GKE): there a pod's requests to 169.254.169.254 are answered as its own Kubernetes
ServiceAccount, never as the node's service account."""
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
    mount_roots: tuple[str, ...] = Field(
        default=DEFAULT_MOUNT_ROOTS,
        description="Absolute directories a template's volumeMounts must be at or under ('/': anywhere). "
        "Each must be a directory the images do not have, so that a mount adds files and never covers "
        "the image's own (its entrypoint, its site-packages).",
    )
    preflight_node_selector: dict[str, str] = Field(
        default_factory=lambda: {METADATA_SERVER_LABEL: "true"},
        description="The nodeSelector of the compile preflight's CPU pod (it asks for no TPU, so without "
        "one it could land on any node). The default: nodes that run the GKE metadata server, where the "
        "pod reaches 169.254.169.254 as the run's ServiceAccount, never as the node's.",
    )
    preflight_tolerations: tuple[Toleration, ...] = Field(
        default=(),
        description="Tolerations of the compile preflight's pod (for a tainted node pool named by "
        "preflightNodeSelector).",
    )
    allow_tolerate_everything: bool = Field(
        default=False,
        description="Whether a toleration may have operator Exists and no key (tolerating every taint, "
        "NoExecute and the control plane's included).",
    )

    @field_validator("mount_roots")
    @classmethod
    def _absolute_roots(cls, roots: tuple[str, ...]) -> tuple[str, ...]:
        for root in roots:
            if not root.startswith("/") or posixpath.normpath(root) != root or ".." in root.split("/"):
                raise ValueError(f"{root!r} is not an absolute, normalised directory")
        return roots

    @field_validator("refused_env")
    @classmethod
    def _trailing_stars(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for pattern in patterns:
            if "*" in pattern[:-1] or any(ch in pattern for ch in "?[]"):
                raise ValueError(f"{pattern!r}: a name or a prefix followed by one '*'")
        return patterns


DEFAULT: Final = PodPolicy()
ALLOW_ALL: Final = PodPolicy(
    volume_types=("*",),
    csi_drivers=("*",),
    allow_service_account_tokens=True,
    service_accounts=("*",),
    priority_classes=("*",),
    refused_env=(),
    allow_env_from_without_prefix=True,
    mount_roots=("/",),
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
    for i, mount in enumerate(spec.volume_mounts or []):
        out += mount_problems(f"{sp}.volumeMounts[{i}].mountPath", mount.mount_path, policy)
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


def under_root(path: str, roots: tuple[str, ...]) -> bool:
    """Whether the absolute `path` is one of `roots` or below one ('/' holds every path); a path with a '..'
    element is under none."""
    if ".." in path.split("/"):
        return False
    clean = posixpath.normpath(path)
    return any(root == "/" or clean == root or clean.startswith(root + "/") for root in roots)


def mount_problems(where: str, mount_path: str, policy: PodPolicy) -> list[str]:
    """A volumeMount's mountPath against the mount roots."""
    if under_root(mount_path, policy.mount_roots):
        return []
    return [
        f"{where}: {mount_path} is not under an allowed mount root (allowed: "
        f"{', '.join(policy.mount_roots)}): a mount elsewhere can cover the image's own files "
        + _why("mountRoots")
    ]


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
