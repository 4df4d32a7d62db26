#!/usr/bin/env python3
"""Point JobSet's webhook configurations (from its module, as JSON on stdin) at a local webhook server.

Usage: kubectl create --dry-run=client -o json -f <jobset>/config/components/webhook/manifests.yaml \
         | jobset_webhooks.py https://127.0.0.1:PORT CA_FILE
In a real install kustomize names them jobset-*, points clientConfig.service at jobset-webhook-service
and (patches/*.yaml) limits the pod webhooks to pods labelled jobset.sigs.k8s.io/jobset-name; here the
API server runs on this machine and reaches the controller's webhook server at a URL instead.
Only the standard library: runs before the project's virtualenv exists.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

POD_SELECTOR = {"matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]}


def localize(doc: dict[str, Any], base_url: str, ca_bundle: str) -> dict[str, Any]:
    items = doc["items"] if doc.get("kind") == "List" else [doc]
    for item in items:
        item["metadata"]["name"] = "jobset-" + item["metadata"]["name"]
        for hook in item["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": base_url + path, "caBundle": ca_bundle}
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = POD_SELECTOR
            hook.setdefault("timeoutSeconds", 10)
    return {"apiVersion": "v1", "kind": "List", "items": items}


def read_objects(text: str) -> list[dict[str, Any]]:
    """kubectl prints one JSON object per YAML document, back to back (or a v1 List)."""
    objs: list[dict[str, Any]] = []
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        obj, pos = decoder.raw_decode(text, pos)
        objs.extend(obj["items"] if obj.get("kind") == "List" else [obj])
    return objs


def main() -> None:
    base_url, ca_file = sys.argv[1], sys.argv[2]
    with open(ca_file, "rb") as f:
        ca_bundle = base64.b64encode(f.read()).decode()
    objs = read_objects(sys.stdin.read())
    if {o.get("kind") for o in objs} != {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}:
        sys.exit(f"expected JobSet's mutating and validating webhook configurations, got {objs!r:.200}")
    json.dump(localize({"kind": "List", "items": objs}, base_url, ca_bundle), sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
