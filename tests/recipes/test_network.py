"""The run's NetworkPolicies (rljob.recipes.network) select the right pods and admit the right peers.

The local cluster (kwok, no network plugin) enforces no NetworkPolicy, so these tests check the objects:
which pods each policy's selector selects (Kubernetes' label-selector rules, implemented below and tested
on their own), whom its ingress rules admit, and on which ports. The API server admits them: the cluster
tests create every rendered object through the operator, whose chart RBAC includes networkpolicies.
"""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.recipes import catalog_cases, manifest, objects
from rljob.recipes import naming, plan, render
from rljob.recipes.api import RLJob

SERVICE = {"service": {"api": "tinker", "apiKeySecret": "tinker-keys"}}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes' LabelSelector semantics (matchLabels AND matchExpressions; an empty selector selects
    everything)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


@pytest.mark.parametrize(
    ("selector", "labels", "want"),
    [
        ({}, {}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
        ({"matchLabels": {"a": "1"}}, {}, False),
        ({"matchExpressions": [{"key": "n", "operator": "In", "values": ["x", "y"]}]}, {"n": "y"}, True),
        ({"matchExpressions": [{"key": "n", "operator": "In", "values": ["x"]}]}, {"n": "y"}, False),
        ({"matchExpressions": [{"key": "n", "operator": "In", "values": ["x"]}]}, {}, False),
    ],
)
def test_selector_semantics(selector: dict[str, Any], labels: dict[str, str], want: bool) -> None:
    assert selects(selector, labels) is want


def pod_labels(js: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Each replicated job's pod template labels, plus the labels the JobSet controller adds that the
    policies could select on (none of them: the policies use rljob's own labels only)."""
    return {
        rj["name"]: rj["template"]["spec"]["template"]["metadata"]["labels"]
        for rj in js["spec"]["replicatedJobs"]
    }


def policies(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == "NetworkPolicy"}


@pytest.mark.parametrize(("name", "doc"), catalog_cases(), ids=[n for n, _ in catalog_cases()])
def test_every_pod_of_a_run_admits_only_the_runs_own_pods(name: str, doc: dict[str, Any]) -> None:
    objs = objects(doc)
    js = objs[-1]
    run = js["metadata"]["name"]
    pods = pol = policies(objs)[naming.network_policy(run)]
    spec = pol["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    labels = pod_labels(js)
    assert set(labels) == {naming.TRAINER, naming.SAMPLER}
    for role, lab in labels.items():
        assert selects(spec["podSelector"], lab), f"{name}: the policy does not cover the {role} pods"
        # Every peer of the run is admitted (trainer <-> samplers, Ray workers, the coordinator)...
        (rule,) = spec["ingress"]
        assert "ports" not in rule  # ... on every port of the run
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}  # same namespace only: no namespaceSelector
        assert all(selects(peer["podSelector"], other) for other in labels.values())
        # ... and a pod of another run, or any other pod of the namespace, is not.
        assert not selects(peer["podSelector"], {**lab, "rljob.dev/rljob": run + "-other"})
        assert not selects(peer["podSelector"], {"app": "anything"})
    assert pods["metadata"]["namespace"] == js["metadata"]["namespace"]


def test_the_api_port_admits_the_runs_namespace_and_the_listed_ones_only() -> None:
    doc = manifest({"service": {**SERVICE["service"], "clientNamespaces": ["notebooks", "ns"]}})
    objs = render.objects(plan.resolve(RLJob.model_validate(doc)))
    js = objs[-1]
    api = policies(objs)[naming.api_network_policy("t")]["spec"]
    labels = pod_labels(js)
    assert selects(api["podSelector"], labels[naming.TRAINER])
    assert not selects(api["podSelector"], labels[naming.SAMPLER])
    (rule,) = api["ingress"]
    assert rule["ports"] == [{"port": render.API_PORT_NAME, "protocol": "TCP"}]
    # The named port is the trainer container's API port.
    trainer = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert render.API_PORT_NAME in [p["name"] for p in trainer["ports"]]
    (peer,) = rule["from"]
    ns = peer["namespaceSelector"]
    assert selects(ns, {"kubernetes.io/metadata.name": "ns"})
    assert selects(ns, {"kubernetes.io/metadata.name": "notebooks"})
    assert not selects(ns, {"kubernetes.io/metadata.name": "other"})
    assert "podSelector" not in peer  # any pod of those namespaces


def test_without_client_namespaces_only_the_runs_namespace_reaches_the_api() -> None:
    objs = render.objects(plan.resolve(RLJob.model_validate(manifest(SERVICE))))
    api = policies(objs)[naming.api_network_policy("t")]["spec"]
    (expr,) = api["ingress"][0]["from"][0]["namespaceSelector"]["matchExpressions"]
    assert expr == {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ns"]}


def test_the_rl_loop_has_no_api_policy() -> None:
    objs = objects(manifest({}))
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "NetworkPolicy"] == ["t-pods"]


@pytest.mark.parametrize("bad", ["Team", "a_b", "-a", "x" * 64])
def test_client_namespaces_must_be_namespace_names(bad: str) -> None:
    doc = manifest({"service": {**SERVICE["service"], "clientNamespaces": [bad]}})
    with pytest.raises(ValueError, match="clientNamespaces"):
        plan.resolve(RLJob.model_validate(doc))


def egress_admits(spec: dict[str, Any], address: str, port: int) -> bool:
    """Whether a NetworkPolicy's egress rules admit a connection to an address outside the cluster
    (ipBlock: the CIDR less its excepts; a rule without ports admits every port)."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    for rule in spec["egress"]:
        ports = rule.get("ports")
        if ports is not None and not any(p["port"] == port and p["protocol"] == "TCP" for p in ports):
            continue
        for peer in rule["to"]:
            block = peer.get("ipBlock")
            if block is None or ip.version != ipaddress.ip_network(block["cidr"]).version:
                continue
            if ip in ipaddress.ip_network(block["cidr"]) and not any(
                ip in ipaddress.ip_network(e) for e in block.get("except", [])
            ):
                return True
    return False


@pytest.mark.parametrize(
    ("address", "port", "admitted"),
    [
        # Workload Identity's path (GKE's network-policy page): kept.
        ("169.254.169.254", 80, True),  # Dataplane V2 checks the address the pod dials
        ("169.254.169.252", 988, True),  # the GKE metadata server, after the node's redirect
        # Anything else of the metadata server: closed.
        ("169.254.169.254", 8080, False),
        ("169.254.169.254", 443, False),
        ("169.254.169.252", 80, False),
        ("169.254.169.252", 987, False),
        ("fd20:ce::254", 80, False),
        # The rest of the world stays open: GCS, the API server, DNS, other slices.
        ("142.250.64.123", 443, True),
        ("172.16.0.2", 443, True),
        ("169.254.20.10", 53, True),  # NodeLocal DNSCache
        ("169.254.169.253", 80, True),
        ("2607:f8b0:4004:c07::80", 443, True),
    ],
)
def test_egress_closes_the_metadata_server_but_workload_identitys_path(
    address: str, port: int, admitted: bool
) -> None:
    objs = objects(manifest())
    run = objs[-1]["metadata"]["name"]
    spec = policies(objs)[naming.network_policy(run)]["spec"]
    assert egress_admits(spec, address, port) is admitted


def test_egress_admits_every_pod_of_the_cluster() -> None:
    """Cilium (GKE Dataplane V2) matches no pod with an ipBlock: pods are admitted by a selector of their
    own, every namespace's (the run's peers, cluster DNS)."""
    objs = objects(manifest())
    run = objs[-1]["metadata"]["name"]
    spec = policies(objs)[naming.network_policy(run)]["spec"]
    pod_rules = [r for r in spec["egress"] if any("namespaceSelector" in p for p in r["to"])]
    assert pod_rules == [{"to": [{"namespaceSelector": {}}]}]
