#!/usr/bin/env python3
"""Operator scale benchmark on the local cluster (JSON lines on stdout).

    .venv/bin/python bench/operator_scale.py [--n 500] [--total 1000]

1. Baseline: the JobSets of N RLJobs (rendered by rljob.recipes.render, suspended so no pods start)
   created directly, one after the other, with one kubernetes client: wall time. Its namespace is then
   deleted, and the deletion waited for outside any timing, so that it does not load step 2.
   A second baseline creates every object the render makes (ServiceAccount, Role, RoleBinding, run
   ConfigMap, JobSet: `rljob render | kubectl create`), what a run needs without the operator.
2. The operator (chart installed, operator as a local process authenticated as the chart's
   ServiceAccount): N RLJobs created the same way, wall time until every one has its JobSet and a
   written status (phase Suspended, observedGeneration current). Ratio to (1); goal <= 1.5x.
3. API writes per RLJob the operator made to get there (its rljob_operator_api_requests_total, every
   verb but GET), and in steady state: writes during an idle window that includes a full resync
   (every RLJob reconciled again); goal <= 3.
4. Operator RSS with --total RLJobs (goal <= 150 MiB), from /proc/<pid>/status.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the cluster and operator helpers live with the test fixtures

import yaml  # noqa: E402
from fixtures.cluster import Cluster, wait_for  # noqa: E402
from fixtures.k8s import as_dict, name_of  # noqa: E402
from fixtures.operator import (  # noqa: E402
    GROUP,
    PLURAL,
    VERSION,
    OperatorProcess,
    install_chart,
    make_certs,
    manifest,
    service_account_kubeconfig,
)
from kubernetes import client, config  # noqa: E402
from rljob.common.ports import free_port  # noqa: E402
from rljob.recipes.plan import parse_manifest  # noqa: E402
from rljob.recipes.render import render  # noqa: E402

RESYNC_S = 30


def emit(metric: str, value: float, **context: Any) -> None:
    print(
        json.dumps({"bench": "operator_scale", "metric": metric, "value": round(value, 4), **context}),
        flush=True,
    )


# A cluster of its own (hack/cluster.sh with another state dir and name): the bench measures an operator
# alone on its API server, undisturbed by tests or a demo on the shared one, and stops it afterwards.
CLUSTER_ENV = {
    **os.environ,
    "PYTHONSAFEPATH": "1",
    "RLJOB_CLUSTER_DIR": str(REPO / ".cache" / "bench-cluster"),
    "RLJOB_CLUSTER_NAME": "rljob-bench",
}


def cluster_sh(action: str) -> subprocess.CompletedProcess[str]:
    script = str(REPO / "hack" / "cluster.sh")
    return subprocess.run(["bash", script, action], capture_output=True, text=True, env=CLUSTER_ENV, cwd="/")


def cluster() -> Cluster:
    up = cluster_sh("up")
    if up.returncode != 0:
        sys.exit(f"hack/cluster.sh up failed:\n{up.stderr[-3000:]}")
    path = cluster_sh("kubeconfig")
    kubeconfig = Path(path.stdout.strip())
    return Cluster(kubeconfig=kubeconfig, api=config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]


def new_namespace(c: Cluster, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    c.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    return name


def writes(op: OperatorProcess, *, succeeded: bool = True) -> float:
    """Write requests the operator made (every verb but GET): the successful ones (2xx), or the others
    (429/5xx answers and transport errors, each retried)."""
    total = 0.0
    for k, v in op.metrics().items():
        if not k.startswith("rljob_operator_api_requests_total{") or 'verb="GET"' in k:
            continue
        ok = 'code="2' in k
        if ok == succeeded:
            total += v
    return total


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def converged(c: Cluster, ns: str, n: int) -> bool:
    items = as_dict(c.custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL))["items"]
    done = sum(
        1
        for x in items
        if (x.get("status") or {}).get("phase") == "Suspended"
        and x["status"].get("observedGeneration") == x["metadata"]["generation"]
    )
    return done == n


def baseline(c: Cluster, n: int, every_object: bool = False) -> float:
    """JobSets only (the issue's baseline), or every object the render makes (`rljob render | kubectl
    create`: ServiceAccount, Role, RoleBinding, run ConfigMap, JobSet), which is what a run needs."""
    from kubernetes import utils

    ns = new_namespace(c, "bench-direct")
    template = manifest("x", ns, suspend=True)
    bodies = []
    for i in range(n):
        body = copy.deepcopy(template)
        body["metadata"]["name"] = f"b{i:04d}"
        objs = render(parse_manifest(yaml.safe_dump(body)))
        bodies += objs if every_object else [o for o in objs if o["kind"] == "JobSet"]
    t0 = time.perf_counter()
    for obj in bodies:
        if obj["kind"] == "JobSet":
            c.custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", ns, "jobsets", obj)
        else:
            utils.create_from_dict(c.api, obj, namespace=ns)  # type: ignore[no-untyped-call]
    wall = time.perf_counter() - t0
    c.core.delete_namespace(ns)
    # Wait until the namespace is gone: its deletion (500 JobSets, their Jobs and Services) loads the API
    # server for ~25 s and must not run during the operator's measurement.
    wait_for(lambda: not namespace_exists(c, ns), 600, f"namespace {ns} deleted", interval=1.0)
    return wall


def namespace_exists(c: Cluster, name: str) -> bool:
    return any(name_of(x) == name for x in c.core.list_namespace().items)


def create_rljobs(c: Cluster, ns: str, start: int, n: int) -> None:
    for i in range(start, start + n):
        c.custom.create_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, manifest(f"r{i:04d}", ns, suspend=True)
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--total", type=int, default=1000)
    args = parser.parse_args()
    c = cluster()
    ctx = {"n": args.n}

    direct = baseline(c, args.n)
    emit("direct_jobset_create_wall_s", direct, **ctx)
    rendered = baseline(c, args.n, every_object=True)
    emit("direct_rendered_objects_create_wall_s", rendered, objects_per_run=5, **ctx)

    work = Path(tempfile.mkdtemp(prefix="rljob-bench-"))
    webhook_port = free_port()
    cert, key, ca = make_certs(work)
    install_chart(c, webhook_port, ca)
    op = OperatorProcess(
        c,
        service_account_kubeconfig(c, work / "kubeconfig"),
        cert,
        key,
        webhook_port,
        work / "operator.log",
        extra_env={"RLJOB_RESYNC_SECONDS": str(RESYNC_S)},
    )
    op.start()
    ns = new_namespace(c, "bench-op")
    try:
        w0 = writes(op)
        t0 = time.perf_counter()
        create_rljobs(c, ns, 0, args.n)
        wait_for(lambda: converged(c, ns, args.n), 1800, f"{args.n} RLJobs converged", interval=1.0)
        wall = time.perf_counter() - t0
        emit("operator_wall_s", wall, **ctx)
        emit("operator_vs_direct_ratio", wall / direct, goal=1.5, **ctx)
        # Like for like: the same objects created by one client (the JobSets alone could not run).
        emit("operator_vs_rendered_objects_ratio", wall / rendered, **ctx)
        w1 = writes(op)
        emit("api_writes_per_rljob_to_converge", (w1 - w0) / args.n, **ctx)
        emit("api_write_retries_per_rljob_to_converge", writes(op, succeeded=False) / args.n, **ctx)
        time.sleep(RESYNC_S * 1.5)  # an idle window with a full resync in it
        emit(
            "api_writes_per_rljob_steady", (writes(op) - w1) / args.n, goal=3, window_s=RESYNC_S * 1.5, **ctx
        )

        more = args.total - args.n
        if more > 0:
            create_rljobs(c, ns, args.n, more)
            wait_for(
                lambda: converged(c, ns, args.total), 1800, f"{args.total} RLJobs converged", interval=1.0
            )
        assert op.proc is not None
        emit("operator_rss_mib", rss_mib(op.proc.pid), goal=150, rljobs=args.total)
    finally:
        op.stop()
        if not os.environ.get("RLJOB_KEEP_CLUSTER"):
            cluster_sh("down")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
