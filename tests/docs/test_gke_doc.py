"""docs/gke.md is executable knowledge, kept true by this file:

- every RLJob manifest in it passes `rljob validate` and renders (`rljob render`), its pods on the pod
  network as the job's ServiceAccount, the one the doc's Workload Identity grant names; its Kueue
  objects serve the queued manifest, and are accepted by Kueue's own API (a `cluster` test);
- the node pools its gcloud commands create are the ones those manifests need (checked by
  `rljob doctor`'s own node-pool check), single-host pools without `--tpu-topology`, multi-host v5p with
  it and compact placement, multi-host tpu7x with a workload policy;
- every gcloud command (in code blocks and inline) uses only the flags of GCLOUD below, each with its
  public reference page, the flags it cannot do without (REQUIRED) and the values rljob relies on
  (VALUE_RULES);
- every version, image, package, extra, machine type and Debian package it names is the repo's
  (hack/versions.env, pyproject.toml, the Dockerfile, the Helm chart, the TPU catalog);
- the checkpoint-conversion command resolves MaxText's config from any directory (marker `jax`).
Each check is a function from the doc's text to a list of problems, so the deliberately broken copies
of the doc at the end prove each check catches what it is for.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from rljob.cli.doctor.findings import Status, render_text
from rljob.cli.doctor.needs import needs_from_manifest
from rljob.cli.doctor.nodepools import check_node_pools, create_pool_command, tpu_pools
from rljob.recipes import naming
from rljob.recipes import tpu as tpu_catalog

REPO = Path(__file__).resolve().parents[2]
# Every TPU machine type of the catalog: its generation and the chips of one host.
MACHINES = {
    machine: (gen, chips) for gen in tpu_catalog.GENERATIONS.values() for chips, machine in gen.machine_types
}
DOC = REPO / "docs" / "gke.md"
TEXT = DOC.read_text()
RLJOB = Path(sys.executable).parent / "rljob"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION: str = PYPROJECT["project"]["version"]
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
PINS = dict(
    line.split("=", 1)
    for line in (REPO / "hack" / "versions.env").read_text().splitlines()
    if "=" in line and not line.startswith("#")
)


def blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def yaml_docs(text: str) -> list[dict[str, Any]]:
    return [d for lang, body in blocks(text) if lang == "yaml" for d in yaml.safe_load_all(body) if d]


def manifests(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml_docs(text) if d.get("kind") == "RLJob"]


def shell(text: str) -> str:
    return "\n".join(body for lang, body in blocks(text) if lang == "sh")


MANIFESTS = manifests(TEXT)
SHELL = shell(TEXT)


def test_doc_has_v5p_and_tpu7x_manifests() -> None:
    shapes = {str(m["spec"].get("recipe", "")) + str(m["spec"]["sampler"].get("tpu")) for m in MANIFESTS}
    assert len(MANIFESTS) >= 2
    assert any("v5p" in s for s in shapes) and any("tpu7x" in s for s in shapes)


def _rljob(verb: str, manifest: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(RLJOB), verb, "-f", "-"],
        input=yaml.safe_dump(manifest),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("manifest", MANIFESTS, ids=[m["metadata"]["name"] for m in MANIFESTS])
def test_manifest_validates_and_renders_on_the_pod_network(manifest: dict[str, Any]) -> None:
    valid = _rljob("validate", manifest)
    assert valid.returncode == 0 and ": valid: JobSet " in valid.stdout, valid.stderr
    proc = _rljob("render", manifest)
    assert proc.returncode == 0, proc.stderr
    by_kind = {d["kind"]: d for d in yaml.safe_load_all(proc.stdout) if d}
    assert {"ServiceAccount", "ConfigMap", "JobSet"} <= set(by_kind)
    sa = naming.service_account(manifest["metadata"]["name"])
    assert by_kind["ServiceAccount"]["metadata"]["name"] == sa
    for rj in by_kind["JobSet"]["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        # Workload Identity: the pod runs as the job's ServiceAccount, not on the host network.
        assert pod["serviceAccountName"] == sa and "hostNetwork" not in pod, rj["name"]


# ------------------------------------------------------------------------------ node pools of the doc


def _commands(shell_text: str) -> list[tuple[list[str], int]]:
    """Each command of the doc's shell blocks (continuations joined) with how often a `for` loop runs it."""
    joined = re.sub(r"\\\n\s*", " ", shell_text)
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
    """--name=value flags as {name: value}; a bare --name as {name: ""}."""
    out: dict[str, str] = {}
    for a in argv:
        if a.startswith("--"):
            name, _, value = a[2:].partition("=")
            out[name] = value
    return out


