"""JobSet: its CRD serves every field rljob renders, its controller runs, its webhooks answer."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rljob.cli.doctor.common import Obj, _fmt_version, _schema_has, _served_version, parse_version
from rljob.cli.doctor.findings import Finding, ok, problem, warning
from rljob.recipes import failure
from rljob.recipes.api import GROUP, PLURAL
from rljob.recipes.api import VERSION as RLJOB_VERSION
from rljob.recipes.naming import JOBSET_GROUP, JOBSET_VERSION

JOBSET_CRD = f"jobsets.{JOBSET_GROUP}"


# The JobSet release rljob is tested with (hack/versions.env JOBSET_VERSION; a test keeps them equal)
# and the oldest one it supports: v0.12.0 added the failure actions RestartJob and
# RestartJobAndIgnoreMaxRestarts (a failed sampler Job restarts alone, recipes/failure.py) and
# replicatedJobsStatus[].jobRestarts*, which the operator counts sampler restarts from.
TESTED_JOBSET_VERSION = "v0.12.0"


MIN_JOBSET_VERSION = (0, 12, 0)

# JobSet v0.12.0 keeps RestartJob* behind an alpha feature gate, off by default; its webhook refuses a
# JobSet that uses them while the gate is off (rljob.recipes.failure.restart_job_admitted reads which).
ENABLE_RESTART_JOB = (
    "turn on JobSet's feature gate RestartJob: add `featureGates: {RestartJob: true}` to the key "
    "controller_manager_config.yaml of ConfigMap jobset-system/jobset-manager-config, then "
    "kubectl -n jobset-system rollout restart deployment/jobset-controller-manager (docs/gke.md, section 4)"
)


JOBSET_INSTALL = (
    "kubectl apply --server-side -f "
    f"https://github.com/kubernetes-sigs/jobset/releases/download/{TESTED_JOBSET_VERSION}/manifests.yaml"
)


# Schema paths (below the CRD's openAPIV3Schema) of JobSet fields the renderer writes; arrays are
# walked through `items` implicitly.
JOBSET_FIELDS: tuple[tuple[str, ...], ...] = (
    ("spec", "coordinator"),
    ("spec", "network", "publishNotReadyAddresses"),
    ("spec", "successPolicy", "targetReplicatedJobs"),
    ("spec", "failurePolicy", "restartStrategy"),
    ("spec", "failurePolicy", "rules", "onJobFailureMessagePatterns"),
    ("spec", "replicatedJobs", "dependsOn"),
    ("status", "replicatedJobsStatus", "jobRestartsCountTowardsMax"),
)


def check_jobset_crd(crds: Mapping[str, Obj]) -> list[Finding]:
    check = "jobset.crd"
    crd = crds.get(JOBSET_CRD)
    if crd is None:
        return [problem(check, f"the JobSet CRD {JOBSET_CRD} is not installed", JOBSET_INSTALL)]
    version = _served_version(crd, JOBSET_VERSION)
    if version is None:
        return [
            problem(
                check, f"the JobSet CRD does not serve {JOBSET_VERSION}", f"upgrade JobSet: {JOBSET_INSTALL}"
            )
        ]
    schema = version.get("schema", {}).get("openAPIV3Schema", {})
    missing = [".".join(p) for p in JOBSET_FIELDS if not _schema_has(schema, p)]
    if missing:
        return [
            problem(
                check,
                f"the JobSet CRD lacks {', '.join(missing)} (older than "
                f"{_fmt_version(MIN_JOBSET_VERSION)}?): the API server would drop what rljob renders there",
                f"upgrade JobSet to {TESTED_JOBSET_VERSION}: {JOBSET_INSTALL}",
            )
        ]
    return [ok(check, f"JobSet CRD {JOBSET_CRD} serves {JOBSET_VERSION} with every field rljob renders")]


def _jobset_image(dep: Obj) -> str | None:
    containers = dep.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []) or []
    for c in containers:
        image = str(c.get("image", ""))
        if re.search(r"(^|/)jobset(/[^/:@]*)?[:@]", image) or image.rsplit(":", 1)[0].endswith("/jobset"):
            return image
    return None


@dataclass(frozen=True)
class Probe:
    """Outcome of a server-side dry-run create of a minimal JobSet (it runs JobSet's webhooks)."""

    allowed: bool  # the request was admitted
    defaulted: bool  # the mutating webhook filled spec.network.enableDNSHostnames
    error: str = ""  # the API server's message when not admitted
    forbidden: bool = False  # the caller may not create JobSets: nothing learned


def probe_object(namespace: str) -> dict[str, Any]:
    """The JobSet the controller probe dry-runs (rljob.recipes.failure.restart_job_probe, which the
    operator dry-runs too): a controller without the RestartJob gate refuses it."""
    return failure.restart_job_probe(namespace)


def probe_rljob(namespace: str) -> dict[str, Any]:
    """The RLJob doctor dry-runs when no manifest is given: the smallest complete one."""
    return {
        "apiVersion": f"{GROUP}/{RLJOB_VERSION}",
        "kind": "RLJob",
        "metadata": {"name": "rljob-doctor-probe", "namespace": namespace},
        "spec": {
            "model": {"name": "Qwen/Qwen3-4B"},
            "trainer": {"tpu": "v5p-8"},
            "sampler": {"tpu": "v5p-8"},
            "storage": {"root": "gs://rljob-doctor-probe"},
        },
    }


def _webhook_unreachable(error: str) -> bool:
    """The API server's message when it could not call a webhook (as opposed to the webhook denying)."""
    return failure.webhook_unreachable(error)


def probe_result(response: Obj) -> Probe:
    network = response.get("spec", {}).get("network") or {}
    return Probe(allowed=True, defaulted=network.get("enableDNSHostnames") is True)


def check_jobset_controller(deployments: Sequence[Obj], probe: Probe | None) -> list[Finding]:
    check = "jobset.controller"
    out: list[Finding] = []
    found = [(d, img) for d in deployments if (img := _jobset_image(d)) is not None]
    for dep, image in found:
        meta = dep.get("metadata", {})
        where = f"{meta.get('namespace')}/{meta.get('name')}"
        available = int(dep.get("status", {}).get("availableReplicas") or 0)
        version = parse_version(image.split("@", 1)[0].rsplit(":", 1)[-1]) if ":" in image else None
        if available < 1:
            out.append(
                problem(
                    check,
                    f"JobSet controller {where} ({image}) has no available replica",
                    f"kubectl -n {meta.get('namespace')} describe deployment {meta.get('name')}; "
                    f"kubectl -n {meta.get('namespace')} logs deployment/{meta.get('name')}",
                )
            )
        elif version is None:
            out.append(warning(check, f"JobSet controller {where} runs {image}: version unknown (no tag)"))
        elif version < MIN_JOBSET_VERSION:
            out.append(
                problem(
                    check,
                    f"JobSet controller {where} is {_fmt_version(version)}; rljob needs "
                    f">= {_fmt_version(MIN_JOBSET_VERSION)}",
                    f"upgrade JobSet to {TESTED_JOBSET_VERSION}: {JOBSET_INSTALL}",
                )
            )
        else:
            note = (
                ""
                if _fmt_version(version) == TESTED_JOBSET_VERSION
                else f" (tested: {TESTED_JOBSET_VERSION})"
            )
            out.append(ok(check, f"JobSet controller {where} {_fmt_version(version)} is available{note}"))
    if probe is not None and not probe.forbidden:
        if not probe.allowed and _webhook_unreachable(probe.error):
            out.append(
                problem(
                    "jobset.webhook",
                    f"JobSet's webhook is unreachable, a dry-run JobSet was refused: {probe.error}",
                    "the JobSet controller (it serves the webhook) is down or its certificate is wrong: "
                    "check the controller's pods and logs, or reinstall: " + JOBSET_INSTALL,
                )
            )
        elif not probe.allowed and failure.RESTART_JOB_GATE_REFUSAL in probe.error:
            out.append(
                warning(
                    "jobset.webhook",
                    f"JobSet's feature gate {failure.RESTART_JOB_GATE} is off: the operator (chart value "
                    "jobset.restartJob auto or disabled) renders its failure policy without the action "
                    "RestartJob, so a sampler crash restarts the whole run from its last checkpoint, "
                    "counted against spec.failurePolicy.maxRestarts; the gate buys a sampler's own restart "
                    "(that sampler Job alone, against maxSamplerRestarts, the trainer keeps running). With "
                    f"jobset.restartJob: enabled its webhook refuses every rljob JobSet: {probe.error}",
                    ENABLE_RESTART_JOB,
                )
            )
        elif not probe.allowed and "RestartJob" in probe.error:
            out.append(
                problem(
                    "jobset.webhook",
                    "JobSet's CRD does not know the failure action RestartJob (older than v0.12.0): "
                    + probe.error,
                    f"upgrade JobSet to {TESTED_JOBSET_VERSION}: {JOBSET_INSTALL}; then {ENABLE_RESTART_JOB}",
                )
            )
        elif not probe.allowed:
            out.append(
                problem(
                    "jobset.webhook",
                    f"JobSet's webhook refused a minimal dry-run JobSet: {probe.error}",
                    "kubectl get mutatingwebhookconfigurations,validatingwebhookconfigurations | grep jobset "
                    "(both must exist), or reinstall: " + JOBSET_INSTALL,
                )
            )
        elif not probe.defaulted:
            out.append(
                problem(
                    "jobset.webhook",
                    "JobSet's mutating webhook did not default a dry-run JobSet: the webhook "
                    "configuration is missing, so JobSets would run without the controller's defaults",
                    f"reinstall JobSet: {JOBSET_INSTALL}",
                )
            )
        else:
            out.append(
                ok("jobset.webhook", "JobSet's webhook answered a dry-run JobSet (controller serving)")
            )
    if not found and not (probe is not None and probe.allowed and probe.defaulted):
        out.append(
            problem(check, "no JobSet controller found (no Deployment runs a JobSet image)", JOBSET_INSTALL)
        )
    elif not found:
        out.append(
            warning(check, "JobSet's webhook answers but no Deployment runs a JobSet image: version unknown")
        )
    return out


def _webhook_covers(hook: Obj, group: str = GROUP, plural: str = PLURAL) -> bool:
    for rule in hook.get("rules", []) or []:
        groups = rule.get("apiGroups", []) or []
        resources = rule.get("resources", []) or []
        if (group in groups or "*" in groups) and (plural in resources or "*" in resources):
            return True
    return False


def check_jobset_webhook_configs(mutating: Sequence[Obj] | None, validating: Sequence[Obj]) -> list[Finding]:
    """JobSet ships a mutating (defaults) and a validating webhook configuration; both must be there.
    `mutating` None: not readable, nothing said."""
    if mutating is None:
        return []
    out = []
    for kind, configs in (("mutating", mutating), ("validating", validating)):
        if not any(
            _webhook_covers(h, JOBSET_GROUP, "jobsets") for c in configs for h in c.get("webhooks") or []
        ):
            out.append(
                problem(
                    "jobset.webhook",
                    f"no {kind} webhook configuration covers jobsets: JobSets would run without the "
                    f"controller's {'defaults' if kind == 'mutating' else 'validation'}",
                    f"reinstall JobSet: {JOBSET_INSTALL}",
                )
            )
    return out
