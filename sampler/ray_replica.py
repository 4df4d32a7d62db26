"""One vLLM server over a multi-host sampler replica: a Ray cluster per replica.

vLLM serves one model over several hosts from a Ray cluster: `ray start --head` on one host, `ray start
--address=HEAD:6379` on the others, then `vllm serve` on the head with the total parallel size and the Ray
executor (https://docs.vllm.ai/en/latest/serving/parallelism_scaling/ , "Multi-node deployment"). On TPU,
tpu-inference takes that path when TPU_MULTIHOST_BACKEND=ray (tpu_inference/platforms/tpu_platform.py picks
its RayDistributedExecutor), and its own multi-host launcher starts the nodes exactly so
(https://github.com/vllm-project/tpu-inference/blob/main/scripts/multihost/run_cluster.sh: `ray start
--block --head --port=6379` / `ray start --block --address=HEAD:6379`, then `vllm serve` on the head).

A sampler replica is one indexed Job of the JobSet with one pod per TPU host; the render gives every
sampler container RLJOB_SAMPLER_HOSTS (the replica's hosts), RLJOB_RAY_HEAD (pod 0's DNS name) and
RLJOB_RAY_PORT; POD_INDEX (the Job completion index) gives each pod its role: pod 0 is the head, the others
are workers. The head
- starts the Ray head and waits until every worker has joined (a replica whose workers never come exits
  1 after `join_timeout_s`: a restart, counted);
- only then starts `vllm serve` with the Ray executor: its /health (the replica's readiness, what the
  trainer and the adapter watcher wait for) therefore covers every host of the replica;
- watches the cluster: a worker that leaves ends the server, and after `lost_grace_s` (time for the
  worker pod's own failure, e.g. a preemption's DisruptionTarget, to fail the Job first and be counted
  as what it is) the head exits 1 (EXIT_REPLICA_LOST), a counted restart (contract 3,
  rljob.recipes.failure).
A worker runs `ray start --block` and exits with it: non-zero when its node dies or the head goes.

`bootstrap(env, serve_argv)` is the whole pod-side logic. `rljob-sampler --backend cpu` (what `rljob drill`
runs for every pod of a multi-host replica, with the render's environment) calls it with a stand-in for
`vllm serve`: `python -m rljob.sampler.ray_replica standin-serve --cpu-sampler -- ARGS`, which checks that it
sees every node of the replica (and its CPUs) and runs a task on each before it serves, then serves
`rljob-sampler --backend cpu ARGS` in vLLM's place (start_local_replica: the same with the fixed-answer
stand-in, rljob.sampler.standin).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rljob.common.ports import free_port
from rljob.recipes.failure import EXIT_BAD_CONFIG
from rljob.recipes.runconfig import RAY_HEAD_ENV, RAY_PORT, RAY_PORT_ENV, SAMPLER_HOSTS_ENV

log = logging.getLogger("rljob.sampler.ray")

EXIT_REPLICA_LOST = 1  # any non-zero exit other than 2: a restart counted against maxRestarts
MULTIHOST_ENV = {"TPU_MULTIHOST_BACKEND": "ray"}
RAY_EXECUTOR_ARGS = ["--distributed-executor-backend", "ray"]


class BootstrapError(ValueError):
    """The pod's environment does not describe a replica (the message names the variable)."""


@dataclass(frozen=True)
class ReplicaLayout:
    hosts: int  # Ray nodes of the replica: one per host (sampler pods run one container each)
    pod_index: int
    head: str  # pod 0's address
    port: int

    @property
    def is_head(self) -> bool:
        return self.pod_index == 0

    @property
    def address(self) -> str:
        return f"{self.head}:{self.port}"


def layout_from_env(env: Mapping[str, str]) -> ReplicaLayout | None:
    """The replica this pod belongs to, or None for a single-host replica (no Ray)."""
    try:
        hosts = int(env.get(SAMPLER_HOSTS_ENV) or "1")
        if hosts <= 1:
            return None
        pod = int(env.get("POD_INDEX") or env.get("JOB_COMPLETION_INDEX") or "")
        port = int(env.get(RAY_PORT_ENV) or RAY_PORT)
    except ValueError as e:
        raise BootstrapError(f"{SAMPLER_HOSTS_ENV}, POD_INDEX, {RAY_PORT_ENV}: not integers ({e})") from e
    head = env.get(RAY_HEAD_ENV) or ""
    if not head:
        raise BootstrapError(f"{RAY_HEAD_ENV}: the head's address is not set")
    if not 0 <= pod < hosts:
        raise BootstrapError(f"POD_INDEX: {pod} is not within 0..{hosts - 1}")
    return ReplicaLayout(hosts=hosts, pod_index=pod, head=head, port=port)


