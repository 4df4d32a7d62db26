"""docs/gke.md is executable knowledge: every RLJob manifest in it renders with `rljob render`, the node
pools its gcloud commands create are the ones those manifests need (checked by `rljob doctor`'s own
node-pool check), its Kueue objects match the manifest's queue, and its install URLs carry the pinned
versions (hack/versions.env)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from rljob.cli import doctor_checks
from rljob.recipes import tpu as tpu_catalog

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "gke.md"
TEXT = DOC.read_text()
RLJOB = Path(sys.executable).parent / "rljob"

BLOCKS: list[tuple[str, str]] = re.findall(r"^```(\w*)\n(.*?)^```", TEXT, re.M | re.S)
YAML_DOCS = [d for lang, body in BLOCKS if lang == "yaml" for d in yaml.safe_load_all(body) if d]
MANIFESTS = [d for d in YAML_DOCS if d.get("kind") == "RLJob"]
SHELL = "\n".join(body for lang, body in BLOCKS if lang == "sh")


def test_doc_has_v5p_and_tpu7x_manifests() -> None:
    shapes = {str(m["spec"].get("recipe", "")) + str(m["spec"]["sampler"].get("tpu")) for m in MANIFESTS}
    assert len(MANIFESTS) >= 2
    assert any("v5p" in s for s in shapes) and any("tpu7x" in s for s in shapes)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=[m["metadata"]["name"] for m in MANIFESTS])
def test_manifest_renders(manifest: dict[str, Any]) -> None:
    proc = subprocess.run(
        [str(RLJOB), "render", "-f", "-"],
        input=yaml.safe_dump(manifest),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(proc.stdout) if d]
    assert "JobSet" in kinds and "ConfigMap" in kinds


# ------------------------------------------------------------------------------ node pools of the doc


def _commands(shell: str) -> list[tuple[list[str], int]]:
    """Each command of the doc's shell blocks (continuations joined) with how often a `for` loop runs it."""
    joined = re.sub(r"\\\n\s*", " ", shell)
    out: list[tuple[list[str], int]] = []
    repeat = 1
    for line in joined.splitlines():
        line = line.strip()
        if m := re.match(r"for \w+ in ([^;]+); do$", line):
            repeat = len(m[1].split())
            continue
        if line == "done":
            repeat = 1
            continue
        if line and not line.startswith("#"):
            out.append((shlex.split(line, comments=True), repeat))
    return out


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def doc_nodes() -> list[dict[str, Any]]:
    """The nodes the doc's `gcloud container node-pools create` commands would make, as GKE labels them."""
    by_machine = {g.machine_type: g.accelerator for g in tpu_catalog.GENERATIONS.values()}
    policies: dict[str, str] = {}
    nodes: list[dict[str, Any]] = []
    for argv, repeat in _commands(SHELL):
        if argv[:5] == ["gcloud", "compute", "resource-policies", "create", "workload-policy"]:
            policies[argv[5]] = _flags(argv)["accelerator-topology"]
        if argv[:4] != ["gcloud", "container", "node-pools", "create"]:
            continue
        flags = _flags(argv)
        topology = flags.get("tpu-topology") or policies[flags["placement-policy"]]
        extra = (
            {"cloud.google.com/placement-policy-name": flags["placement-policy"]}
            if "placement-policy" in flags
            else {}
        )
        for i in range(repeat):
            pool = argv[4].replace("$i", str(i))
            for n in range(int(flags["num-nodes"])):
                nodes.append(
                    {
                        "metadata": {
                            "name": f"{pool}-{n}",
                            "labels": {
                                "cloud.google.com/gke-nodepool": pool,
                                "cloud.google.com/gke-tpu-accelerator": by_machine[flags["machine-type"]],
                                "cloud.google.com/gke-tpu-topology": topology,
                                **extra,
                            },
                        },
                        "status": {
                            "allocatable": {"google.com/tpu": "4"},
                            "conditions": [{"type": "Ready", "status": "True"}],
                        },
                    }
                )
    return nodes


def test_doc_node_pool_commands_are_well_formed() -> None:
    nodes = doc_nodes()
    pools = doctor_checks.tpu_pools(nodes)
    assert len(pools) >= 4
    for pool in pools.values():
        prefix = "v5p" if pool.accelerator == "tpu-v5p-slice" else "tpu7x"
        plan = tpu_catalog.plan(f"{prefix}-{pool.topology}")
        assert pool.nodes == plan.hosts, f"{pool.name}: {pool.nodes} nodes for {plan.type_name}"
        assert pool.name.startswith(plan.type_name), pool.name


@pytest.mark.parametrize("manifest", MANIFESTS, ids=[m["metadata"]["name"] for m in MANIFESTS])
def test_doc_pools_are_what_the_manifest_needs(manifest: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    needs = doctor_checks.needs_from_manifest(path)
    findings = doctor_checks.check_node_pools(doc_nodes(), needs)
    assert findings and all(f.status is doctor_checks.Status.OK for f in findings), doctor_checks.render_text(
        findings
    )


def test_multi_host_tpu7x_pools_use_a_workload_policy() -> None:
    for argv, _ in _commands(SHELL):
        if argv[:4] == ["gcloud", "container", "node-pools", "create"]:
            flags = _flags(argv)
            if flags["machine-type"].startswith("tpu7x") and int(flags["num-nodes"]) > 1:
                assert "placement-policy" in flags and "tpu-topology" not in flags, argv


# ------------------------------------------------------------------------------------ Kueue, versions


def test_kueue_objects_serve_the_queued_manifest() -> None:
    queued = [m for m in MANIFESTS if m["spec"].get("queueName")]
    assert queued
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in YAML_DOCS:
        by_kind.setdefault(d["kind"], []).append(d)
    flavors = {
        (f["spec"]["nodeLabels"]["cloud.google.com/gke-tpu-accelerator"],
         f["spec"]["nodeLabels"]["cloud.google.com/gke-tpu-topology"])
        for f in by_kind["ResourceFlavor"]
    }  # fmt: skip
    [cq] = by_kind["ClusterQueue"]
    for m in queued:
        [lq] = [q for q in by_kind["LocalQueue"] if q["metadata"]["name"] == m["spec"]["queueName"]]
        assert lq["metadata"]["namespace"] == m["metadata"]["namespace"]
        assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
        for role in ("trainer", "sampler"):
            gen, topology = tpu_catalog.parse(m["spec"][role]["tpu"])
            assert (gen.accelerator, topology) in flavors, (role, topology)


def test_install_urls_use_the_pinned_versions() -> None:
    pins = dict(
        line.split("=", 1)
        for line in (REPO / "hack" / "versions.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    urls = re.findall(
        r"https://github\.com/kubernetes-sigs/(jobset|kueue)/releases/download/(v[\d.]+)/", TEXT
    )
    assert {name for name, _ in urls} == {"jobset", "kueue"}
    for name, version in urls:
        assert version == pins[f"{name.upper()}_VERSION"], name
    assert f"JobSet {pins['JOBSET_VERSION']}" in TEXT and f"Kueue {pins['KUEUE_VERSION']}" in TEXT
