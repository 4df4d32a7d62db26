"""Reading the cluster (the `kubernetes` client, imported lazily) into `ClusterState`, and running
every check group over it."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from rljob.cli.doctor import DEFAULT_OPERATOR_NAMESPACE, DEFAULT_OPERATOR_SERVICE_ACCOUNT
from rljob.cli.doctor.common import Obj
from rljob.cli.doctor.findings import Finding, problem
from rljob.cli.doctor.jobset import (
    JOBSET_CRD,
    Probe,
    check_jobset_controller,
    check_jobset_crd,
    check_jobset_webhook_configs,
    probe_object,
    probe_result,
    probe_rljob,
)
from rljob.cli.doctor.kueue import (
    KUEUE_CONFIG_MAP,
    KUEUE_CONFIG_NAMESPACE,
    KUEUE_GROUP,
    LOCALQUEUE_CRD,
    check_pods_ready_timeout,
    check_queue,
)
from rljob.cli.doctor.needs import Needs, check_references
from rljob.cli.doctor.nodepools import check_node_pools
from rljob.cli.doctor.operator_checks import (
    OPERATOR_LABEL,
    RLJOB_CRD,
    check_operator,
    find_operator,
)
from rljob.cli.doctor.operator_rules import OPERATOR_PERMISSIONS, Permission
from rljob.cli.doctor.podsecurity import check_pod_security
from rljob.recipes.api import GROUP, PLURAL
from rljob.recipes.api import VERSION as RLJOB_VERSION
from rljob.recipes.naming import JOBSET_GROUP, JOBSET_VERSION


@dataclass
class ClusterState:
    """Everything the checks read, as the API server returned it (JSON dicts)."""

    server: str = ""
    crds: dict[str, Obj] = field(default_factory=dict)
    deployments: list[Obj] = field(default_factory=list)
    nodes: list[Obj] = field(default_factory=list)
    local_queues: list[Obj] | None = None
    # Kueue's configuration ConfigMap: the object, None when missing or not read, False when unreadable.
    kueue_config: Obj | bool | None = None
    webhooks: list[Obj] = field(default_factory=list)
    access: dict[Permission, bool | None] = field(default_factory=dict)
    can_create_rljobs: bool | None = None
    jobset_probe: Probe | None = None
    rljob_probe: Probe | None = None
    mutating_webhooks: list[Obj] | None = None
    unreadable: list[str] = field(default_factory=list)  # cluster-wide lists the caller may not read
    operator_namespace: str = DEFAULT_OPERATOR_NAMESPACE
    operator_sa: str = DEFAULT_OPERATOR_SERVICE_ACCOUNT
    references: dict[tuple[str, str], Obj | bool | None] = field(default_factory=dict)
    # The RLJob's Namespace: the object, None when missing or not read, False when unreadable.
    namespace_obj: Obj | bool | None = None


def run_checks(state: ClusterState, needs: Needs | None) -> list[Finding]:
    namespace = needs.namespace if needs else "default"
    if state.unreadable:
        # Without these lists every check would report things missing that are only hidden.
        mine = check_operator({}, [], [], {}, state.can_create_rljobs, "", "", namespace)
        return [
            problem(
                "access",
                f"you may not list {', '.join(state.unreadable)}: doctor cannot check this cluster",
                "run doctor as a cluster admin, or bind a ClusterRole with get/list on "
                "customresourcedefinitions, deployments, nodes and validatingwebhookconfigurations",
            ),
            *[f for f in mine if f.check == "user.rbac"],
        ]
    return (
        check_jobset_crd(state.crds)
        + check_jobset_controller(state.deployments, state.jobset_probe)
        + (
            check_jobset_webhook_configs(state.mutating_webhooks, state.webhooks)
            if JOBSET_CRD in state.crds
            else []
        )
        + check_node_pools(state.nodes, needs)
        + check_queue(state.crds, state.local_queues, needs)
        + check_pods_ready_timeout(state.crds, state.kueue_config, state.nodes, needs)
        + check_operator(
            state.crds,
            state.deployments,
            state.webhooks,
            state.access,
            state.can_create_rljobs,
            state.operator_namespace,
            state.operator_sa,
            namespace,
            state.rljob_probe,
            needs is not None and needs.manifest is not None,
        )
        + (check_references(needs.references, state.references, namespace) if needs else [])
        + check_pod_security(state.namespace_obj, namespace)
    )


class ClusterError(Exception):
    """The cluster could not be read at all (no kubeconfig, API server unreachable)."""


class _Forbidden(Exception):
    pass


def _api_message(exc: Any) -> str:
    """The `message` of a Kubernetes Status in an ApiException's body, else the exception's text."""
    message = exc.body if isinstance(exc.body, str | bytes) else str(exc)
    with contextlib.suppress(ValueError, AttributeError):
        message = json.loads(message).get("message", message)
    return str(message.decode() if isinstance(message, bytes) else message)


class _Reader:
    """The kubernetes client's raw JSON reads, with doctor's error semantics: 401/403 raise `_Forbidden`,
    404 gives None, an unreachable server raises `ClusterError`."""

    def __init__(self, kubeconfig: str | None, context: str | None) -> None:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        try:
            if kubeconfig is None and context is None:
                try:
                    config.load_kube_config()  # type: ignore[no-untyped-call]
                except (ConfigException, FileNotFoundError, TypeError):
                    config.load_incluster_config()  # type: ignore[no-untyped-call]
            else:
                config.load_kube_config(config_file=kubeconfig, context=context)  # type: ignore[no-untyped-call]
        except (ConfigException, FileNotFoundError, TypeError) as exc:
            raise ClusterError(f"no usable kubeconfig: {exc}") from None
        self.client = client
        self.api = client.ApiClient()
        self.host = str(self.api.configuration.host)

    def raw(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            resp = call(*args, _preload_content=False, _request_timeout=15, **kwargs)
        except ApiException as exc:
            if exc.status in (401, 403):
                raise _Forbidden(str(exc.reason)) from None
            if exc.status == 404:
                return None
            raise
        except Exception as exc:  # urllib3 connection errors and the like
            raise ClusterError(f"cannot reach the API server {self.host}: {exc}") from None
        return json.loads(resp.data)

    def items(self, call: Any, *args: Any, **kwargs: Any) -> list[Obj] | None:
        """A list's items; None when the caller may not list them."""
        from kubernetes.client.exceptions import ApiException

        try:
            got = self.raw(call, *args, **kwargs)
        except _Forbidden:
            return None
        except ApiException as exc:
            raise ClusterError(f"{self.host}: {exc.status} {exc.reason}") from None
        return list(got.get("items", [])) if got else []

    def dry_run(self, group: str, version: str, namespace: str, plural: str, body: Obj) -> Probe:
        """A server-side dry-run create (it passes through the admission webhooks)."""
        from kubernetes.client.exceptions import ApiException

        custom = self.client.CustomObjectsApi(self.api)
        try:
            got = self.raw(
                custom.create_namespaced_custom_object, group, version, namespace, plural, body, dry_run="All"
            )
        except _Forbidden:
            return Probe(False, False, forbidden=True)
        except ApiException as exc:
            return Probe(False, False, error=_api_message(exc))
        return probe_result(got or {})