def _ray_cli() -> list[str]:
    # The `ray` console script of this interpreter's environment.
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


def head_command(layout: ReplicaLayout, extra: list[str] | None = None) -> list[str]:
    return [*_ray_cli(), "start", "--block", "--head", f"--port={layout.port}", *(extra or [])]


def worker_command(layout: ReplicaLayout, extra: list[str] | None = None) -> list[str]:
    return [*_ray_cli(), "start", "--block", f"--address={layout.address}", *(extra or [])]


def _alive(ray: Any) -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = ray.nodes()
    return [n for n in nodes if n.get("Alive")]


def alive_nodes(address: str) -> int:
    """Alive nodes of the Ray cluster at ``address`` (this process joins it as a driver once)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    return len(_alive(ray))


class RayReplica:
    """The head's side: the Ray head, the wait for the workers, the server, and the watch on the nodes."""

    def __init__(
        self,
        layout: ReplicaLayout,
        env: Mapping[str, str],
        *,
        join_timeout_s: float = 1800.0,
        poll_s: float = 2.0,
        lost_grace_s: float = 30.0,
        ray_args: list[str] | None = None,
        nodes: Callable[[str], int] = alive_nodes,
    ) -> None:
        self.layout, self.env = layout, dict(env)
        self.join_timeout_s, self.poll_s, self.lost_grace_s = join_timeout_s, poll_s, lost_grace_s
        self.ray_args = ray_args or []
        self.nodes = nodes
        self.ray: subprocess.Popen[bytes] | None = None
        self.serve: subprocess.Popen[bytes] | None = None
        self.lost = threading.Event()
        self.joined_s = 0.0

    def start_head(self) -> None:
        self.ray = subprocess.Popen(head_command(self.layout, self.ray_args), env=self.env)

    def wait_for_workers(self) -> bool:
        """True once every node of the replica is alive; False on timeout or if the Ray head died."""
        t0 = time.monotonic()
        seen = 0
        while time.monotonic() - t0 < self.join_timeout_s:
            if self.ray is not None and self.ray.poll() is not None:
                return False
            try:
                seen = self.nodes(self.layout.address)
            except Exception as e:
                log.debug("ray not ready: %s", e)
                seen = 0
            if seen >= self.layout.hosts:
                self.joined_s = time.monotonic() - t0
                log.warning("ray: %d/%d nodes after %.1fs", seen, self.layout.hosts, self.joined_s)
                return True
            time.sleep(self.poll_s)
        log.error("ray: %d/%d nodes after %.0fs", seen, self.layout.hosts, self.join_timeout_s)
        return False

    def start_serve(self, argv: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        serve_env = {**self.env, **(env or {}), **MULTIHOST_ENV, "RAY_ADDRESS": self.layout.address}
        self.serve = subprocess.Popen(argv, env=serve_env)
        threading.Thread(target=self._watch, daemon=True, name="ray-watch").start()
        return self.serve

    def _watch(self) -> None:
        while self.serve is not None and self.serve.poll() is None:
            time.sleep(self.poll_s)
            try:
                alive = self.nodes(self.layout.address)
            except Exception as e:
                log.error("ray: cannot list the nodes (%s)", e)
                alive = 0
            if alive < self.layout.hosts:
                log.error(
                    "ray: %d/%d nodes alive: a worker of this replica is gone", alive, self.layout.hosts
                )
                self.lost.set()
                if self.serve.poll() is None:
                    self.serve.terminate()
                return

    def finish(self, code: int) -> int:
        """The head's exit code (contract 3) once the server exited with ``code``."""
        if self.lost.is_set():
            time.sleep(self.lost_grace_s)  # let the worker pod's own failure reach the Job first
            code = EXIT_REPLICA_LOST
        self.stop()
        return code

    def stop(self) -> None:
        for p in (self.serve, self.ray):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()


def run_worker(layout: ReplicaLayout, env: Mapping[str, str], ray_args: list[str] | None = None) -> int:
    """A worker pod: its Ray node, until it ends (non-zero: the replica restarts, contract 3)."""
    proc = subprocess.Popen(worker_command(layout, ray_args), env=dict(env))
    code = proc.wait()
    return code if code else EXIT_REPLICA_LOST  # a worker never ends on its own while the replica serves


def bootstrap(
    env: Mapping[str, str],
    serve_argv: list[str],
    serve_env: Mapping[str, str] | None = None,
    **kw: object,
) -> int:
    """The pod-side logic of a multi-host replica: a worker runs its Ray node; the head runs the Ray head,
    waits for every worker, then runs ``serve_argv`` (`vllm serve ... --distributed-executor-backend ray`)
    and returns its exit code (EXIT_REPLICA_LOST if a worker left). Raises BootstrapError if ``env`` does
    not describe a multi-host replica."""
    layout = layout_from_env(env)
    if layout is None:
        raise BootstrapError(f"{SAMPLER_HOSTS_ENV}: not a multi-host replica")
    ray_args = kw.pop("ray_args", None)
    assert ray_args is None or isinstance(ray_args, list)
    if not layout.is_head:
        return run_worker(layout, env, ray_args)
    replica = RayReplica(layout, env, ray_args=ray_args, **kw)  # type: ignore[arg-type]
    replica.start_head()
    try:
        if not replica.wait_for_workers():
            replica.stop()
            return EXIT_REPLICA_LOST
        proc = replica.start_serve(serve_argv, serve_env)
        return replica.finish(proc.wait())
    finally:
        replica.stop()


def standin_serve(
    expect: int,
    port: int,
    prefix: str,
    cpus_per_node: float | None = None,
    sampler_argv: list[str] | None = None,
) -> int:
    """A stand-in for `vllm serve` on the head: checks that the Ray cluster has ``expect`` alive nodes (each
    with ``cpus_per_node`` CPUs, where given) and runs a task on each (proof that every worker takes
    work), then serves until terminated: as rljob.sampler.standin, or, given ``sampler_argv``, as
    `rljob-sampler ARGV` (the cpu backend) in this process. Exit 1 if a node is missing or leaves."""
    import ray

    address = os.environ.get("RAY_ADDRESS", "")
    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    nodes = _alive(ray)
    if len(nodes) != expect:
        print(f"standin-serve: {len(nodes)} Ray nodes alive, expected {expect}", file=sys.stderr, flush=True)
        return 1
    cpus = [float(n.get("Resources", {}).get("CPU", 0)) for n in nodes]
    if cpus_per_node is not None and any(c != cpus_per_node for c in cpus):
        print(f"standin-serve: the nodes' CPUs are {cpus}, expected {cpus_per_node} each", file=sys.stderr)
        return 1

    @ray.remote(num_cpus=0)
    def where() -> str:
        return str(ray.get_runtime_context().get_node_id())

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = ray.get(
        [
            where.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote()
            for n in nodes
        ],
        timeout=120,
    )
    if sorted(ids) != sorted(n["NodeID"] for n in nodes):
        print(f"standin-serve: tasks ran on {ids}", file=sys.stderr, flush=True)
        return 1
    print(f"standin-serve: sees {len(nodes)} Ray nodes, a task ran on each ({sum(cpus):g} CPUs)", flush=True)
    if sampler_argv is not None:
        return _serve_cpu_sampler(ray, expect, sampler_argv)
    from rljob.sampler.standin import StandinReplica

    replica = StandinReplica(prefix, port=port).start()
    try:
        while True:
            time.sleep(1.0)
            if len(_alive(ray)) < expect:
                print("standin-serve: a Ray node left", file=sys.stderr, flush=True)
                return 1
    finally:
        replica.stop()


def _serve_cpu_sampler(ray: Any, expect: int, argv: list[str]) -> int:
    """`rljob-sampler ARGV` (the cpu backend) in this process, ended (SIGTERM, as the server's own stop)
    once a Ray node of the replica leaves; then exit 1."""
    lost = threading.Event()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                alive = len(_alive(ray))
            except Exception:
                alive = 0
            if alive < expect:
                print("standin-serve: a Ray node left", file=sys.stderr, flush=True)
                lost.set()
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, daemon=True, name="standin-watch").start()
    from rljob.sampler import main as sampler_main

    code = sampler_main.main(argv, replica=False)
    return 1 if lost.is_set() else code


