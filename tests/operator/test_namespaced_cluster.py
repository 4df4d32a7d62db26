"""Least privilege and ownership on the local cluster: the chart's namespaced mode checked with
`kubectl auth can-i` as the operator's ServiceAccount and run end to end, /metrics authorized by the API
server, the webhook certificate kept across `helm upgrade` (and a new one rolling the operator), and a
child of the same name that is not the RLJob's never adopted.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures.cluster import HELM, KUBECTL, Cluster, wait_for
from fixtures.operator import (
    CHART,
    OperatorProcess,
    create_rljob,
    get_rljob,
    manifest,
    service_account_kubeconfig,
    service_account_token,
    wait_rljob,
)
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from rljob.cli.doctor.operator_rules import OPERATOR_PERMISSIONS
from rljob.common.ports import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600, func_only=True)]

NS_RELEASE = "rljobns"


def helm(c: Cluster, *args: str) -> str:
    proc = subprocess.run(
        [str(HELM), *args], env=c.env, capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def can_i(c: Cluster, sa: str, verb: str, resource: str, namespace: str | None) -> bool:
    """`kubectl auth can-i` as a ServiceAccount (the admin kubeconfig impersonates it)."""
    scope = ["-n", namespace] if namespace else ["--all-namespaces"]
    resource, _, sub = resource.partition("/")
    if sub:
        scope.append(f"--subresource={sub}")
    proc = subprocess.run(
        [str(KUBECTL), "auth", "can-i", verb, resource, *scope, f"--as={sa}"],
        env=c.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.stdout.strip() in ("yes", "no"), proc.stdout + proc.stderr
    return proc.stdout.strip() == "yes"


@pytest.fixture
def namespaced_release(cluster: Cluster, namespace: str) -> Iterator[tuple[str, str]]:
    """The chart with its default scope (namespaced) serving `namespace` only (no Deployment, no webhook:
    the operator runs as a local process), in a release namespace of its own. Yields (release namespace,
    ServiceAccount)."""
    release_ns = f"{namespace}-op"[:63]
    helm(
        cluster,
        "install",
        NS_RELEASE,
        str(CHART),
        "--namespace",
        release_ns,
        "--create-namespace",
        "--set",
        f"rbac.namespaces={{{namespace}}}",  # rbac.scope namespaced: the chart's default
        "--set",
        "deployment.enabled=false",
        "--set",
        "webhook.enabled=false",
        "--wait",
    )
    try:
        yield release_ns, f"{NS_RELEASE}-rljob-operator"
    finally:
        helm(cluster, "uninstall", NS_RELEASE, "--namespace", release_ns, "--wait")
        with contextlib.suppress(ApiException):
            cluster.core.delete_namespace(release_ns)


def test_namespaced_mode_grants_only_the_served_namespace(
    cluster: Cluster, namespace: str, namespaced_release: tuple[str, str]
) -> None:
    release_ns, sa_name = namespaced_release
    sa = f"system:serviceaccount:{release_ns}:{sa_name}"
    other = release_ns  # any namespace the release does not serve
    # What the operator needs, in the namespace it serves: every verb of the one table
    # (rljob.cli.doctor.operator_rules, which the chart's rules are generated from and doctor checks).
    for perm in OPERATOR_PERMISSIONS:
        kind = f"{perm.resource}.{perm.group}" if perm.group else perm.resource
        resource = f"{kind}/{perm.subresource}" if perm.subresource else kind
        assert can_i(cluster, sa, perm.verb, resource, namespace), f"{perm} in {namespace}"
    # Never: other Secret verbs, deletes, pods of its own, anything cluster-scoped for the children.
    for verb, resource in [
        ("list", "secrets"),
        ("watch", "secrets"),
        ("patch", "secrets"),
        ("delete", "secrets"),
        ("delete", "jobsets.jobset.x-k8s.io"),
        ("delete", "configmaps"),
        ("create", "pods"),
        ("delete", "jobs.batch"),
        ("update", "rljobs.rljob.dev"),
        ("escalate", "roles.rbac.authorization.k8s.io"),
        ("patch", "events"),
        ("patch", "events.events.k8s.io"),
        ("bind", "roles.rbac.authorization.k8s.io"),
    ]:
        assert not can_i(cluster, sa, verb, resource, namespace), f"{verb} {resource} in {namespace}"
    # Nothing in another namespace, nothing across all namespaces.
    for verb, resource in [
        ("list", "rljobs.rljob.dev"),
        ("create", "jobsets.jobset.x-k8s.io"),
        ("list", "configmaps"),
        ("list", "pods"),
        ("create", "rolebindings.rbac.authorization.k8s.io"),
    ]:
        assert not can_i(cluster, sa, verb, resource, other), f"{verb} {resource} in {other}"
        assert not can_i(cluster, sa, verb, resource, None), f"{verb} {resource} in all namespaces"
    # The one cluster-wide grant (metrics.auth): reviews for /metrics, nothing else.
    assert can_i(cluster, sa, "create", "tokenreviews.authentication.k8s.io", None)
    assert can_i(cluster, sa, "create", "subjectaccessreviews.authorization.k8s.io", None)
    assert not can_i(cluster, sa, "create", "clusterroles.rbac.authorization.k8s.io", None)
    assert not can_i(cluster, sa, "list", "namespaces", None)


def test_a_namespaced_operator_runs_rljobs_in_its_namespace_only(
    cluster: Cluster,
    namespace: str,
    namespaced_release: tuple[str, str],
    rljob_operator: OperatorProcess,
    tmp_path: Path,
) -> None:
    """The operator as the namespaced ServiceAccount: it starts (its start-up lists are namespaced), runs an
    RLJob in its namespace, and leaves one elsewhere alone. The session's cluster-wide operator is stopped
    meanwhile, so that only this one acts."""
    release_ns, sa_name = namespaced_release
    kubeconfig = service_account_kubeconfig(cluster, tmp_path / "kubeconfig", sa_name, release_ns)
    # It serves the admission webhook in the session operator's place (same port and certificate): the
    # session chart's webhook configuration points there, with failurePolicy Fail.
    op = OperatorProcess(
        cluster,
        kubeconfig,
        rljob_operator.cert,
        rljob_operator.key,
        rljob_operator.webhook_port,
        tmp_path / "namespaced-operator.log",
        extra_env={"RLJOB_NAMESPACES": namespace},
    )
    rljob_operator.stop()
    try:
        op.start()
        create_rljob(cluster, manifest("served", namespace))
        create_rljob(cluster, manifest("elsewhere", release_ns))
        status = wait_rljob(cluster, namespace, "served", 90, "a JobSet", lambda s: s.get("jobSetName"))[
            "status"
        ]
        assert status["phase"] in ("Pending", "Running")
        assert "status" not in get_rljob(cluster, release_ns, "elsewhere")
        assert "Forbidden" not in op.log_path.read_text() and "403" not in op.log_tail(200), op.log_tail()
    finally:
        op.stop()
        with contextlib.suppress(ApiException):
            cluster.custom.delete_namespaced_custom_object(
                "rljob.dev", "v1alpha1", release_ns, "rljobs", "elsewhere"
            )
        rljob_operator.start()


@contextlib.contextmanager
def _metrics_server(kubeconfig: Path, port: int) -> Iterator[None]:
    """rljob.operator.metrics' server with its Authorizer, talking to the API as the operator's account."""
    import os

    from rljob.operator import handlers, k8s, metrics

    saved = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    loop = asyncio.new_event_loop()
    state: dict[str, Any] = {}

    async def serve() -> None:
        kube = k8s.Kube(handlers.login)
        state["runner"] = await metrics.start_server("127.0.0.1", port, auth=metrics.Authorizer(kube.review))
        state["kube"] = kube

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(60)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = saved
        asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(30)
        asyncio.run_coroutine_threadsafe(state["kube"].close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _scrape(port: int, token: str | None) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = resp.read().decode()
            assert "rljob_operator_api_requests_total" in body
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_metrics_answer_only_callers_the_api_server_authorizes(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess, tmp_path: Path
) -> None:
    """The chart's binding to system:auth-delegator lets the operator's account ask; a scraper needs
    `get` on the non-resource URL /metrics."""
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    for name in ("reader", "nobody"):
        cluster.core.create_namespaced_service_account(
            namespace, client.V1ServiceAccount(metadata={"name": name})
        )
    role = f"{namespace}-metrics-reader"
    rbac.create_cluster_role(
        {"metadata": {"name": role}, "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]}
    )
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        }
    )
    try:
        port = free_port()
        with _metrics_server(rljob_operator.kubeconfig, port):
            assert _scrape(port, None) == 401
            assert _scrape(port, "not-a-token") == 401
            assert _scrape(port, service_account_token(cluster, "nobody", namespace)) == 403
            reader = service_account_token(cluster, "reader", namespace)
            wait_for(lambda: _scrape(port, reader) == 200, 30, "the reader's scrape (RBAC takes a moment)")
    finally:
        rbac.delete_cluster_role_binding(role)
        rbac.delete_cluster_role(role)


def test_helm_upgrade_keeps_the_webhook_certificate_and_a_new_one_rolls_the_operator(
    cluster: Cluster, namespace: str
) -> None:
    """In-cluster webhook (a Deployment; kwok runs no containers, the objects are what matters), in
    namespaced mode so that its webhook only covers this test's namespace."""
    release = "rljobcert"
    apps = client.AppsV1Api(cluster.api)
    common = [
        "--namespace",
        namespace,
        "--set",
        "webhook.failurePolicy=Ignore",
    ]

    def state() -> tuple[str, str, str]:
        secret = cluster.core.read_namespaced_secret(f"{release}-rljob-operator-webhook-tls", namespace)
        dep = apps.read_namespaced_deployment(f"{release}-rljob-operator", namespace)
        hook = client.AdmissionregistrationV1Api(cluster.api).read_validating_webhook_configuration(
            f"{release}-rljob-operator"
        )
        assert hook.webhooks[0].client_config.ca_bundle == secret.data["ca.crt"]
        checksum = dep.spec.template.metadata.annotations["checksum/webhook-certificate"]
        return secret.data["tls.crt"], checksum, str(dep.metadata.generation)

    helm(cluster, "install", release, str(CHART), *common)
    try:
        cert, checksum, generation = state()
        helm(cluster, "upgrade", release, str(CHART), *common, "--set", "workers=4")
        cert2, checksum2, generation2 = state()
        assert (cert2, checksum2) == (cert, checksum)  # kept: the API server and the operator still agree
        assert generation2 != generation  # (the upgrade did change the Deployment: workers)
        helm(cluster, "upgrade", release, str(CHART), *common, "--set", "webhook.rotateCertificate=true")
        cert3, checksum3, _ = state()
        assert cert3 != cert and checksum3 != checksum  # a new certificate restarts the operator's pod
    finally:
        helm(cluster, "uninstall", release, "--namespace", namespace, "--wait")


