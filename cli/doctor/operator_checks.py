"""The rljob operator: the RLJob CRD, its Deployment, its ServiceAccount's RBAC, its webhook, and
whether you may create RLJobs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rljob.cli.doctor import DEFAULT_OPERATOR_NAMESPACE, DEFAULT_OPERATOR_SERVICE_ACCOUNT
from rljob.cli.doctor.common import Obj
from rljob.cli.doctor.findings import Finding, ok, problem, warning
from rljob.cli.doctor.jobset import Probe, _webhook_covers, _webhook_unreachable
from rljob.cli.doctor.operator_rules import Permission
from rljob.recipes.api import GROUP, PLURAL

RLJOB_CRD = f"{PLURAL}.{GROUP}"


# The chart labels its ServiceAccount and Deployment with this; doctor finds the operator by it.
OPERATOR_LABEL = "app.kubernetes.io/name=rljob-operator"


def check_operator(
    crds: Mapping[str, Obj],
    deployments: Sequence[Obj],
    webhooks: Sequence[Obj],
    access: Mapping[Permission, bool | None],
    can_create_rljobs: bool | None,
    operator_namespace: str,
    operator_sa: str,
    namespace: str,
    admission: Probe | None = None,
    for_manifest: bool = False,
) -> list[Finding]:
    """`admission` is a server-side dry-run create of an RLJob (the manifest, or doctor's own probe):
    it passes through the operator's webhook, so it shows whether the operator answers wherever it runs."""
    out: list[Finding] = []
    unreachable = admission is not None and not admission.allowed and _webhook_unreachable(admission.error)
    answered = admission is not None and not admission.forbidden and (admission.allowed or not unreachable)
    install = f"helm install rljob charts/rljob --namespace {operator_namespace} --create-namespace"
    if RLJOB_CRD not in crds:
        out.append(problem("operator.crd", f"the RLJob CRD {RLJOB_CRD} is not installed", install))
    else:
        out.append(ok("operator.crd", f"RLJob CRD {RLJOB_CRD} installed"))

    ours = [
        d
        for d in deployments
        if d.get("metadata", {}).get("namespace") == operator_namespace
        and d.get("spec", {}).get("template", {}).get("spec", {}).get("serviceAccountName") == operator_sa
    ]
    if not ours and answered:
        out.append(
            warning(
                "operator.deployment",
                f"no Deployment in {operator_namespace} runs as ServiceAccount {operator_sa}, but the "
                "operator's webhook answers: the operator runs outside the cluster?",
            )
        )
    elif not ours:
        out.append(
            problem(
                "operator.deployment",
                f"no Deployment in {operator_namespace} runs as ServiceAccount {operator_sa}",
                install + "  (or pass --operator-namespace / --operator-service-account)",
            )
        )
    for dep in ours:
        name = dep["metadata"].get("name")
        if int(dep.get("status", {}).get("availableReplicas") or 0) < 1:
            out.append(
                problem(
                    "operator.deployment",
                    f"operator Deployment {operator_namespace}/{name} has no available replica",
                    f"kubectl -n {operator_namespace} logs deployment/{name}",
                )
            )
        else:
            out.append(
                ok("operator.deployment", f"operator Deployment {operator_namespace}/{name} is available")
            )

    denied = [str(p) for p, allowed in access.items() if allowed is False]
    unknown = [str(p) for p, allowed in access.items() if allowed is None]
    subject = f"system:serviceaccount:{operator_namespace}:{operator_sa}"
    if denied:
        out.append(
            problem(
                "operator.rbac",
                f"{subject} may not: {', '.join(denied)} (namespace {namespace})",
                f"reinstall the chart's RBAC: helm upgrade rljob charts/rljob -n {operator_namespace}",
            )
        )
    if unknown:
        out.append(
            warning(
                "operator.rbac",
                f"could not check {len(unknown)} permissions of {subject} (you may not create "
                "subjectaccessreviews.authorization.k8s.io)",
            )
        )
    if access and not denied and not unknown:
        out.append(ok("operator.rbac", f"{subject} has all {len(access)} permissions the operator uses"))

    hooks = [
        (cfg.get("metadata", {}).get("name"), hook)
        for cfg in webhooks
        for hook in cfg.get("webhooks", []) or []
        if _webhook_covers(hook)
    ]
    if not hooks:
        out.append(
            problem(
                "operator.webhook",
                "no validating webhook covers rljobs: bad manifests would be accepted and fail later",
                install,
            )
        )
    for cfg_name, hook in hooks:
        client = hook.get("clientConfig", {}) or {}
        if client.get("service") and not client.get("caBundle"):
            out.append(
                problem(
                    "operator.webhook",
                    f"webhook {cfg_name}/{hook.get('name')} has no caBundle: the API server cannot call it",
                    f"helm upgrade rljob charts/rljob -n {operator_namespace}",
                )
            )
        else:
            target = client.get("service") or {"url": client.get("url")}
            where = (
                f"service {target.get('namespace')}/{target.get('name')}"
                if "name" in target
                else f"url {target.get('url')}"
            )
            out.append(
                ok("operator.webhook", f"webhook {cfg_name}/{hook.get('name')} covers rljobs ({where})")
            )

    what = "this manifest" if for_manifest else "doctor's probe RLJob"
    if admission is not None and not admission.forbidden and hooks:
        if unreachable:
            out.append(
                problem(
                    "operator.admission",
                    f"a dry-run of {what} could not reach the operator's webhook: {admission.error}",
                    f"the operator is down or unreachable: kubectl -n {operator_namespace} get pods; "
                    f"kubectl -n {operator_namespace} logs deployment/<operator>",
                )
            )
        elif not admission.allowed:
            out.append(problem("operator.admission", f"the operator refuses {what}: {admission.error}"))
        else:
            out.append(ok("operator.admission", f"the operator's webhook admitted a dry-run of {what}"))

    if can_create_rljobs is False:
        out.append(
            problem(
                "user.rbac",
                f"you may not create rljobs in namespace {namespace}",
                f"ask an admin for a RoleBinding granting create on {PLURAL}.{GROUP} in {namespace}",
            )
        )
    elif can_create_rljobs:
        out.append(ok("user.rbac", f"you may create rljobs in namespace {namespace}"))
    return out


def find_operator(
    service_accounts: Sequence[Obj], namespace: str | None, name: str | None
) -> tuple[str, str]:
    """The operator's namespace and ServiceAccount: the flags where given, else the one ServiceAccount
    the chart labelled (OPERATOR_LABEL), else the chart's defaults for `helm install rljob`."""
    found = [
        (sa["metadata"]["namespace"], sa["metadata"]["name"])
        for sa in service_accounts
        if (namespace is None or sa["metadata"]["namespace"] == namespace)
        and (name is None or sa["metadata"]["name"] == name)
    ]
    if len(found) == 1:
        return found[0]
    return namespace or DEFAULT_OPERATOR_NAMESPACE, name or DEFAULT_OPERATOR_SERVICE_ACCOUNT
