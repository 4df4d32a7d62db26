"""operator/k8s.py's `create` against the local API server: a new object is POSTed; one of the same owner
that exists already (a run interrupted half-way) is server-side applied, except a JobSet, which is taken
as it is: its spec.suspend may be Kueue's, and a forced apply of the render's `suspend: false` would start
a queued run behind Kueue's back. One with another controller owner, or none, is never touched."""

from __future__ import annotations

import asyncio
import copy
import os
from typing import Any

import pytest
from fixtures.cluster import Cluster
from fixtures.recipes import MINIMAL, resolve
from rljob.operator import handlers, k8s
from rljob.operator.reconcile import owned
from rljob.recipes import render

# The RLJob the objects belong to (as the reconcile's `owned` marks them); the API server does not check
# that an owner reference names an existing object.
OWNER = {"metadata": {"name": "t", "namespace": "", "uid": "5b1d2c3e-0000-4000-8000-000000000001"}}

pytestmark = pytest.mark.cluster


def _create_all(cluster: Cluster, objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        kube = k8s.Kube(handlers.login)
        try:
            return [await kube.create(o) for o in objs]
        finally:
            await kube.close()

    saved = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    try:
        return asyncio.run(go())
    finally:
        if saved is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = saved


def test_create_applies_an_existing_object_but_takes_an_existing_jobset_as_it_is(
    cluster: Cluster, namespace: str
) -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["metadata"]["namespace"] = namespace
    run = resolve(doc)
    owner = {"metadata": {**OWNER["metadata"], "namespace": namespace}}
    jobset = owned(render.jobset(run), owner)
    configmap = owned(render.configmap(run), owner)
    held = copy.deepcopy(jobset)
    held["spec"]["suspend"] = True  # as Kueue holds a queued JobSet
    cluster.custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", held)
    stale = copy.deepcopy(configmap)
    stale["data"] = {"run.json": "{}"}
    cluster.core.create_namespaced_config_map(namespace, stale)

    assert jobset["spec"]["suspend"] is False
    got_js, got_cm = _create_all(cluster, [jobset, configmap])

    assert got_js["spec"]["suspend"] is True
    on_server = cluster.custom.get_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", jobset["metadata"]["name"]
    )
    assert on_server["spec"]["suspend"] is True
    assert got_cm["data"] == configmap["data"]  # applied: the stale copy is brought up to date
    cm = cluster.core.read_namespaced_config_map(configmap["metadata"]["name"], namespace)
    assert cm.data == configmap["data"]


@pytest.mark.parametrize(
    "other_owner", [None, "5b1d2c3e-0000-4000-8000-00000000ffff"], ids=["none", "another"]
)
def test_create_never_touches_an_object_it_does_not_own(
    cluster: Cluster, namespace: str, other_owner: str | None
) -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["metadata"]["namespace"] = namespace
    run = resolve(doc)
    owner = {"metadata": {**OWNER["metadata"], "namespace": namespace}}
    foreign = copy.deepcopy(render.configmap(run))
    foreign["data"] = {"run.json": "{}"}
    if other_owner is not None:
        foreign = owned(foreign, {"metadata": {**owner["metadata"], "uid": other_owner}})
    cluster.core.create_namespaced_config_map(namespace, foreign)
    with pytest.raises(k8s.NotOwned) as err:
        _create_all(cluster, [owned(render.configmap(run), owner)])
    assert err.value.owner == (other_owner or "")
    cm = cluster.core.read_namespaced_config_map(foreign["metadata"]["name"], namespace)
    assert cm.data == {"run.json": "{}"}  # untouched