def doc_nodes(text: str = TEXT) -> list[dict[str, Any]]:
    """The nodes the doc's `gcloud container node-pools create` commands would make, as GKE labels them.

    A single-host pool names no topology: GKE labels its node with the machine type's whole slice
    (2x2x1 for a 4-chip v5p host, 2x4 for an 8-chip v5e one)."""
    policies: dict[str, str] = {}
    nodes: list[dict[str, Any]] = []
    for argv, repeat in _commands(shell(text)):
        if argv[:5] == ["gcloud", "compute", "resource-policies", "create", "workload-policy"]:
            policies[argv[5]] = _flags(argv)["accelerator-topology"]
        if argv[:4] != ["gcloud", "container", "node-pools", "create"]:
            continue
        flags = _flags(argv)
        gen, chips = MACHINES[flags["machine-type"]]
        single_host = tpu_catalog.topology_for_chips(gen.prefix, chips)
        topology = flags.get("tpu-topology") or policies.get(flags.get("placement-policy", "")) or single_host
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
                                "cloud.google.com/gke-tpu-accelerator": gen.accelerator,
                                "cloud.google.com/gke-tpu-topology": topology,
                                **extra,
                            },
                        },
                        "status": {
                            "allocatable": {"google.com/tpu": str(chips)},
                            "conditions": [{"type": "Ready", "status": "True"}],
                        },
                    }
                )
    return nodes


def test_doc_node_pool_commands_are_well_formed() -> None:
    pools = tpu_pools(doc_nodes())
    assert len(pools) >= 4
    for pool in pools.values():
        prefix = tpu_catalog.BY_ACCELERATOR[pool.accelerator].prefix
        plan = tpu_catalog.plan(f"{prefix}-{pool.topology}")
        assert pool.nodes == plan.hosts, f"{pool.name}: {pool.nodes} nodes for {plan.type_name}"
        assert pool.name.startswith(plan.type_name), pool.name


