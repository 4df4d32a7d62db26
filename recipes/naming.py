"""Every name rljob generates, and the 63-character budget they must fit.

JobSet derives (pkg/util/placement, pkg/controllers): Job `<jobset>-<rjob>-<jobIdx>`, Pod hostname
`<jobset>-<rjob>-<jobIdx>-<podIdx>` (the Pod name adds `-xxxxx`; JobSet's webhook checks that longest
Pod name as a DNS-1035 label), and the coordinator label/annotation `<hostname>.<subdomain>`. All of
them are label values or DNS labels, so each must be at most 63 characters and DNS-1035 (start with a
letter).
"""

from __future__ import annotations

import re

MAX = 63
# The JobSet API rljob renders (the release it is tested with: hack/versions.env JOBSET_VERSION).
JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
TRAINER = "trainer"
SAMPLER = "sampler"
PREFLIGHT_DIGEST = 8  # hex digits of the preflight Job's digest
# On every object of a run and its pods' templates: the owning RLJob's name (the operator's watches, the
# NetworkPolicies' selectors and `rljob logs` select by it), and a pod's role.
RUN_LABEL = "rljob.dev/rljob"
ROLE_LABEL = "rljob.dev/role"
PREFLIGHT_LABEL = "rljob.dev/preflight"  # on the preflight Job and its pod: the operator watches these
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def jobset(rljob: str) -> str:
    return rljob


def subdomain(rljob: str) -> str:
    return jobset(rljob)


def job(rljob: str, role: str, index: int) -> str:
    return f"{jobset(rljob)}-{role}-{index}"


def hostname(rljob: str, role: str, job_index: int, pod_index: int) -> str:
    return f"{job(rljob, role, job_index)}-{pod_index}"


def coordinator(rljob: str) -> str:
    """Value of the jobset.sigs.k8s.io/coordinator label: trainer job 0, pod 0."""
    return f"{hostname(rljob, TRAINER, 0, 0)}.{subdomain(rljob)}"


def run_configmap(rljob: str) -> str:
    return f"{rljob}-run"


def progress_configmap(rljob: str) -> str:
    return f"{rljob}-progress"


def credentials_secret(rljob: str) -> str:
    """The Secret holding the run's token (created by the operator, rljob.common.credentials)."""
    return f"{rljob}-credentials"


def preflight_job(rljob: str, digest: str) -> str:
    """The compile preflight's Job (spec.trainer.preflight): ``digest`` names what it compiles
    (rljob.recipes.render.preflight_digest), so a run whose compiled programs change gets a new one."""
    return f"{rljob}-compile-{digest}"


def service_account(rljob: str) -> str:
    return f"{rljob}-rljob"


def api_service(rljob: str) -> str:
    """The Service in front of the trainer of an RLJob that serves an API (spec.service)."""
    return f"{rljob}-api"


def network_policy(rljob: str) -> str:
    """The NetworkPolicy that admits to a run's pods only the run's own pods."""
    return f"{rljob}-pods"


def api_network_policy(rljob: str) -> str:
    """The NetworkPolicy that admits the API's clients to the trainer's API port (spec.service)."""
    return f"{rljob}-api-clients"


def service_url(service: str, namespace: str, port: int) -> str:
    """The in-cluster URL of a Service's port."""
    return f"http://{service}.{namespace}.svc:{port}"


def api_url(rljob: str, namespace: str, port: int) -> str:
    """The in-cluster URL of the API Service."""
    return service_url(api_service(rljob), namespace, port)


def generated(rljob: str, roles: dict[str, tuple[int, int]]) -> dict[str, str]:
    """The longest instance of each generated name; roles maps role -> (replicas, pods per job)."""
    names = {
        "JobSet": jobset(rljob),
        "coordinator label": coordinator(rljob),
        "run ConfigMap": run_configmap(rljob),
        "progress ConfigMap": progress_configmap(rljob),
        "credentials Secret": credentials_secret(rljob),
        "ServiceAccount": service_account(rljob),
        "API Service": api_service(rljob),
        "preflight Job": preflight_job(rljob, "x" * PREFLIGHT_DIGEST),
    }
    for role, (replicas, pods) in roles.items():
        names[f"{role} Job"] = job(rljob, role, replicas - 1)
        names[f"{role} Pod hostname"] = hostname(rljob, role, replicas - 1, pods - 1)
        names[f"{role} Pod name"] = hostname(rljob, role, replicas - 1, pods - 1) + "-xxxxx"
    return names


def check(rljob: str, roles: dict[str, tuple[int, int]]) -> list[str]:
    """Problems with the generated names, as `metadata.name: message` lines."""
    problems: list[str] = []
    if not _DNS1035.match(rljob):
        problems.append(
            f"metadata.name: {rljob!r} must start with a letter and hold only lowercase letters, digits "
            "and '-' (JobSet names are DNS-1035 labels)"
        )
    for what, name in generated(rljob, roles).items():
        if len(name) > MAX:
            problems.append(
                f"metadata.name: too long: the {what} {name!r} has {len(name)} characters (max {MAX}); "
                f"use a name of at most {max_name_length(roles)} characters"
            )
    return problems


def max_name_length(roles: dict[str, tuple[int, int]]) -> int:
    """The longest RLJob name whose generated names all fit."""
    n = MAX
    while n > 0 and any(len(v) > MAX for v in generated("a" * n, roles).values()):
        n -= 1
    return n


def replica_head(rljob: str, role: str) -> str:
    """Pod 0 of the pod's own replica, through the JobSet's headless service: the job index comes from the
    pod's JOB_INDEX env var (Kubernetes expands `$(JOB_INDEX)` in a later env value)."""
    return f"{jobset(rljob)}-{role}-$(JOB_INDEX)-0.{subdomain(rljob)}"


def sampler_url(rljob: str, replica: int, port: int) -> str:
    """Base URL of sampler replica `replica` (its pod 0) through the JobSet's headless service."""
    return f"http://{hostname(rljob, SAMPLER, replica, 0)}.{subdomain(rljob)}:{port}"
