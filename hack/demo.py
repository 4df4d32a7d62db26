#!/usr/bin/env python3
"""`make demo`: the local cluster, the chart, the operator, and examples/qwen3-8b-v5p.yaml running.

1. hack/cluster.sh up (kube-apiserver/etcd/scheduler/controller-manager, kwok TPU node pools, JobSet);
2. helm upgrade --install charts/rljob (deployment.enabled=false: kwok runs no containers, so the
   operator runs here as a background process authenticated as the chart's ServiceAccount through a
   TokenRequest token, its webhook reached at https://127.0.0.1 with a locally generated CA);
3. apply the example RLJob (recreated if a previous demo left it);
4. wait until the RLJob is Running with its trainer and sampler pods Running on v5p nodes;
5. print `kubectl get rljobs,jobsets,pods -o wide` and `export KUBECONFIG=...`.

The operator keeps running after the demo (pid in .cache/demo/operator.pid, log next to it), so the
cluster can be explored; `python hack/demo.py --stop` (or `make demo-down`) stops it.
Exit 0 only when step 4 succeeded.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the cluster/operator helpers are shared with the test fixtures

import yaml  # noqa: E402
from fixtures.cluster import KUBECTL, Cluster  # noqa: E402
from fixtures.operator import (  # noqa: E402
    GROUP,
    OPERATOR_BIN,
    PLURAL,
    VERSION,
    free_port,
    install_chart,
    make_certs,
    service_account_kubeconfig,
)
from kubernetes import config  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

EXAMPLE = REPO / "examples" / "qwen3-8b-v5p.yaml"
STATE = REPO / ".cache" / "demo"
PID = STATE / "operator.pid"
V5P = "tpu-v5p-slice"


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def stop_operator() -> None:
    if PID.exists():
        try:
            pid = int(PID.read_text())
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
        PID.unlink(missing_ok=True)


def start_operator(c: Cluster) -> None:
    stop_operator()
    STATE.mkdir(parents=True, exist_ok=True)
    webhook_port = free_port()
    cert, key, ca = make_certs(STATE)
    say("installing the chart (helm upgrade --install rljob charts/rljob)")
    install_chart(c, webhook_port, ca)
    kubeconfig = service_account_kubeconfig(c, STATE / "operator.kubeconfig")
    env = {
        **os.environ,
        "PYTHONSAFEPATH": "1",
        "KUBECONFIG": str(kubeconfig),
        "RLJOB_METRICS_ADDR": "127.0.0.1",
        "RLJOB_METRICS_PORT": str(free_port()),
        "RLJOB_WEBHOOK_ADDR": "127.0.0.1",
        "RLJOB_WEBHOOK_PORT": str(webhook_port),
        "RLJOB_WEBHOOK_HOST": "127.0.0.1",
        "RLJOB_WEBHOOK_CERT": str(cert),
        "RLJOB_WEBHOOK_KEY": str(key),
    }
    log = (STATE / "operator.log").open("ab")
    proc = subprocess.Popen(
        [str(OPERATOR_BIN), f"--liveness=http://127.0.0.1:{free_port()}/healthz"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd="/",
        start_new_session=True,
    )
    PID.write_text(str(proc.pid))
    say(
        f"operator running as ServiceAccount rljob-system/rljob-rljob-operator (pid {proc.pid}, "
        f"log {STATE / 'operator.log'})"
    )
    import socket

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the operator exited:\n{(STATE / 'operator.log').read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", webhook_port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    sys.exit("the operator's webhook did not come up")


def apply_example(c: Cluster) -> tuple[str, str]:
    body: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    ns, name = body["metadata"].get("namespace", "default"), body["metadata"]["name"]
    try:
        c.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        say(f"deleted the previous {ns}/{name}")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                c.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
                time.sleep(0.5)
            except ApiException:
                break
        while c.core.list_namespaced_pod(ns, label_selector=f"rljob.dev/rljob={name}").items:
            time.sleep(0.5)
    except ApiException as e:
        if e.status != 404:
            raise
    if KUBECTL.exists():
        subprocess.run([str(KUBECTL), "apply", "-f", str(EXAMPLE)], env=c.env, check=True)
    else:
        c.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
        say(f"rljob.rljob.dev/{name} created")
    return ns, name


def running_on_v5p(c: Cluster, ns: str, name: str) -> str | None:
    """None when done; else what is still missing."""
    obj = c.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    status = obj.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        sys.exit(f"the RLJob ended {status['phase']}: {status}")
    if status.get("phase") != "Running":
        return f"phase {status.get('phase')}"
    pods = c.core.list_namespaced_pod(ns, label_selector=f"rljob.dev/rljob={name}").items
    roles: dict[str, int] = {}
    for pod in pods:
        if pod.status.phase != "Running" or not pod.spec.node_name:
            return f"pod {pod.metadata.name} is {pod.status.phase}"
        node = c.core.read_node(pod.spec.node_name)
        if node.metadata.labels.get("cloud.google.com/gke-tpu-accelerator") != V5P:
            return f"pod {pod.metadata.name} is on {pod.spec.node_name}, not a v5p node"
        role = pod.metadata.labels.get("rljob.dev/role", "?")
        roles[role] = roles.get(role, 0) + 1
    if not roles.get("trainer") or not roles.get("sampler"):
        return f"pods per role: {roles}"
    return None


def print_get(c: Cluster) -> None:
    print("$ kubectl get rljobs,jobsets,pods -o wide", flush=True)
    if KUBECTL.exists():
        subprocess.run([str(KUBECTL), "get", "rljobs,jobsets,pods", "-o", "wide"], env=c.env, check=True)
        return
    # Without a kubectl binary: the same server-side tables kubectl prints (Accept: as=Table).
    for path, kind in (
        (f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}", "rljob.rljob.dev"),
        ("/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets", "jobset.jobset.x-k8s.io"),
        ("/api/v1/namespaces/default/pods", "pod"),
    ):
        resp = c.api.call_api(
            path,
            "GET",
            header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
            response_type="object",
            _return_http_data_only=True,
            query_params=[("includeObject", "None")],
        )
        cols = [col["name"].upper() for col in resp["columnDefinitions"]]
        rows = [[kind + "/" + str(r["cells"][0])] + [str(x) for x in r["cells"][1:]] for r in resp["rows"]]
        widths = [max(len(x) for x in col) for col in zip(cols, *rows, strict=False)]
        for line in [cols, *rows]:
            print("   ".join(x.ljust(w) for x, w in zip(line, widths, strict=False)).rstrip())
        print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stop", action="store_true", help="stop the demo's operator process")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    if args.stop:
        stop_operator()
        return 0
    say("rljob render -f examples/qwen3-8b-v5p.yaml (what the operator will apply)")
    subprocess.run(
        [str(Path(sys.executable).parent / "rljob"), "render", "-f", str(EXAMPLE)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    say("starting the local cluster (hack/cluster.sh up)")
    up = subprocess.run(["bash", str(REPO / "hack" / "cluster.sh"), "up"], text=True, stdout=subprocess.PIPE)
    if up.returncode != 0:
        return up.returncode
    kubeconfig = Path(
        subprocess.run(
            ["bash", str(REPO / "hack" / "cluster.sh"), "kubeconfig"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    c = Cluster(kubeconfig=kubeconfig, api=config.new_client_from_config(config_file=str(kubeconfig)))
    start_operator(c)
    ns, name = apply_example(c)
    say(f"waiting for {ns}/{name} to be Running with trainer and sampler pods Running on v5p nodes")
    deadline = time.monotonic() + args.timeout
    missing = running_on_v5p(c, ns, name)
    while missing and time.monotonic() < deadline:
        time.sleep(1)
        missing = running_on_v5p(c, ns, name)
    print_get(c)
    print(f"export KUBECONFIG={kubeconfig}")
    if missing:
        say(f"FAILED: not Running after {args.timeout:.0f}s: {missing}")
        return 1
    say(f"{ns}/{name} is Running. Operator log: {STATE / 'operator.log'}; stop it with `make demo-down`.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