@pytest.mark.parametrize("manifest", MANIFESTS, ids=[m["metadata"]["name"] for m in MANIFESTS])
def test_doc_pools_are_what_the_manifest_needs(manifest: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    needs = needs_from_manifest(path)
    findings = check_node_pools(doc_nodes(), needs)
    assert findings and all(f.status is Status.OK for f in findings), render_text(findings)


XPK_NODEPOOL = "https://github.com/AI-Hypercomputer/xpk/blob/main/src/xpk/core/nodepool.py"
IRONWOOD = "https://cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood"


def pool_problems(text: str) -> list[str]:
    """How each TPU node pool is created, by shape (sources: xpk's node pools, GKE's Ironwood page)."""
    out = []
    for argv, _ in _commands(shell(text)):
        if argv[:4] != ["gcloud", "container", "node-pools", "create"]:
            continue
        flags, pool = _flags(argv), argv[4]
        if flags.get("machine-type", "") not in MACHINES:
            continue  # the machine type itself is checked by the flag table
        gen, _ = MACHINES[flags["machine-type"]]
        has = {k for k in ("tpu-topology", "placement-type", "placement-policy") if k in flags}
        if flags.get("num-nodes") == "1":
            if has:  # xpk: "--tpu-topology should not be set for single-host node pools"
                out.append(f"{pool}: a single-host pool takes no {', '.join(sorted(has))} ({XPK_NODEPOOL})")
        elif gen.workload_policy:
            if has != {"placement-policy"}:
                out.append(
                    f"{pool}: a multi-host {gen.prefix} pool takes --placement-policy alone ({IRONWOOD})"
                )
        elif has != {"tpu-topology", "placement-type"} or flags["placement-type"] != "COMPACT":
            out.append(
                f"{pool}: a multi-host {gen.prefix} pool takes --tpu-topology and --placement-type=COMPACT "
                f"({XPK_NODEPOOL})"
            )
    return out


# ------------------------------------------------------------------------------------ gcloud and flags

REF = "https://cloud.google.com/sdk/gcloud/reference/"
# Every gcloud command the doc runs, with the flags rljob relies on; each flag's source is the command's
# reference page (global flags: gcloud's).
GCLOUD: dict[tuple[str, ...], tuple[str, set[str]]] = {
    ("auth", "application-default", "login"): (REF + "auth/application-default/login", set()),
    ("auth", "configure-docker"): (REF + "auth/configure-docker", set()),
    ("config", "set"): (REF + "config/set", set()),
    ("projects", "describe"): (REF + "projects/describe", {"format"}),
    ("services", "enable"): (REF + "services/enable", set()),
    ("compute", "tpus", "accelerator-types", "list"): (REF + "compute/tpus/accelerator-types/list", {"zone"}),
    ("compute", "resource-policies", "create", "workload-policy"): (
        REF + "compute/resource-policies/create/workload-policy",
        {"type", "accelerator-topology", "region"},
    ),
    ("container", "clusters", "create"): (
        REF + "container/clusters/create",
        {
            "location",
            "node-locations",
            "release-channel",
            "workload-pool",
            "enable-dataplane-v2",
            "machine-type",
            "num-nodes",
            "cluster-version",
        },
    ),
    ("container", "clusters", "get-credentials"): (REF + "container/clusters/get-credentials", {"location"}),
    ("container", "clusters", "update"): (
        REF + "container/clusters/update",
        {
            "location",
            "add-maintenance-exclusion-name",
            "add-maintenance-exclusion-start",
            "add-maintenance-exclusion-end",
            "add-maintenance-exclusion-scope",
        },
    ),
    ("container", "clusters", "delete"): (REF + "container/clusters/delete", {"location"}),
    ("container", "node-pools", "create"): (
        REF + "container/node-pools/create",
        {
            "cluster",
            "location",
            "node-locations",
            "machine-type",
            "num-nodes",
            "tpu-topology",
            "placement-type",
            "placement-policy",
            "spot",
            "reservation-affinity",
            "reservation",
            "disk-size",
            "ephemeral-storage-local-ssd",
        },
    ),
    ("storage", "buckets", "create"): (
        REF + "storage/buckets/create",
        {"location", "uniform-bucket-level-access"},
    ),
    ("storage", "buckets", "add-iam-policy-binding"): (
        REF + "storage/buckets/add-iam-policy-binding",
        {"role", "member"},
    ),
    ("storage", "cp"): (REF + "storage/cp", set()),
    ("storage", "rm"): (REF + "storage/rm", {"recursive"}),
    ("artifacts", "repositories", "create"): (
        REF + "artifacts/repositories/create",
        {"repository-format", "location"},
    ),
}
SHORT_FLAGS = {"-r": "recursive"}
TPU_MACHINES = set(MACHINES)


@dataclass(frozen=True)
class ValueRule:
    command: tuple[str, ...]
    flag: str
    ok: Callable[[str], bool]
    why: str  # what rljob relies on, with the source


def _tpu_topology(value: str) -> bool:
    return any(value in tpu_catalog.topologies(p) for p in tpu_catalog.GENERATIONS)


VALUE_RULES = [
    ValueRule(("container", "node-pools", "create"), "machine-type",
              lambda v: v in TPU_MACHINES or not v.startswith(("ct", "tpu")),
              "a TPU machine type of rljob's catalog (recipes/generations.py)"),
    ValueRule(("container", "node-pools", "create"), "tpu-topology", _tpu_topology,
              "a topology of rljob's catalog"),
    ValueRule(("container", "node-pools", "create"), "placement-type", lambda v: v == "COMPACT",
              "COMPACT, as xpk places multi-host pools (" + XPK_NODEPOOL + ")"),
    ValueRule(("container", "node-pools", "create"), "placement-policy",
              lambda v: re.fullmatch(r"tpu7x-\d+-\d+x\d+x\d+-placement-policy", v) is not None,
              "tpu7x-<N>-<topology>-placement-policy, the name the pods select (recipes/tpu.py)"),
    ValueRule(("compute", "resource-policies", "create", "workload-policy"), "type",
              lambda v: v == "HIGH_THROUGHPUT", "HIGH_THROUGHPUT for TPU7x slices (" + IRONWOOD + ")"),
    ValueRule(("compute", "resource-policies", "create", "workload-policy"), "accelerator-topology",
              lambda v: v in tpu_catalog.topologies("tpu7x"), "a tpu7x topology of rljob's catalog"),
    ValueRule(("container", "clusters", "create"), "release-channel",
              lambda v: v in {"rapid", "regular", "stable", "extended"},
              "a GKE release channel (" + REF + "container/clusters/create)"),
    ValueRule(("container", "clusters", "create"), "workload-pool",
              lambda v: v == "$PROJECT_ID.svc.id.goog",
              "the project's Workload Identity pool, which the bucket grant names"),
    ValueRule(("container", "clusters", "update"), "add-maintenance-exclusion-scope",
              lambda v: v in {"no_upgrades", "no_minor_upgrades", "no_minor_or_node_upgrades"},
              "a maintenance exclusion scope (" + REF + "container/clusters/update)"),
    ValueRule(("storage", "buckets", "add-iam-policy-binding"), "role",
              lambda v: v == "roles/storage.objectUser",
              "objects read, written and listed: roles/storage.objectUser "
              "(https://cloud.google.com/storage/docs/access-control/iam-roles)"),
    ValueRule(("artifacts", "repositories", "create"), "repository-format", lambda v: v == "docker",
              "a Docker repository for the three images"),
]  # fmt: skip


WORKLOAD_IDENTITY = "https://cloud.google.com/kubernetes-engine/docs/how-to/workload-identity"
# Flags without which the command does not do what the doc relies on: a rule above only checks a flag's
# value when the flag is there.
REQUIRED: dict[tuple[str, ...], dict[str, str]] = {
    ("container", "clusters", "create"): {
        "workload-pool": "Workload Identity Federation for GKE, which the bucket grant relies on ("
        + WORKLOAD_IDENTITY
        + ")",
    },
    ("container", "node-pools", "create"): {
        "cluster": "the cluster of section 1",
        "machine-type": "the TPU machine type of the slice",
        "num-nodes": "the slice's host count",
        "node-locations": "the zone of the TPU quota (a regional cluster's pool would span its zones)",
    },
    ("compute", "resource-policies", "create", "workload-policy"): {
        "type": "HIGH_THROUGHPUT (" + IRONWOOD + ")",
        "accelerator-topology": "the slice's topology (" + IRONWOOD + ")",
    },
    ("storage", "buckets", "add-iam-policy-binding"): {
        "role": "the role granted",
        "member": "the job's ServiceAccounts",
    },
}


def _until_unbalanced(s: str) -> str:
    """The text of a `$(...)` command: up to the parenthesis that closes it, quotes respected."""
    depth, quote = 0, ""
    for i, ch in enumerate(s):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            if depth == 0:
                return s[:i]
            depth -= 1
    return s


def gcloud_invocations(text: str) -> list[list[str]]:
    """Every gcloud command of the doc: shell blocks (also inside `$(...)`) and inline code spans."""
    found = []
    for line in re.sub(r"\\\n\s*", " ", shell(text)).splitlines():
        line = line.strip()
        if line.startswith("gcloud "):
            found.append(line)
        found += [_until_unbalanced(rest) for rest in re.findall(r"\$\((gcloud .*)", line)]
    found += re.findall(r"`(gcloud [^`]+)`", text)
    return [shlex.split(c, comments=True) for c in found]


def _command_of(argv: list[str]) -> tuple[str, ...] | None:
    words = tuple(a for a in argv[1:] if not a.startswith("-"))
    matches = [c for c in GCLOUD if words[: len(c)] == c]
    return max(matches, key=len) if matches else None


def gcloud_problems(text: str) -> list[str]:
    out = []
    for argv in gcloud_invocations(text):
        command = _command_of(argv)
        if command is None:
            out.append(f"{' '.join(argv[:5])}: not a gcloud command of the table (add it with its source)")
            continue
        source, allowed = GCLOUD[command]
        flags = _flags(argv) | {SHORT_FLAGS[a]: "" for a in argv if a in SHORT_FLAGS}
        for flag in sorted(set(flags) - allowed):
            out.append(f"gcloud {' '.join(command)} --{flag}: not a flag rljob relies on ({source})")
        for flag, why in REQUIRED.get(command, {}).items():
            if flag not in flags:
                out.append(f"gcloud {' '.join(command)}: without --{flag}, {why}")
        for rule in VALUE_RULES:
            if rule.command == command and rule.flag in flags and not rule.ok(flags[rule.flag]):
                out.append(
                    f"gcloud {' '.join(command)} --{rule.flag}={flags[rule.flag]}: expected {rule.why}"
                )
    # Flags the prose of the cluster and node pool sections names alone (`--spot`) must be flags of some
    # command of the table.
    every = set().union(*(allowed for _, allowed in GCLOUD.values()))
    sections = re.search(r"^## 1\..*?(?=^## 3\.)", text, re.M | re.S)
    for span in re.findall(r"`(--[a-z-]+)(?:=[^`]*)?`", sections[0] if sections else ""):
        if span[2:] not in every:
            out.append(f"`{span}`: not a flag of any gcloud command of the table")
    return out


def test_gcloud_table_sources_are_public_reference_pages() -> None:
    for command, (source, _) in GCLOUD.items():
        assert source == REF + "/".join(command), command


def test_every_gcloud_command_uses_the_flags_rljob_relies_on() -> None:
    assert len(gcloud_invocations(TEXT)) >= 15
    assert gcloud_problems(TEXT) == []


def test_node_pools_are_created_as_their_shape_needs() -> None:
    assert pool_problems(TEXT) == []


@pytest.mark.parametrize(
    "tpu",
    [
        "tpu7x-2",
        "v5p-8",
        "tpu7x-8",
        "v5p-16",
        "v5p-128",
        "tpu7x-32",
        "tpu7x-512",
        "v5litepod-1",
        "v5litepod-4",
        "v5litepod-8",
        "v5litepod-16",
        "v5litepod-256",
        "v6e-8",
        "v6e-64",
    ],
)
def test_rljob_doctors_pool_commands_follow_the_same_rules(tpu: str) -> None:
    """The fix `rljob doctor` prints for a missing pool passes the doc's checks too."""
    plan = tpu_catalog.plan(tpu)
    cmd = create_pool_command(plan, f"{plan.type_name}-0")
    text = "```sh\n" + cmd.replace(" && ", "\n") + "\n```\n"
    assert pool_problems(text) == [] and gcloud_problems(text) == [], cmd


# --------------------------------------------------------------------------- Kueue, versions, images


def test_kueue_objects_serve_the_queued_manifest() -> None:
    queued = [m for m in MANIFESTS if m["spec"].get("queueName")]
    assert queued
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in yaml_docs(TEXT):
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


def _pin(extra: str, name: str) -> str:
    [req] = [r for r in map(Requirement, EXTRAS[extra]) if r.name == name]
    [version] = [s.version for s in req.specifier if s.operator == "=="]
    return version


def _dockerfile_users() -> dict[str, str]:
    users, stage = {}, ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if m := re.match(r"FROM \S+ AS (\S+)", line):
            stage = m[1]
        elif m := re.match(r"USER (\S+)", line):
            users[stage] = m[1].split(":")[0]
    return users


def _apt_packages() -> set[str]:
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    return {
        p
        for cmd in re.findall(r"apt-get install ([^&\n]*)", text)
        for p in cmd.split()
        if not p.startswith("-")
    }


def version_problems(text: str) -> list[str]:
    """Versions, images, packages and extras the doc names, against the repo's pins."""
    out = []
    for name, version in re.findall(
        r"https://github\.com/kubernetes-sigs/(jobset|kueue)/releases/download/(v[\d.]+)/", text
    ):
        if version != PINS[f"{name.upper()}_VERSION"]:
            out.append(f"{name} install URL at {version}, pinned {PINS[f'{name.upper()}_VERSION']}")
    for name in ("JobSet", "Kueue"):
        if f"{name} {PINS[f'{name.upper()}_VERSION']}" not in text:
            out.append(f"the doc does not name {name} {PINS[f'{name.upper()}_VERSION']}")
    k8s = ".".join(PINS["KUBERNETES_VERSION"].lstrip("v").split(".")[:2])
    for v in re.findall(r"Kubernetes (\d+\.\d+)", text):
        if v != k8s:
            out.append(f"Kubernetes {v}: the local control plane runs {k8s}")
    gke = {g.min_gke_version for g in tpu_catalog.GENERATIONS.values() if g.min_gke_version}
    for v in re.findall(r"\b\d+\.\d+\.\d+-gke\.\d+\b", text):
        if v not in gke:
            out.append(f"GKE {v}: not a minimum version of the TPU catalog ({sorted(gke)})")
    pins = {
        "maxtext": _pin("trainer", "maxtext"),
        "qwix": _pin("trainer", "qwix"),
        "google-tunix": _pin("trainer", "google-tunix"),
        "jax[tpu]": _pin("tpu", "jax"),
        "vllm-tpu": _pin("sampler-tpu", "vllm-tpu"),
        "tpu-inference": _pin("sampler-tpu", "vllm-tpu"),  # vllm-tpu pins tpu-inference at its own version
    }
    names = r"(maxtext|qwix|google-tunix|jax\[tpu\]|vllm-tpu|tpu-inference)"
    for name, version in re.findall(names + r"(?:==| )(\d[\w.]*\d)", text, re.I):
        name = name.lower()
        if version != pins[name]:
            out.append(f"{name} {version}: pyproject.toml pins {pins[name]}")
    targets = set(re.findall(r"^FROM \S+ AS (\w+)$", (REPO / "Dockerfile").read_text(), re.M))
    for image, tag in re.findall(r"/rljob-(\w+):([\w.$]+)", text):
        if image not in targets:
            out.append(f"image rljob-{image}: not a Dockerfile target")
        if tag not in (VERSION, "$VERSION"):
            out.append(f"image rljob-{image}:{tag}: the images are tagged with the package version {VERSION}")
    for loop in re.findall(r"for target in ([\w ]+); do", text):
        if set(loop.split()) != {"operator", "trainer", "sampler"}:
            out.append(f"image loop over {loop}: the Dockerfile's targets are operator, trainer, sampler")
    for extras in re.findall(r"rljob\[([\w,-]+)\]", text):
        for extra in extras.split(","):
            if extra not in EXTRAS:
                out.append(f"rljob[{extra}]: no such extra in pyproject.toml")
    for listed in re.findall(r"\(the (`[^)]*`) extras\)", text):
        for extra in re.findall(r"`([\w-]+)`", listed):
            if extra not in EXTRAS:
                out.append(f"`{extra}`: no such extra in pyproject.toml")
    for machine in re.findall(r"\b(ct\d\w*-\w+-\d+t|tpu\d\w*-standard-\d+t)\b", text):
        if machine not in TPU_MACHINES:
            out.append(f"machine type {machine}: not in the TPU catalog")
    for m in manifests(text):  # the samplers' TPU as vLLM's TPU backend lists it (the catalog)
        gen, _ = tpu_catalog.parse(m["spec"]["sampler"]["tpu"])
        if gen.vllm_tpu_support == "experimental" and f"lists {gen.prefix} as experimental" not in text:
            name = m["metadata"]["name"]
            out.append(f"{name}: the doc must say vLLM's TPU backend lists {gen.prefix} as experimental")
    apt = _apt_packages()
    named = set(re.findall(r"`(lib[\w-]+-dev|build-essential)`", text))
    if named != apt:
        out.append(f"Debian packages named {sorted(named)}, the Dockerfile installs {sorted(apt)}")
    users = _dockerfile_users()
    claims = {
        "trainer": "The trainer and sampler images run as root (uid 0)",
        "sampler": "The trainer and sampler images run as root (uid 0)",
        "operator": "the operator image runs as uid 1000",
    }
    for target, claim in claims.items():
        uid = "0" if "root" in claim else "1000"
        if claim not in text or users.get(target) != uid:
            out.append(f"{target}: the doc must say {claim!r}, and the Dockerfile's USER be {uid}")
    chart = yaml.safe_load((REPO / "charts" / "rljob" / "values.yaml").read_text())
    for release in re.findall(r"helm install (\S+) charts/rljob", text):
        for deployment in re.findall(r"deployment/(\S*rljob\S*)", text):
            if deployment != f"{release}-rljob-operator":
                out.append(f"deployment/{deployment}: the chart names it {release}-rljob-operator")
    for key in re.findall(r"--set ([\w.]+)=", text):
        node: Any = chart
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            out.append(f"--set {key}: not a value of charts/rljob/values.yaml")
    return out


def test_versions_images_and_packages_are_the_repos() -> None:
    assert version_problems(TEXT) == []


def test_the_post_train_extra_count_is_maxtexts() -> None:
    """The doc's count of what maxtext[tpu-post-train] adds to maxtext[tpu], from maxtext's metadata."""
    from importlib.metadata import requires

    def names(extra: str) -> set[str]:
        reqs = [Requirement(r) for r in requires("maxtext") or []]
        return {r.name for r in reqs if re.search(f"extra == ['\"]{extra}['\"]", str(r.marker))}

    added = names("tpu-post-train") - names("tpu")
    assert {"torch", "ray", "google-tunix"} <= added
    assert f"has {len(added)} requirements its `tpu` extra lacks" in " ".join(TEXT.split())


def identity_problems(text: str) -> list[str]:
    """The bucket grant names the manifests' namespace and, per job, the ServiceAccount rljob renders."""
    out = []
    namespaces = {m["metadata"]["namespace"] for m in manifests(text)}
    for ns in re.findall(r"principalSet://\S+/namespace/([\w-]+)", text):
        if ns not in namespaces:
            out.append(f"principalSet for namespace {ns}: the doc's RLJobs are in {sorted(namespaces)}")
    accounts = {
        (m["metadata"]["namespace"], naming.service_account(m["metadata"]["name"])) for m in manifests(text)
    }
    for ns, sa in re.findall(r"principal://\S+/subject/ns/([\w-]+)/sa/([\w-]+)", text):
        if (ns, sa) not in accounts:
            out.append(
                f"principal ns/{ns}/sa/{sa}: not the ServiceAccount of a doc RLJob ({sorted(accounts)})"
            )
    if "principalSet://" not in text:
        out.append("no Workload Identity grant of the bucket")
    return out


def test_workload_identity_grant_names_the_jobs_service_accounts() -> None:
    assert identity_problems(TEXT) == []


def test_the_cross_slice_gradient_figure_is_the_recipes() -> None:
    """43.6 M LoRA parameters (175 MB in float32) for the Qwen3-8B recipe: rank x (in + out) per target
    projection and layer, from the recipe and MaxText's model config."""
    from rljob.recipes import maxtext_keys
    from rljob.recipes.plan import parse_manifest, resolve

    [m] = [m for m in MANIFESTS if m["spec"].get("recipe") == "qwen3-8b-v5p"]
    run = resolve(parse_manifest(yaml.safe_dump(m)))
    assert run.trainer.dcn.data == run.trainer.slices > 1  # the default cross-slice mesh of the claim
    model = maxtext_keys.load(run.trainer.maxtext_version).models[run.spec.model.maxtext_model]
    d, f, hd = model["base_emb_dim"], model["base_mlp_dim"], model["head_dim"]
    q, kv = model["base_num_query_heads"] * hd, model["base_num_kv_heads"] * hd
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
              "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}  # fmt: skip
    lora = run.spec.lora
    assert lora and lora.targets and set(lora.targets) == set(shapes)
    params = model["base_num_decoder_layers"] * sum(lora.rank * sum(shapes[t]) for t in lora.targets)
    words = " ".join(TEXT.split())
    assert f"rank {lora.rank} on seven projections of {model['base_num_decoder_layers']} layers" in words
    assert f"that is {params / 1e6:.1f} M parameters, {params * 4 / 1e6:.0f} MB in float32" in words


# ---------------------------------------------------------------------- the checkpoint conversion


CONVERSION = ["python", "-m", "maxtext.checkpoint_conversion.to_maxtext"]


def conversion_commands(text: str) -> list[list[str]]:
    return [argv for argv, _ in _commands(shell(text)) if argv[:3] == CONVERSION]


def conversion_problems(text: str, cwd: Path) -> list[str]:
    """The command runs MaxText's installed script, and its config resolves from any directory."""
    import os

    from maxtext.configs import pyconfig
    from rljob.recipes import maxtext_keys

    keys = maxtext_keys.load(maxtext_keys.DEFAULT_VERSION)
    local = {"save_dtype", "hf_model_path", "lazy_load_tensors", "eager_load_method", "revision",
             "simulated_cpu_devices_count"}  # fmt: skip  # to_maxtext's own arguments
    out = []
    commands = conversion_commands(text)
    if not commands:
        return ["no checkpoint conversion command"]
    for argv in commands:
        spec = importlib.util.find_spec(argv[2])
        if spec is None or spec.origin is None:
            out.append(f"{argv[2]}: not a module of the installed maxtext")
            continue
        before = os.getcwd()
        os.chdir(cwd)  # not a MaxText checkout
        try:
            config, _ = pyconfig._resolve_or_infer_config([spec.origin, *argv[3:]])
        finally:
            os.chdir(before)
        if not Path(cwd, config).is_file():
            out.append(f"config {config}: not found outside a MaxText checkout")
        args = dict(a.split("=", 1) for a in argv[3:] if "=" in a and not a.startswith("-"))
        for key in sorted(set(args) - set(keys.defaults) - local):
            out.append(f"{key}: not a MaxText {keys.version} config key")
        out += _conversion_matches_a_manifest(text, args)
    return out


def _conversion_matches_a_manifest(text: str, args: dict[str, str]) -> list[str]:
    from rljob.recipes.plan import parse_manifest, resolve

    out = []
    bucket = "gs://$BUCKET"
    for m in manifests(text):
        checkpoint = m["spec"].get("model", {}).get("checkpoint", "")
        root = m["spec"]["storage"]["root"]
        if checkpoint.replace(root, bucket) != f"{args.get('base_output_directory')}/0/items":
            continue
        run = resolve(parse_manifest(yaml.safe_dump(m)))
        name, model = m["metadata"]["name"], run.spec.model.maxtext_model
        if args.get("model_name") != model:
            out.append(f"model_name={args.get('model_name')}: {name} runs {model}")
        scan = run.trainer.maxtext.get("scan_layers")
        if str(args.get("scan_layers")).lower() != str(scan).lower():
            out.append(f"scan_layers={args.get('scan_layers')}: {name} trains with {scan}")
        return out
    return [f"base_output_directory={args.get('base_output_directory')}: no doc RLJob loads its 0/items"]


@pytest.mark.jax
def test_checkpoint_conversion_runs_from_any_directory(tmp_path: Path) -> None:
    assert conversion_problems(TEXT, tmp_path) == []


# ------------------------------------------------------------ Kueue's API accepts the doc's objects


@pytest.mark.cluster
def test_kueue_objects_are_accepted_by_kueue(kueue: Any, namespace: str) -> None:
    """Created with dryRun=All and strict field validation: Kueue's CRD schemas and webhooks of the pinned
    version check them; a copy with a misspelt field is refused, so the check can fail."""
    from kubernetes.client.exceptions import ApiException

    plural = {
        "ResourceFlavor": "resourceflavors",
        "ClusterQueue": "clusterqueues",
        "LocalQueue": "localqueues",
    }
    docs = [d for d in yaml_docs(TEXT) if d["kind"] in plural]
    assert {d["kind"] for d in docs} == set(plural)
    c = kueue.cluster.custom

    def create(d: dict[str, Any]) -> None:
        group, version = d["apiVersion"].split("/")
        assert (group, version) == ("kueue.x-k8s.io", "v1beta2")
        opts = {"dry_run": "All", "field_validation": "Strict"}
        if d["kind"] == "LocalQueue":
            body = {**d, "metadata": {**d["metadata"], "namespace": namespace}}
            c.create_namespaced_custom_object(group, version, namespace, plural[d["kind"]], body, **opts)
        else:
            c.create_cluster_custom_object(group, version, plural[d["kind"]], d, **opts)

    for d in docs:
        create(d)
    [flavor, *_] = [d for d in docs if d["kind"] == "ResourceFlavor"]
    with pytest.raises(ApiException) as refused:
        create({**flavor, "spec": {"nodeLabel": flavor["spec"]["nodeLabels"]}})
    assert refused.value.status in (400, 422) and "nodeLabel" in str(refused.value.body)


# -------------------------------------------------------------- each check catches what it is for

BROKEN = [
    ("single-host pool with a topology",
     "--machine-type=ct5p-hightpu-4t --num-nodes=1 --disk-size=130\n",
     "--machine-type=ct5p-hightpu-4t --tpu-topology=2x2x1 --num-nodes=1 --disk-size=130\n",
     pool_problems, "v5p-8-$i: a single-host pool takes no tpu-topology"),
    ("multi-host tpu7x pool with a topology",
     "--disk-size=1120 \\\n    --placement-policy=tpu7x-16-2x2x2-placement-policy",
     "--disk-size=1120 --tpu-topology=2x2x2 \\\n    --placement-policy=tpu7x-16-2x2x2-placement-policy",
     pool_problems, "tpu7x-16-$i: a multi-host tpu7x pool takes --placement-policy alone"),
    ("multi-host v5p pool without compact placement",
     "--num-nodes=2 \\\n    --placement-type=COMPACT", "--num-nodes=2",
     pool_problems, "v5p-16-$i: a multi-host v5p pool takes --tpu-topology and --placement-type=COMPACT"),
    ("a flag outside the table",
     "--uniform-bucket-level-access", "--uniform-bucket-level-access --no-such-flag",
     gcloud_problems, "gcloud storage buckets create --no-such-flag: not a flag rljob relies on"),
    ("a command outside the table", "gcloud config set project $PROJECT_ID",
     "gcloud config set project $PROJECT_ID\ngcloud beta container foo", gcloud_problems,
     "gcloud beta container foo: not a gcloud command of the table"),
    ("a prose flag that is no flag", "Add `--spot`", "Add `--spotty`",
     gcloud_problems, "`--spotty`: not a flag of any gcloud command of the table"),
    ("a cluster without Workload Identity", " --workload-pool=$PROJECT_ID.svc.id.goog", "",
     gcloud_problems, "gcloud container clusters create: without --workload-pool, Workload Identity"),
    ("a TPU pool without its zone", "--node-locations=$ZONE --machine-type=ct5p-hightpu-4t --tpu-topology",
     "--machine-type=ct5p-hightpu-4t --tpu-topology", gcloud_problems,
     "gcloud container node-pools create: without --node-locations, the zone of the TPU quota"),
    ("a workload policy without its topology", "--type=HIGH_THROUGHPUT --accelerator-topology=2x2x2",
     "--type=HIGH_THROUGHPUT", gcloud_problems,
     "gcloud compute resource-policies create workload-policy: without --accelerator-topology"),
    ("a weaker bucket role", "--role=roles/storage.objectUser", "--role=roles/storage.objectViewer",
     gcloud_problems, "--role=roles/storage.objectViewer: expected objects read, written and listed"),
    ("a wrong workload policy type", "--type=HIGH_THROUGHPUT --accelerator-topology=4x8x8",
     "--type=COMPACT --accelerator-topology=4x8x8", gcloud_problems,
     "--type=COMPACT: expected HIGH_THROUGHPUT"),
    ("an unknown machine type", "--machine-type=tpu7x-standard-4t --num-nodes=1",
     "--machine-type=tpu7x-standard-8t --num-nodes=1", version_problems,
     "machine type tpu7x-standard-8t: not in the TPU catalog"),
    ("another JobSet", "jobset/releases/download/v0.12.0/", "jobset/releases/download/v0.11.0/",
     version_problems, "jobset install URL at v0.11.0, pinned v0.12.0"),
    ("another image tag", "rljob-trainer:0.1.0", "rljob-trainer:0.0.9", version_problems,
     "image rljob-trainer:0.0.9: the images are tagged with the package version"),
    ("another vllm-tpu", "vllm-tpu 0.32.0", "vllm-tpu 0.31.0", version_problems,
     "vllm-tpu 0.31.0: pyproject.toml pins 0.32.0"),
    ("the images as uid 1000", "The trainer and sampler images run as root (uid 0)",
     "The trainer and sampler images run as uid 1000", version_problems,
     "trainer: the doc must say 'The trainer and sampler images run as root (uid 0)'"),
    ("a Debian package less", "`libomp-dev`,", "", version_problems,
     "Debian packages named ['build-essential', 'libopenmpi-dev']"),
    ("no word of v5p's vLLM support", "lists v5p as experimental", "supports v5p",
     version_problems, "qwen3-8b-grpo: the doc must say vLLM's TPU backend lists v5p as experimental"),
    ("another deployment name", "deployment/rljob-rljob-operator", "deployment/rljob-operator",
     version_problems, "deployment/rljob-operator: the chart names it rljob-rljob-operator"),
    ("a grant for another namespace", "workloadIdentityPools/$PROJECT_ID.svc.id.goog/namespace/rl\"",
     "workloadIdentityPools/$PROJECT_ID.svc.id.goog/namespace/ml\"", identity_problems,
     "principalSet for namespace ml"),
    ("a grant for another ServiceAccount", "/sa/qwen3-8b-grpo-rljob", "/sa/qwen3-8b-grpo", identity_problems,
     "principal ns/rl/sa/qwen3-8b-grpo: not the ServiceAccount of a doc RLJob"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("old", "new", "check", "problem"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN]
)
def test_a_broken_doc_is_caught(old: str, new: str, check: Callable[[str], list[str]], problem: str) -> None:
    assert old in TEXT
    assert not [p for p in check(TEXT) if problem in p]
    found = check(TEXT.replace(old, new, 1))
    assert any(problem in p for p in found), found


@pytest.mark.jax
@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("to_maxtext model_name=", "to_maxtext maxtext/configs/base.yml model_name=",
         "config src/maxtext/configs/base.yml: not found outside a MaxText checkout"),
        ("hardware=cpu", "hardwre=cpu", "hardwre: not a MaxText 0.2.5 config key"),
        ("model_name=qwen3-8b \\", "model_name=qwen3-4b \\",
         "model_name=qwen3-4b: qwen3-8b-grpo runs qwen3-8b"),
        ("scan_layers=True\n", "scan_layers=False\n", "scan_layers=False: qwen3-8b-grpo trains with True"),
    ],
    ids=["relative config path", "unknown key", "another model", "other layer scanning"],
)  # fmt: skip
def test_a_broken_conversion_command_is_caught(old: str, new: str, problem: str, tmp_path: Path) -> None:
    assert old in TEXT
    found = conversion_problems(TEXT.replace(old, new, 1), tmp_path)
    assert any(problem in p for p in found), found


