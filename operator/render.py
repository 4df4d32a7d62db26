"""Desired objects of an RLJob: exactly `rljob render`'s objects, plus the trainer's progress RBAC.

`rljob.recipes.render.render` gives the run ConfigMap and the JobSet (what `rljob render` prints). The
JobSet's pods run as ServiceAccount `<rljob>-rljob` (rljob.recipes.naming.service_account); the
operator creates it with a Role and RoleBinding that let those pods `get` and `patch` the one
ConfigMap `<rljob>-progress` (resourceNames), which is how the trainer reports progress (contract 4):
the trainer patches key `progress.json`; the operator watches the ConfigMap and copies the report into
`status.progress`. Nothing else is granted to the pods.
"""

from __future__ import annotations

from typing import Any

from rljob.recipes import naming
from rljob.recipes import render as recipe_render
from rljob.recipes.api import RLJob

PROGRESS_VERBS = ["get", "patch"]


def trainer_rbac(job: RLJob) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding of the run's pods (progress ConfigMap only)."""
    name = job.metadata.name
    sa = naming.service_account(name)
    role = f"{name}-progress"
    meta: dict[str, Any] = {"namespace": job.metadata.namespace}
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": sa, **meta},
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": role, **meta},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": [naming.progress_configmap(name)],
                    "verbs": PROGRESS_VERBS,
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": role, **meta},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": job.metadata.namespace}],
        },
    ]


def render(job: RLJob) -> list[dict[str, Any]]:
    """In apply order: the pods' RBAC, the run ConfigMap, the JobSet. Raises PlanError (a ValueError)."""
    objects = recipe_render.render(job)
    return [*trainer_rbac(job), *objects]
