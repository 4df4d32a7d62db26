#!/usr/bin/env python3
"""`make demo`: the local cluster, the chart, the operator; a small RLJob trained to Succeeded by local
processes standing in for its simulated pods; then examples/qwen3-8b-v5p.yaml Running on v5p nodes.

1. hack/cluster.sh up (kube-apiserver/etcd/scheduler/controller-manager, kwok TPU node pools, JobSet;
   a cold first run builds them from their Go modules, hack/build.sh, and prints its progress);
2. helm upgrade --install charts/rljob (deployment.enabled=false: kwok runs no containers, so the
   operator runs here as a background process authenticated as the chart's ServiceAccount through a
   TokenRequest token, its webhook reached at https://127.0.0.1 with a locally generated CA);
3. the training part (:func:`train`): the RLJob `rl-cpu-demo` (namespace default) with the tiny CPU
   recipe of `make rl-cpu` (rljob.local.localrun.LOCAL_MANIFEST: the successor task, 1-token
   completions) for `--steps` steps, storage gs://rljob-demo on fake-gcs-server
   (rljob.local.gcs_emulator, started here). The operator renders its JobSet and kwok "runs" its trainer
   and sampler pods on the v5p-8 pools; for each Running pod, tests/fixtures/standin.py starts the pod's
   command as a local process with the pod's environment, its run ConfigMap and, where the pod mounts
   its ServiceAccount's token (the trainer's), a TokenRequest token of that ServiceAccount (the trainer
   patches the progress ConfigMap the operator reads with it), on the CPU (the trainer's tiny model, the
   sampler's `--backend cpu`); when the trainer exits 0 its pod ends Succeeded (kwok
   Stage pod-exit), so the JobSet completes and the operator marks the RLJob Succeeded. Each change of
   STEP and REWARD is printed as it happens (`kubectl get rljobs -w` in another terminal shows the same),
   then `kubectl get rljobs`;
4. apply the example RLJob (recreated if a previous demo left it) and wait until it is Running with its
   trainer and sampler pods Running on v5p nodes (simulated: nothing of it trains);
5. print `kubectl get rljobs,jobsets,pods -o wide` and `export KUBECONFIG=...`.

The operator keeps running after the demo (pid in .cache/cluster/demo/operator.pid, log next to it; the
training processes' logs under .cache/cluster/demo/train/<pod>/; .cache/cluster is $RLJOB_CLUSTER_DIR when
set), so the cluster can be explored;
`python hack/demo.py --stop` (or `make demo-down`) stops it.
Exit 0 only when steps 3 and 4 succeeded.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the cluster/operator helpers are shared with the test fixtures

import yaml  # noqa: E402
from fixtures.cluster import KUBECTL, Cluster  # noqa: E402
from fixtures.k8s import as_dict, labels_of, name_of, pod_spec, pod_status  # noqa: E402
from fixtures.operator import (  # noqa: E402
    GROUP,
    OPERATOR_BIN,
    PLURAL,
    VERSION,
    install_chart,
    make_certs,
    service_account_kubeconfig,
)
from fixtures.standin import PodRunner  # noqa: E402
from kubernetes import config  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402
from rljob.common.ports import free_port  # noqa: E402
from rljob.recipes import naming  # noqa: E402

EXAMPLE = REPO / "examples" / "qwen3-8b-v5p.yaml"
# Next to the state of the cluster it runs on (hack/cluster.sh: $RLJOB_CLUSTER_DIR, default .cache/cluster),
# so that the test fixtures stop the demo's operator of their own cluster only (tests/fixtures/operator.py).
STATE = Path(os.environ.get("RLJOB_CLUSTER_DIR") or REPO / ".cache" / "cluster") / "demo"
PID = STATE / "operator.pid"
V5P = "tpu-v5p-slice"
TRAIN_NAME = "rl-cpu-demo"
# LOCAL_MANIFEST's steps: the mean reward climbs from chance (~0.05) to ~0.9, about 2 minutes on 2 cores.
TRAIN_STEPS = 80
TRAIN_BUCKET = "rljob-demo"


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


def delete_rljob(c: Cluster, ns: str, name: str) -> None:
    """Delete the RLJob if it exists and wait until it and its pods are gone."""
    try:
        c.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    except ApiException as e:
        if e.status != 404:
            raise
        return
    say(f"deleted the previous {ns}/{name}")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            c.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
            time.sleep(0.5)
        except ApiException:
            break
    while c.core.list_namespaced_pod(ns, label_selector=f"{naming.RUN_LABEL}={name}").items:
        time.sleep(0.5)


def apply_example(c: Cluster) -> tuple[str, str]:
    body: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    ns, name = body["metadata"].get("namespace", "default"), body["metadata"]["name"]
    delete_rljob(c, ns, name)
    if KUBECTL.exists():
        subprocess.run([str(KUBECTL), "apply", "-f", str(EXAMPLE)], env=c.env, check=True)
    else:
        c.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
        say(f"rljob.rljob.dev/{name} created")
    return ns, name


# --- the training part ----------------------------------------------------------------------------------


def train_manifest(name: str, namespace: str, steps: int) -> dict[str, Any]:
    """The tiny CPU recipe of `make rl-cpu` (rljob.local.localrun.LOCAL_MANIFEST) as an RLJob of the
    cluster: ``steps`` steps, storage on the demo's bucket of the GCS emulator."""
    from rljob.local.localrun import LOCAL_MANIFEST

    body: dict[str, Any] = copy.deepcopy(LOCAL_MANIFEST)
    body["metadata"] = {"name": name, "namespace": namespace}
    body["spec"]["algorithm"]["steps"] = steps
    body["spec"]["storage"]["root"] = f"gs://{TRAIN_BUCKET}"
    return body