def generation_rows(text: str = TEXT) -> list[str]:
    """The rows of the doc's generation table, as written."""
    lines = text[text.index("<!-- generation table -->") :].splitlines()[3:]
    return [line for line in itertools.takewhile(lambda x: x.startswith("|"), lines)]


def _generation_row(gen: tpu_catalog.Generation) -> str:
    names = tpu_catalog.type_names(gen.prefix)
    topos = tpu_catalog.topologies(gen.prefix)
    also = f" (also `{gen.maxtext_prefix}-N`)" if gen.maxtext_prefix != gen.prefix else ""
    shape = f"{topos[0]} ... {topos[-1]} (2-D)" if gen.dims == 2 else f"{topos[0]} ... (3-D)"
    machines = ", ".join(f"{m} ({c})" for c, m in gen.machine_types)
    cells = [
        gen.prefix,
        f"`{names[0]}` ... `{names[-1]}`{also}",
        f"`{gen.accelerator}`",
        shape,
        machines,
        f"{gen.tensorcores_per_chip} / {gen.devices_per_chip}",
        f"{gen.hbm_gib_per_chip} GiB",
        f"{gen.peak_bf16_tflops:g} TFLOP/s",
        f"{gen.hbm_gb_per_s:g} GB/s",
        gen.vllm_tpu_support,
    ]
    return "| " + " | ".join(cells) + " |"


def test_the_generation_table_is_the_catalogs() -> None:
    """docs/gke.md's generation table: one row per row of recipes/generations.py, its figures the same."""
    assert generation_rows() == [_generation_row(g) for g in tpu_catalog.GENERATIONS.values()]