def _read_lists(r: _Reader, state: ClusterState, needs: Needs | None, namespace: str) -> None:
    """The cluster-wide lists every check reads (their absence is reported, not guessed around)."""
    client, api = r.client, r.api
    admission = client.AdmissionregistrationV1Api(api)
    lists = {
        "customresourcedefinitions": r.items(client.ApiextensionsV1Api(api).list_custom_resource_definition),
        "deployments": r.items(client.AppsV1Api(api).list_deployment_for_all_namespaces),
        "nodes": r.items(client.CoreV1Api(api).list_node),
        "validatingwebhookconfigurations": r.items(admission.list_validating_webhook_configuration),
    }
    state.unreadable = sorted(k for k, v in lists.items() if v is None)
    state.crds = {c["metadata"]["name"]: c for c in lists["customresourcedefinitions"] or []}
    state.deployments = lists["deployments"] or []
    state.nodes = lists["nodes"] or []
    state.webhooks = lists["validatingwebhookconfigurations"] or []
    state.mutating_webhooks = r.items(admission.list_mutating_webhook_configuration)
    lq_crd = state.crds.get(LOCALQUEUE_CRD)
    if lq_crd is not None and needs is not None and needs.queue_name:
        served = [v["name"] for v in lq_crd["spec"]["versions"] if v.get("served")]
        storage = [v["name"] for v in lq_crd["spec"]["versions"] if v.get("storage")] or served
        custom = client.CustomObjectsApi(api)
        state.local_queues = r.items(
            custom.list_namespaced_custom_object, KUEUE_GROUP, storage[0], namespace, "localqueues"
        )
        state.kueue_config = _read_optional(
            r, client.CoreV1Api(api).read_namespaced_config_map, KUEUE_CONFIG_MAP, KUEUE_CONFIG_NAMESPACE
        )