def _row(status: dict[str, Any]) -> tuple[Any, Any, Any]:
    progress = status.get("progress") or {}
    return status.get("phase"), progress.get("step"), progress.get("rewardMean")


def train(
    c: Cluster,
    namespace: str = "default",
    name: str = TRAIN_NAME,
    steps: int = TRAIN_STEPS,
    timeout: float = 900,
    workdir: Path | None = None,
    hook: Callable[[dict[str, Any], PodRunner], None] | None = None,
) -> dict[str, Any]:
    """Apply the training RLJob and run its pods' trainer and sampler as local processes until the RLJob
    ends; returns the RLJob as the API server has it then. The operator must be running. `hook` is called
    with the RLJob and the pod runner once a second (the preemption drills kill pods and nodes there)."""
    from rljob.local.gcs_emulator import (
        create_bucket,
        emulator_env,
        fake_gcs_server_binary,
        start_fake_gcs_server,
    )

    workdir = workdir or STATE / "train"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    delete_rljob(c, namespace, name)
    gcs, endpoint = start_fake_gcs_server(fake_gcs_server_binary(), workdir)
    runner: PodRunner | None = None
    try:
        create_bucket(endpoint, TRAIN_BUCKET)
        say(f"fake-gcs-server at {endpoint} with bucket {TRAIN_BUCKET} (storage.root gs://{TRAIN_BUCKET})")
        body = train_manifest(name, namespace, steps)
        (workdir / f"{name}.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
        c.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
        say(f"rljob.rljob.dev/{name} created: {steps} steps of the tiny CPU recipe ({workdir / name}.yaml)")
        runner = PodRunner(c, namespace, name, workdir, emulator_env(endpoint))
        t0 = time.monotonic()
        deadline = t0 + timeout
        last: tuple[Any, Any, Any] = (None, None, None)
        started: set[str] = set()
        ended: set[str] = set()
        while True:
            runner.step()
            for pod, run in runner.running.items():
                if pod not in started:
                    started.add(pod)
                    say(f"pod {pod} is Running on kwok: its {run.role} runs here (log {run.log})")
            for pod, code in runner.exits.items():
                if pod not in ended:
                    ended.add(pod)
                    say(f"{pod}: the process exited {code}; the pod ends with exit code {code}")
                    if code != 0:
                        print(runner.tail(pod), flush=True)
            obj = as_dict(c.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
            status = obj.get("status") or {}
            row = _row(status)
            if row != last:
                last = row
                phase, step, reward = row
                shown = f"{reward:.3f}" if isinstance(reward, (int, float)) else "-"
                say(
                    f"{name}: {phase or '-'}  step {step if step is not None else '-'}/{steps}  "
                    f"reward {shown}  ({time.monotonic() - t0:.0f}s)"
                )
            if status.get("phase") in ("Succeeded", "Failed"):
                return dict(obj)
            if hook is not None:
                hook(dict(obj), runner)
            if time.monotonic() > deadline:
                say(f"timed out after {timeout:.0f}s")
                return dict(obj)
            time.sleep(1)
    finally:
        if runner is not None:
            runner.stop_all()
        gcs.terminate()
        gcs.wait(timeout=20)


def print_rljobs(c: Cluster, namespace: str) -> None:
    print(f"$ kubectl get rljobs -n {namespace}", flush=True)
    if KUBECTL.exists():
        subprocess.run([str(KUBECTL), "get", "rljobs", "-n", namespace], env=c.env, check=True)
    else:
        _print_table(c, f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}", "rljob.rljob.dev")


def running_on_v5p(c: Cluster, ns: str, name: str) -> str | None:
    """None when done; else what is still missing."""
    obj = as_dict(c.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name))
    status = obj.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        sys.exit(f"the RLJob ended {status['phase']}: {status}")
    if status.get("phase") != "Running":
        return f"phase {status.get('phase')}"
    pods = c.core.list_namespaced_pod(ns, label_selector=f"{naming.RUN_LABEL}={name}").items
    roles: dict[str, int] = {}
    for pod in pods:
        phase, node_name = pod_status(pod).phase, pod_spec(pod).node_name
        if phase != "Running" or not node_name:
            return f"pod {name_of(pod)} is {phase}"
        node = c.core.read_node(node_name)
        if labels_of(node).get("cloud.google.com/gke-tpu-accelerator") != V5P:
            return f"pod {name_of(pod)} is on {node_name}, not a v5p node"
        role = labels_of(pod).get(naming.ROLE_LABEL, "?")
        roles[role] = roles.get(role, 0) + 1
    if not roles.get("trainer") or not roles.get("sampler"):
        return f"pods per role: {roles}"
    return None


def _print_table(c: Cluster, path: str, kind: str) -> None:
    """The server-side table kubectl prints (Accept: as=Table), for a machine without a kubectl binary."""
    request = c.api.param_serialize(
        "GET",
        path,
        query_params=[("includeObject", "None")],
        header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
        auth_settings=["BearerToken"],
    )
    raw = c.api.call_api(*request)
    raw.read()  # type: ignore[no-untyped-call]
    resp = as_dict(c.api.response_deserialize(raw, {"200": "object"}).data)
    cols = [col["name"].upper() for col in resp["columnDefinitions"]]
    rows = [[kind + "/" + str(r["cells"][0])] + [str(x) for x in r["cells"][1:]] for r in resp["rows"]]
    widths = [max(len(x) for x in col) for col in zip(cols, *rows, strict=False)]
    for line in [cols, *rows]:
        print("   ".join(x.ljust(w) for x, w in zip(line, widths, strict=False)).rstrip())
    print()


def print_get(c: Cluster) -> None:
    print("$ kubectl get rljobs,jobsets,pods -o wide", flush=True)
    if KUBECTL.exists():
        subprocess.run([str(KUBECTL), "get", "rljobs,jobsets,pods", "-o", "wide"], env=c.env, check=True)
        return
    for path, kind in (
        (f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}", "rljob.rljob.dev"),
        ("/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets", "jobset.jobset.x-k8s.io"),
        ("/api/v1/namespaces/default/pods", "pod"),
    ):
        _print_table(c, path, kind)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stop", action="store_true", help="stop the demo's operator process")
    parser.add_argument("--steps", type=int, default=TRAIN_STEPS, help="steps of the training part")
    parser.add_argument("--train-timeout", type=float, default=1200, help="seconds for the training part")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for the example to be Running")
    args = parser.parse_args()
    if args.stop:
        stop_operator()
        return 0
    t0 = time.monotonic()
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
    c = Cluster(kubeconfig=kubeconfig, api=config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]
    start_operator(c)

    say(f"training: the RLJob default/{TRAIN_NAME}, its trainer and sampler as local processes")
    t_train = time.monotonic()
    obj = train(c, "default", TRAIN_NAME, args.steps, args.train_timeout)
    status = obj.get("status") or {}
    print_rljobs(c, "default")
    phase, step, reward = _row(status)
    if phase != "Succeeded" or step != args.steps or not isinstance(reward, (int, float)):
        say(f"FAILED: default/{TRAIN_NAME} ended {phase} at step {step} (reward {reward}): {status}")
        say(f"logs: {STATE / 'train'}/<pod>/, operator log {STATE / 'operator.log'}")
        return 1
    say(
        f"default/{TRAIN_NAME} Succeeded: {step} steps, last reward {reward:.3f}, "
        f"in {time.monotonic() - t_train:.0f}s"
    )

    # The trainer's pod has ended and the JobSet's completion removed the sampler's: the v5p-8 pools are free.
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
    say(f"{ns}/{name} is Running (simulated: kwok runs no containers, so it does not train).")
    say(
        f"done in {time.monotonic() - t0:.0f}s. Operator log: {STATE / 'operator.log'}; "
        "stop it with `make demo-down`."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
