"""The Helm chart charts/rljob: `helm lint` clean, and what `helm template` renders for each set of values.

helm is hack/bin/helm (built from its Go module by hack/build.sh, pinned in hack/versions.env).
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rljob"
HELM = REPO / "hack" / "bin" / "helm"
KUBE = ("--kube-version", "1.37.2")  # helm template assumes an old Kubernetes otherwise


@pytest.fixture(scope="module")
def helm() -> Path:
    if not HELM.exists():
        if shutil.which("go") is None:
            pytest.skip("helm is not built and Go is missing (hack/build.sh helm)")
        subprocess.run(["bash", str(REPO / "hack" / "build.sh"), "helm"], check=True, timeout=1800)
    return HELM


def template(helm: Path, *sets: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "rljob", str(CHART), "-n", "rljob-system", "--include-crds", *KUBE]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_helm_lint_strict(helm: Path) -> None:
    proc = subprocess.run([str(helm), "lint", "--strict", str(CHART)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


def test_default_install(helm: Path) -> None:
    docs = template(helm)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "Role",  # rbac.scope namespaced by default: the release's namespace only
            "RoleBinding",
            "ClusterRoleBinding",  # system:auth-delegator, for metrics.auth
            "CustomResourceDefinition",
            "Deployment",
            "Secret",
            "Service",
            "ServiceAccount",
            "ValidatingWebhookConfiguration",
        ]
    )
    (dep,) = by_kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "rljob-rljob-operator"
    (container,) = pod["containers"]
    assert container["command"][0] == "rljob-operator"
    assert {p["name"] for p in container["ports"]} == {"metrics", "liveness", "webhook"}
    (secret,) = by_kind(docs, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    (hook,) = by_kind(docs, "ValidatingWebhookConfiguration")
    (wh,) = hook["webhooks"]
    assert wh["clientConfig"]["service"] == {
        "name": "rljob-rljob-operator",
        "namespace": "rljob-system",
        "path": "/validate-rljob",
        "port": 443,
    }
    assert base64.b64decode(wh["clientConfig"]["caBundle"]) == base64.b64decode(secret["data"]["ca.crt"])
    assert wh["rules"][0]["resources"] == ["rljobs"] and wh["failurePolicy"] == "Fail"
    (crd,) = by_kind(docs, "CustomResourceDefinition")
    assert crd == yaml.safe_load((REPO / "crds" / "rljob.dev_rljobs.yaml").read_text())


def test_default_scope_is_the_release_namespace(helm: Path) -> None:
    """No value set: the operator's rules are a Role in the release's namespace; the only cluster-wide
    grant is system:auth-delegator (TokenReviews and SubjectAccessReviews, for /metrics)."""
    docs = template(helm)
    assert not by_kind(docs, "ClusterRole")
    (role,) = by_kind(docs, "Role")
    assert role["metadata"]["namespace"] == "rljob-system"
    (crb,) = by_kind(docs, "ClusterRoleBinding")
    assert crb["roleRef"]["name"] == "system:auth-delegator"
    assert not by_kind(template(helm, "metrics.auth=false"), "ClusterRoleBinding")
    (dep,) = by_kind(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RLJOB_NAMESPACES"] == "rljob-system"


def test_rendered_rules_are_the_doctor_table(helm: Path) -> None:
    """The chart's rules, in both scopes, are rljob.cli.doctor.operator_rules' table, verb for verb: what
    `rljob doctor` checks is what the chart grants, and docs/operator.md lists it (hack/gen_rbac.py)."""
    from rljob.cli.doctor.operator_rules import OPERATOR_RULES

    want = [
        {"apiGroups": [r.group], "resources": [r.resource], "verbs": list(r.verbs)} for r in OPERATOR_RULES
    ]
    (role,) = by_kind(template(helm), "Role")
    (cluster_role,) = by_kind(template(helm, "rbac.scope=cluster"), "ClusterRole")
    assert role["rules"] == want
    assert cluster_role["rules"] == want


def test_rbac_is_least_privilege(helm: Path) -> None:
    docs = template(helm, "rbac.scope=cluster")
    (role,) = by_kind(docs, "ClusterRole")
    rules = role["rules"]
    bindings = {b["roleRef"]["name"]: b for b in by_kind(docs, "ClusterRoleBinding")}
    # The only other cluster-wide grant: TokenReviews and SubjectAccessReviews, for /metrics.
    assert set(bindings) == {"rljob-rljob-operator", "system:auth-delegator"}
    assert by_kind(template(helm, "rbac.scope=cluster", "metrics.auth=false"), "ClusterRoleBinding") == [
        bindings["rljob-rljob-operator"]
    ]
    # Secrets: only create and get (each run's credentials Secret; get after a 409, to check its owner).
    secrets = [r for r in rules if "secrets" in r["resources"]]
    assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]}]
    # Events are only created (and core ones listed, for FailedCreate): no patch.
    events = {r["apiGroups"][0]: r["verbs"] for r in rules if r["resources"] == ["events"]}
    assert events == {"events.k8s.io": ["create"], "": ["create", "list"]}
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
        assert ("delete" not in rule["verbs"] and "update" not in rule["verbs"]) or rule["resources"] == [
            "rljobs/finalizers"
        ], rule
    pods = [r for r in rules if "pods" in r["resources"]]
    assert pods == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    # Dry runs of the JobSet's Jobs, and the compile preflight's Job (rljob.operator.reconcile): no delete.
    jobs = [r for r in rules if "jobs" in r["resources"]]
    assert jobs == [
        {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create", "patch"]}
    ]
    rljobs = next(r for r in rules if r["resources"] == ["rljobs"])
    assert rljobs["verbs"] == ["get", "list", "watch"]


def test_local_operator_values(helm: Path) -> None:
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n").decode()
    docs = template(
        helm, "deployment.enabled=false", "webhook.url=https://127.0.0.1:9443", f"webhook.caBundle={ca}"
    )
    assert not by_kind(docs, "Deployment") and not by_kind(docs, "Secret") and not by_kind(docs, "Service")
    (hook,) = by_kind(docs, "ValidatingWebhookConfiguration")
    assert hook["webhooks"][0]["clientConfig"] == {
        "url": "https://127.0.0.1:9443/validate-rljob",
        "caBundle": ca,
    }
    assert by_kind(docs, "ServiceAccount") and by_kind(docs, "Role")


def test_webhook_disabled(helm: Path) -> None:
    docs = template(helm, "webhook.enabled=false")
    assert not by_kind(docs, "ValidatingWebhookConfiguration") and not by_kind(docs, "Secret")
    (dep,) = by_kind(docs, "Deployment")
    env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RLJOB_WEBHOOK_ENABLED"] == "false"


@pytest.mark.parametrize(("sets", "want"), [((), "auto"), (("jobset.restartJob=disabled",), "disabled")])
def test_jobset_restart_job_reaches_the_operator(helm: Path, sets: tuple[str, ...], want: str) -> None:
    """The chart's jobset.restartJob is the operator's RLJOB_JOBSET_RESTART_JOB (operator/jobset_gate.py)."""
    (dep,) = by_kind(template(helm, *sets), "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RLJOB_JOBSET_RESTART_JOB"] == want


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("webhook.failurePolicy=Maybe", "failurePolicy"),
        ("workers=0", "workers"),
        ("webhook.url=http://insecure", "url"),
        ("nosuchkey=1", "nosuchkey"),
        ("rbac.scope=everywhere", "scope"),
        ("rbac.namespaces={Bad_NS}", "namespaces"),
        ("jobset.restartJob=on", "restartJob"),
    ],
)
def test_values_schema_refuses(helm: Path, value: str, complaint: str) -> None:
    args = [str(helm), "template", "rljob", str(CHART), *KUBE, "--set", value]
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode != 0
    assert complaint in proc.stderr, proc.stderr


def test_namespaced_mode_has_no_cluster_role_for_the_children(helm: Path) -> None:
    """rbac.scope namespaced: the ClusterRole's rules as a Role + RoleBinding in each served namespace, the
    operator told which (RLJOB_NAMESPACES), the webhook limited to them; no ClusterRole at all."""
    cluster_rules = by_kind(template(helm, "rbac.scope=cluster"), "ClusterRole")[0]["rules"]
    docs = template(helm, "rbac.scope=namespaced", "rbac.namespaces={team-a,team-b}", "metrics.auth=false")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    roles, bindings = by_kind(docs, "Role"), by_kind(docs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert all(r["rules"] == cluster_rules for r in roles)
    for b in bindings:
        assert b["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "rljob-rljob-operator",
        }
        assert b["subjects"] == [
            {"kind": "ServiceAccount", "name": "rljob-rljob-operator", "namespace": "rljob-system"}
        ]
    (dep,) = by_kind(docs, "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RLJOB_NAMESPACES"] == "team-a,team-b"
    (hook,) = by_kind(docs, "ValidatingWebhookConfiguration")
    assert hook["webhooks"][0]["namespaceSelector"] == {
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}
        ]
    }
    # Default: the release's namespace.
    docs = template(helm)
    assert [r["metadata"]["namespace"] for r in by_kind(docs, "Role")] == ["rljob-system"]


def test_webhook_certificate_checksum_rolls_the_operator(helm: Path) -> None:
    """The pod template carries the checksum of the certificate the Secret holds: a new certificate
    (helm template always makes one; an upgrade keeps the Secret's, see the cluster test) changes it."""
    import hashlib
    import json

    first, second = template(helm), template(helm)
    sums = []
    for docs in (first, second):
        (secret,) = by_kind(docs, "Secret")
        (dep,) = by_kind(docs, "Deployment")
        data = secret["data"]
        shared = json.dumps(
            {"ca": data["ca.crt"], "cert": data["tls.crt"], "key": data["tls.key"]}, separators=(",", ":")
        )
        annotation = dep["spec"]["template"]["metadata"]["annotations"]["checksum/webhook-certificate"]
        assert annotation == hashlib.sha256(shared.encode()).hexdigest()
        sums.append(annotation)
    assert sums[0] != sums[1]


def test_metrics_are_https_and_authorized_in_cluster(helm: Path) -> None:
    (dep,) = by_kind(template(helm), "Deployment")
    pod = dep["spec"]["template"]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["RLJOB_METRICS_AUTH"] == "true"
    assert env["RLJOB_METRICS_CERT"] == "/etc/rljob/webhook/tls.crt"
    assert pod["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    (dep,) = by_kind(template(helm, "webhook.enabled=false", "metrics.auth=false"), "Deployment")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RLJOB_METRICS_AUTH"] == "false" and "RLJOB_METRICS_CERT" not in env