def _read_optional(r: _Reader, call: Any, *args: Any) -> Obj | bool | None:
    """One object: the object, None when it does not exist, False when it may not be read."""
    from kubernetes.client.exceptions import ApiException

    try:
        got: Obj | None = r.raw(call, *args)
    except (_Forbidden, ApiException):
        return False
    return got


def _read_references(r: _Reader, state: ClusterState, needs: Needs, namespace: str) -> None:
    """The objects the pod overrides name: the object, None when missing, False when unreadable."""
    from kubernetes.client.exceptions import ApiException

    core = r.client.CoreV1Api(r.api)
    readers = {
        "Secret": core.read_namespaced_secret,
        "ConfigMap": core.read_namespaced_config_map,
        "ServiceAccount": core.read_namespaced_service_account,
        "PersistentVolumeClaim": core.read_namespaced_persistent_volume_claim,
    }
    for ref in needs.references:
        try:
            if ref.kind == "CSIDriver":  # cluster-scoped
                got = r.raw(r.client.StorageV1Api(r.api).read_csi_driver, ref.name)
            else:
                got = r.raw(readers[ref.kind], ref.name, namespace)
            state.references[(ref.kind, ref.name)] = got
        except (_Forbidden, ApiException):
            state.references[(ref.kind, ref.name)] = False


def _allowed(r: _Reader, call: Any, body: Any) -> bool | None:
    """An access review's answer; None when doctor may not ask."""
    from kubernetes.client.exceptions import ApiException

    try:
        got = r.raw(call, body)
    except (_Forbidden, ApiException):
        return None
    return bool((got or {}).get("status", {}).get("allowed"))


def _review_access(r: _Reader, state: ClusterState, namespace: str) -> None:
    """May the operator's ServiceAccount do what the operator does (one SubjectAccessReview per
    permission), and may you create RLJobs here (a SelfSubjectAccessReview)?"""
    client = r.client
    authz = client.AuthorizationV1Api(r.api)
    ns, sa = state.operator_namespace, state.operator_sa
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{ns}", "system:authenticated"]
    for perm in OPERATOR_PERMISSIONS:
        attrs: dict[str, Any] = {"verb": perm.verb, "group": perm.group, "resource": perm.resource}
        if perm.subresource:
            attrs["subresource"] = perm.subresource
        if perm.namespaced:
            attrs["namespace"] = namespace
        body = client.V1SubjectAccessReview.from_dict(
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": f"system:serviceaccount:{ns}:{sa}",
                    "groups": groups,
                    "resourceAttributes": attrs,
                },
            }
        )
        state.access[perm] = _allowed(r, authz.create_subject_access_review, body)
    mine = {"verb": "create", "group": GROUP, "resource": PLURAL, "namespace": namespace}
    self_review = client.V1SelfSubjectAccessReview.from_dict(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": mine},
        }
    )
    state.can_create_rljobs = _allowed(r, authz.create_self_subject_access_review, self_review)


def gather(
    needs: Needs | None,
    kubeconfig: str | None = None,
    context: str | None = None,
    operator_namespace: str | None = None,
    operator_sa: str | None = None,
) -> ClusterState:
    """Read what the checks need with the kubernetes client (imported here, lazily)."""
    r = _Reader(kubeconfig, context)
    namespace = needs.namespace if needs else "default"
    state = ClusterState(server=r.host)
    _read_lists(r, state, needs, namespace)
    if JOBSET_CRD in state.crds:
        state.jobset_probe = r.dry_run(
            JOBSET_GROUP, JOBSET_VERSION, namespace, "jobsets", probe_object(namespace)
        )
    if RLJOB_CRD in state.crds:
        # Admitted means the operator's webhook answered (`defaulted` means nothing for an RLJob).
        rljob = needs.manifest if needs is not None and needs.manifest is not None else probe_rljob(namespace)
        state.rljob_probe = r.dry_run(GROUP, RLJOB_VERSION, namespace, PLURAL, dict(rljob))
    if needs is not None:
        _read_references(r, state, needs, namespace)
    try:
        state.namespace_obj = r.raw(r.client.CoreV1Api(r.api).read_namespace, namespace)
    except _Forbidden:
        state.namespace_obj = False
    labelled = r.items(
        r.client.CoreV1Api(r.api).list_service_account_for_all_namespaces, label_selector=OPERATOR_LABEL
    )
    state.operator_namespace, state.operator_sa = find_operator(
        labelled or [], operator_namespace, operator_sa
    )
    _review_access(r, state, namespace)
    return state
