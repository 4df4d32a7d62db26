"""operator/k8s.py's `create` against the local API server: a new object is POSTed; one of the same owner
that exists already (a run interrupted half-way) is server-side applied, except a JobSet, which is taken
as it is: its spec.suspend may be Kueue's, and a forced apply of the render's `suspend: false` would start
a queued run behind Kueue's back; and the run's credentials Secret, whose token the run's pods may hold
already. One with another controller owner, or none, is never touched."""

from __future__ import annotations

import asyncio
import copy
import os
from typing import Any

import pytest
from fixtures.cluster import Cluster
from fixtures.k8s import as_dict, meta
from fixtures.recipes import MINIMAL, resolve
from kubernetes import client
from rljob.operator import handlers, k8s
from rljob.recipes import render


def _owner(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    """A controller owner reference to a real object (a ConfigMap standing in for the RLJob: the garbage
    collector deletes what an owner reference to a missing object holds)."""
    cm = cluster.core.create_namespaced_config_map(namespace, client.V1ConfigMap(metadata={"name": name}))
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": name,
        "uid": meta(cm).uid,
        "controller": True,
    }


def _owned(obj: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["ownerReferences"] = [ref]
    return out


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
    owner = _owner(cluster, namespace, "owner")
    jobset = _owned(render.jobset(run), owner)
    configmap = _owned(render.configmap(run), owner)
    held = copy.deepcopy(jobset)
    held["spec"]["suspend"] = True  # as Kueue holds a queued JobSet
    cluster.custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", held)
    stale = copy.deepcopy(configmap)
    stale["data"] = {"run.json": "{}"}
    cluster.core.create_namespaced_config_map(namespace, stale)  # type: ignore[arg-type]  # a dict body, sent as is

    assert jobset["spec"]["suspend"] is False
    got_js, got_cm = _create_all(cluster, [jobset, configmap])

    assert got_js["spec"]["suspend"] is True
    on_server = as_dict(
        cluster.custom.get_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", jobset["metadata"]["name"]
        )
    )
    assert on_server["spec"]["suspend"] is True
    assert got_cm["data"] == configmap["data"]  # applied: the stale copy is brought up to date
    cm = cluster.core.read_namespaced_config_map(configmap["metadata"]["name"], namespace)
    assert cm.data == configmap["data"]


@pytest.mark.parametrize("other_owner", [False, True], ids=["none", "another"])
def test_create_never_touches_an_object_it_does_not_own(
    cluster: Cluster, namespace: str, other_owner: bool
) -> None:
    doc = copy.deepcopy(MINIMAL)
    doc["metadata"]["namespace"] = namespace
    run = resolve(doc)
    owner = _owner(cluster, namespace, "owner")
    foreign = copy.deepcopy(render.configmap(run))
    foreign["data"] = {"run.json": "{}"}
    other = None
    if other_owner:
        other = _owner(cluster, namespace, "another-owner")
        foreign = _owned(foreign, other)
    cluster.core.create_namespaced_config_map(namespace, foreign)  # type: ignore[arg-type]  # a dict body, sent as is
    with pytest.raises(k8s.NotOwned) as err:
        _create_all(cluster, [_owned(render.configmap(run), owner)])
    assert err.value.owner == (other["uid"] if other else "")
    cm = cluster.core.read_namespaced_config_map(foreign["metadata"]["name"], namespace)
    assert cm.data == {"run.json": "{}"}  # untouched


def test_create_keeps_an_existing_credentials_secret_and_its_token(cluster: Cluster, namespace: str) -> None:
    import base64

    from rljob.operator.reconcile import credentials_secret

    body = {"metadata": {"name": "cred", "namespace": namespace, "uid": "unused"}}
    owner = _owner(cluster, namespace, "owner")
    first, second = (_owned(credentials_secret(body), owner) for _ in range(2))
    assert first["data"] != second["data"]  # a new token each time one is built
    created, again = _create_all(cluster, [first, second])
    assert created["data"] == again["data"] == first["data"]
    stored = cluster.core.read_namespaced_secret("cred-credentials", namespace)
    assert stored.data == first["data"] and stored.immutable is True
    assert len(base64.b64decode(first["data"]["token"])) >= 43