# Ray nodes sharing one machine (a rehearsal): no dashboard, one CPU each, agent ports picked by Ray, and
# Ray's worker processes on ports below 15000 (Ray's default range, 10002-19999, would overlap the range a
# local run draws its processes' ports from: rljob.common.ports, 15000-32000).
LOCAL_NODE_CPUS = 1
LOCAL_RAY_ARGS = [
    f"--num-cpus={LOCAL_NODE_CPUS}",
    "--disable-usage-stats",
    "--dashboard-agent-listen-port=0",
    "--min-worker-port=10002",
    "--max-worker-port=14999",
]
LOCAL_HEAD_RAY_ARGS = ["--include-dashboard=false"]


def local_head_args() -> list[str]:
    """A local head's `ray start` arguments: LOCAL_HEAD_RAY_ARGS and a free port for its Ray client server
    (its default, 10001, would be shared by every head on the machine)."""
    return [*LOCAL_HEAD_RAY_ARGS, f"--ray-client-server-port={free_port()}"]


@dataclass
class LocalReplica:
    """A multi-host replica rehearsed on one machine: one bootstrap process per pod (each in its own
    process group, with its Ray node), the head serving ``url`` once every worker has joined."""

    pods: list[subprocess.Popen[bytes]]
    url: str
    logs: list[Path]

    def wait_healthy(self, timeout_s: float = 300.0) -> bool:
        from rljob.common.http import NO_RETRY, HttpError, shared

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.pods[0].poll() is None:
            try:
                shared().get(f"{self.url}/health", timeout=2, retry=NO_RETRY)
                return True
            except HttpError:
                time.sleep(1.0)
        return False

    def kill(self, pod: int, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pods[pod].pid, sig)

    def stop(self) -> None:
        for i, p in enumerate(self.pods):
            self.kill(i, signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill(i, signal.SIGKILL)


def start_local_replica(
    pod_envs: list[Mapping[str, str]],
    serve_port: int,
    ray_port: int,
    log_dir: Path,
    serve: list[str] | None = None,
    head_args: list[str] | None = None,
) -> LocalReplica:
    """Start the pods of one replica on this machine with the environments the render gives them (pod 0
    first), the head's address and Ray port replaced by local ones (the JobSet's DNS name does not resolve
    here). ``serve`` is the head's server command (default: the stand-in that checks every node)."""
    expect = len(pod_envs)
    serve = serve or [
        sys.executable, "-m", "rljob.sampler.ray_replica", "standin-serve", "--expect", str(expect),
        "--port", str(serve_port),
    ]  # fmt: skip
    log_dir.mkdir(parents=True, exist_ok=True)
    pods, logs = [], []
    for i, pod_env in enumerate(pod_envs):
        env = {**os.environ, **pod_env, RAY_HEAD_ENV: "127.0.0.1", RAY_PORT_ENV: str(ray_port)}
        layout = layout_from_env(env)
        if layout is None or layout.pod_index != i:
            raise BootstrapError(f"pod {i}: its environment is not pod {i} of a multi-host replica")
        argv = [sys.executable, "-m", "rljob.sampler.ray_replica", "bootstrap"]
        argv += [f"--ray-arg={a}" for a in LOCAL_RAY_ARGS]
        if layout.is_head:
            argv += [f"--head-ray-arg={a}" for a in local_head_args()]
            argv += [*(head_args or []), "--", *serve]
        logs.append(log_dir / f"pod-{i}.log")
        with logs[-1].open("wb") as out:
            pods.append(
                subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            )
    return LocalReplica(pods, f"http://127.0.0.1:{serve_port}", logs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rljob.sampler.ray_replica", description=__doc__.splitlines()[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bootstrap", help="a pod of a multi-host replica, from its env: head or worker")
    b.add_argument("--ray-arg", action="append", default=[], help="extra `ray start` argument (repeatable)")
    b.add_argument("--head-ray-arg", action="append", default=[], help="extra `ray start --head` argument")
    b.add_argument("--join-timeout-s", type=float, default=1800.0)
    b.add_argument("--lost-grace-s", type=float, default=30.0)
    b.add_argument("--poll-s", type=float, default=2.0)
    b.add_argument("serve", nargs=argparse.REMAINDER, help="-- the head's server command")
    s = sub.add_parser("standin-serve", help="stand-in for `vllm serve` on a replica's head")
    s.add_argument("--expect", type=int, required=True, help="Ray nodes the replica must have")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--prefix", default="rljob")
    s.add_argument("--cpus-per-node", type=float, default=None, help="CPUs each Ray node must have")
    s.add_argument(
        "--cpu-sampler",
        action="store_true",
        help="serve `rljob-sampler ARGS` (after --) in this process instead of the fixed-answer stand-in",
    )
    s.add_argument("sampler_argv", nargs=argparse.REMAINDER, help="-- rljob-sampler arguments")
    args, _rest = p.parse_known_args(argv)  # a stand-in ignores the vllm serve arguments it is given
    if args.cmd == "standin-serve":
        rest = args.sampler_argv[args.sampler_argv[:1] == ["--"] :] if args.cpu_sampler else None
        return standin_serve(args.expect, args.port, args.prefix, args.cpus_per_node, rest)
    serve = [a for a in args.serve if a != "--"]
    layout = layout_from_env(os.environ)
    head = layout is not None and layout.is_head
    try:
        return bootstrap(
            os.environ,
            serve,
            ray_args=args.ray_arg + (args.head_ray_arg if head else []),
            **(
                {
                    "join_timeout_s": args.join_timeout_s,
                    "lost_grace_s": args.lost_grace_s,
                    "poll_s": args.poll_s,
                }
                if head
                else {}
            ),
        )
    except BootstrapError as e:
        print(str(e), file=sys.stderr)
        return EXIT_BAD_CONFIG


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
