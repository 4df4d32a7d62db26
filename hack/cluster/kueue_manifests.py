#!/usr/bin/env python3
"""Kueue's CRDs and webhook configurations from its Go module, pointed at a local Kueue process.

Usage: kueue_manifests.py crds|webhooks MODULE_DIR https://127.0.0.1:PORT CA_FILE   (JSON List on stdout)

  crds      the CRDs that MODULE_DIR/config/components/crd/kustomization.yaml lists, with the
            conversion webhooks its (uncommented) patches enable, at BASE_URL/convert with our CA.
  webhooks  the webhook configurations of config/components/webhook/manifests.yaml for Kueue's own
            objects and for JobSets only (the one integration the local Kueue runs; the module's other
            hooks name paths a Kueue without those integrations does not serve), by URL, with our CA.
            The JobSet hooks only see JobSets labelled kueue.x-k8s.io/queue-name, so a JobSet without
            a queue never waits on Kueue (a real install sends Kueue every JobSet; this one does not do
            LocalQueue defaulting for JobSets that name no queue).

YAML is turned into JSON by kubectl (`$KUBECTL`, default `kubectl`): only the standard library here, as
in jobset_webhooks.py (runs before the project's virtualenv exists).
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KEEP_GROUPS = {"kueue.x-k8s.io", "jobset.x-k8s.io"}
SCRATCH_LABEL = "rljob.dev/scratch"


def yaml_to_objects(path: Path) -> list[dict[str, Any]]:
    kubectl = os.environ.get("KUBECTL", "kubectl")
    # `label --local` converts without a server; the label it needs is taken off again below.
    out = subprocess.run(
        [kubectl, "label", "--local", "-o", "json", "-f", str(path), f"{SCRATCH_LABEL}=x"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    objs: list[dict[str, Any]] = []
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(out):
        if out[pos].isspace():
            pos += 1
            continue
        obj, pos = decoder.raw_decode(out, pos)
        objs.extend(obj["items"] if obj.get("kind") == "List" else [obj])
    for obj in objs:
        labels = obj["metadata"].get("labels") or {}
        labels.pop(SCRATCH_LABEL, None)
        if not labels:
            obj["metadata"].pop("labels", None)
    return objs


def kustomize_entries(kustomization: Path, key: str) -> list[str]:
    """The uncommented `- <value>` entries under `resources:`, or the `- path: <value>` under `patches:`."""
    out: list[str] = []
    section = None
    for line in kustomization.read_text().splitlines():
        if re.match(r"^[a-zA-Z]+:", line):
            section = line.split(":")[0]
            continue
        if section != key:
            continue
        m = re.match(r"^- (?:path: )?(\S+)\s*$", line)
        if m:
            out.append(m.group(1))
    return out


def crds(moddir: Path, base_url: str, ca_bundle: str) -> list[dict[str, Any]]:
    crd_dir = moddir / "config" / "components" / "crd"
    kustomization = crd_dir / "kustomization.yaml"
    items: list[dict[str, Any]] = []
    for res in kustomize_entries(kustomization, "resources"):
        items.extend(yaml_to_objects(crd_dir / res))
    converted: set[str] = set()
    for patch in kustomize_entries(kustomization, "patches"):
        text = (crd_dir / patch).read_text()
        if "strategy: Webhook" in text:
            m = re.search(r"^  name: (\S+)", text, re.M)
            if m:
                converted.add(m.group(1))
    for crd in items:
        name = crd["metadata"]["name"]
        if name in converted:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {"url": base_url + "/convert", "caBundle": ca_bundle},
                    "conversionReviewVersions": ["v1"],
                },
            }
    if not items or not converted:
        sys.exit(f"no CRDs or conversion patches found under {crd_dir}")
    return items


def webhooks(moddir: Path, base_url: str, ca_bundle: str) -> list[dict[str, Any]]:
    objs = yaml_to_objects(moddir / "config" / "components" / "webhook" / "manifests.yaml")
    out = []
    for item in objs:
        if item.get("kind") not in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            continue
        item["metadata"] = {"name": "kueue-" + item["metadata"]["name"]}
        hooks = []
        for hook in item["webhooks"]:
            groups = {g for rule in hook["rules"] for g in rule.get("apiGroups") or []}
            if not groups or not groups <= KEEP_GROUPS:
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": base_url + path, "caBundle": ca_bundle}
            if "jobset.x-k8s.io" in groups:
                hook["objectSelector"] = {"matchExpressions": [{"key": QUEUE_LABEL, "operator": "Exists"}]}
            hook.setdefault("timeoutSeconds", 10)
            hooks.append(hook)
        item["webhooks"] = hooks
        out.append(item)
    kinds = sorted(len(o["webhooks"]) > 0 for o in out)
    if kinds != [True, True]:
        sys.exit("expected Kueue's mutating and validating webhook configurations with JobSet hooks")
    return out


def main() -> None:
    what, moddir, base_url, ca_file = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    ca_bundle = base64.b64encode(Path(ca_file).read_bytes()).decode()
    items = crds(moddir, base_url, ca_bundle) if what == "crds" else webhooks(moddir, base_url, ca_bundle)
    json.dump({"apiVersion": "v1", "kind": "List", "items": items}, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