def test_a_child_of_the_same_name_not_ours_is_reported_not_adopted(
    cluster: Cluster, namespace: str, rljob_operator: OperatorProcess
) -> None:
    """A ConfigMap named like the run's, owned by nobody: the RLJob waits with Ready=False ChildNotOwned
    and a Warning event, the ConfigMap is untouched; once it is gone the run starts."""
    foreign = client.V1ConfigMap(metadata=client.V1ObjectMeta(name="twin-run"), data={"run.json": "{}"})
    cluster.core.create_namespaced_config_map(namespace, foreign)
    create_rljob(cluster, manifest("twin", namespace))

    def not_owned(s: dict[str, Any]) -> bool:
        return any(x["type"] == "Ready" and x["reason"] == "ChildNotOwned" for x in s.get("conditions") or [])

    status = wait_rljob(cluster, namespace, "twin", 90, "Ready=False ChildNotOwned", not_owned)["status"]
    ready = next(x for x in status["conditions"] if x["type"] == "Ready")
    assert status["phase"] == "Pending" and "ConfigMap " + namespace + "/twin-run exists" in ready["message"]
    cm = cluster.core.read_namespaced_config_map("twin-run", namespace)
    assert cm.data == {"run.json": "{}"} and not cm.metadata.owner_references
    events = cluster.core.list_namespaced_event(namespace, field_selector="involvedObject.name=twin").items
    assert any(e.reason == "ChildNotOwned" and e.type == "Warning" for e in events), [
        e.reason for e in events
    ]
    with pytest.raises(ApiException):
        cluster.get_jobset(namespace, "twin")
    cluster.core.delete_namespaced_config_map("twin-run", namespace)
    wait_rljob(
        cluster, namespace, "twin", 120, "a JobSet after the retry", lambda s: s.get("jobSetName") == "twin"
    )
    owner = cluster.core.read_namespaced_config_map("twin-run", namespace).metadata.owner_references[0]
    assert owner.kind == "RLJob" and owner.name == "twin"
