"""The process topology of one container of a rendered JobSet, from its environment alone.

One function, :func:`process_topology`, is what the trainer (and any other entrypoint that needs it)
calls in a pod: it reads only variables the render gives every TPU container (rljob.recipes.render) and
the ones the JobSet and Job controllers set, and returns the JAX process id, the process count, the
coordinator and the libtpu variables of the container. :func:`container_envs` resolves the render's
downward-API fields the way the controllers set them, so that tests and ``rljob drill`` can feed the
function the environment of every container of every pod of every slice.

Layout (one JAX process per TPU container):

- ``JOB_INDEX`` (label ``jobset.sigs.k8s.io/job-index``): the slice, 0..slices-1;
- ``JOB_COMPLETION_INDEX`` (set by the Job controller in Indexed mode,
  https://kubernetes.io/docs/concepts/workloads/controllers/job/#completion-mode): the host in the slice;
- ``RLJOB_CONTAINER_INDEX`` / ``RLJOB_CONTAINERS_PER_HOST``: the container in the pod (two on a tpu7x host
  split by NUMA node, each with 2 of the host's 4 chips);
- ``RLJOB_SLICES`` / ``RLJOB_HOSTS_PER_SLICE``: the counts.

process id = (slice x hosts + host) x containers + container; count = slices x hosts x containers; the
coordinator is process 0 (trainer job 0, pod 0, container 0), ``JAX_COORDINATOR_ADDRESS``.

libtpu's view of the slice (the ``TPU_*`` variables): GKE's mutating webhook injects ``TPU_WORKER_ID`` and
``TPU_WORKER_HOSTNAMES`` into an Indexed Job's TPU pods (one worker per pod,
https://cloud.google.com/kubernetes-engine/docs/concepts/tpus); with several TPU containers in a pod (the
multi-container, NUMA-bound setup of TPU7x,
https://docs.cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood, "NUMA binding") every
container is a process of its own and needs its own worker id and port. The convention is the one
LeaderWorkerSet's TPU webhook implements for multi-container pods
(https://github.com/kubernetes-sigs/lws/pull/754, pkg/utils/accelerators/tpu.go): ``TPU_PROCESS_PORT`` =
8476 + container index, ``TPU_PROCESS_ADDRESSES`` = one ``host:port`` entry per container of every pod of
the slice, ``TPU_WORKER_ID`` = pod index x containers + container index. JAX's own cluster detection reads
the same variables (jax/_src/clusters/cloud_tpu_cluster.py: process id = ``TPU_WORKER_ID`` +
``MEGASCALE_SLICE_ID`` x entries of ``TPU_PROCESS_ADDRESSES``), so its answer and this function's agree.
Each container's chips are the ones the TPU device plugin hands it for its ``google.com/tpu`` request
(``chips_per_container``); the container sees them as its local devices. Not verified on a TPU node: that
libtpu accepts these variables when the platform has injected others first (the trainer exports them
before JAX starts, overriding).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from rljob.recipes import naming

# libtpu's first process port (TPU_PROCESS_PORT); container i of a pod uses TPU_PROCESS_PORT_BASE + i.
TPU_PROCESS_PORT_BASE = 8476
MAX_CONTAINERS_PER_HOST = 4  # ports 8476..8479, as LeaderWorkerSet reserves them

NAME_ENV = "RLJOB_NAME"  # the RLJob's name, in every rljob container
ROLE_ENV = "RLJOB_ROLE"  # naming.TRAINER, naming.SAMPLER or "preflight"
TENSORBOARD_DIR_ENV = "RLJOB_TENSORBOARD_DIR"  # the trainer's --tensorboard-dir
SLICES_ENV = "RLJOB_SLICES"
HOSTS_ENV = "RLJOB_HOSTS_PER_SLICE"
CONTAINER_INDEX_ENV = "RLJOB_CONTAINER_INDEX"
CONTAINERS_ENV = "RLJOB_CONTAINERS_PER_HOST"
CHIPS_ENV = "RLJOB_CHIPS_PER_CONTAINER"
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
JOB_INDEX_ENV = "JOB_INDEX"
# Local runs only (no pod sets them; overrides.RESERVED_ENV keeps every RLJOB_ name rljob's): several
# trainer processes on one machine, and the entrypoints' defaults of --model, --backend and the log level.
LOCAL_PROCESS_ID_ENV = "RLJOB_PROCESS_ID"
LOCAL_NUM_PROCESSES_ENV = "RLJOB_NUM_PROCESSES"
LOCAL_COORDINATOR_ENV = "RLJOB_COORDINATOR"
TRAINER_MODEL_ENV = "RLJOB_TRAINER_MODEL"  # rljob-trainer --model's default
SAMPLER_BACKEND_ENV = "RLJOB_SAMPLER_BACKEND"  # rljob-sampler --backend's default
LOG_LEVEL_ENV = "RLJOB_LOG_LEVEL"  # the trainer's Python log level
COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"


class TopologyError(ValueError):
    """The environment does not describe a process of the layout; the message names the variable."""


@dataclass(frozen=True)
class ProcessTopology:
    """One container's place among the role's processes."""

    role: str
    slice_id: int
    host_id: int
    container: int
    slices: int
    hosts_per_slice: int
    containers_per_host: int
    chips: int
    process_id: int
    num_processes: int
    coordinator: str
    tpu_env: dict[str, str] = field(default_factory=dict)

    @property
    def is_coordinator(self) -> bool:
        return self.process_id == 0


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise TopologyError(f"env {name}: not set")
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise TopologyError(f"env {name}: not an integer: {raw!r}") from e


def _check(name: str, value: int, bound: int) -> None:
    if not 0 <= value < bound:
        raise TopologyError(f"env {name}: {value} is outside 0..{bound - 1}")


def process_topology(env: Mapping[str, str]) -> ProcessTopology:
    """The process topology of the container whose environment ``env`` is; TopologyError naming the
    variable when it is missing or inconsistent."""
    role = env.get(ROLE_ENV, naming.TRAINER)
    name = env.get(NAME_ENV, "")
    slices = _int(env, SLICES_ENV, 1)
    hosts = _int(env, HOSTS_ENV, 1)
    containers = _int(env, CONTAINERS_ENV, 1)
    if slices < 1 or hosts < 1:
        raise TopologyError(f"env {SLICES_ENV}/{HOSTS_ENV}: must be >= 1, got {slices}/{hosts}")
    if not 1 <= containers <= MAX_CONTAINERS_PER_HOST:
        raise TopologyError(f"env {CONTAINERS_ENV}: must be 1..{MAX_CONTAINERS_PER_HOST}, got {containers}")
    slice_id = _int(env, JOB_INDEX_ENV, 0)
    host_id = _int(env, COMPLETION_INDEX_ENV, 0)
    container = _int(env, CONTAINER_INDEX_ENV, 0)
    _check(JOB_INDEX_ENV, slice_id, slices)
    _check(COMPLETION_INDEX_ENV, host_id, hosts)
    _check(CONTAINER_INDEX_ENV, container, containers)
    per_slice = hosts * containers
    worker = host_id * containers + container
    if role == naming.TRAINER:
        # One JAX process group over every slice.
        process_id, count = slice_id * per_slice + worker, slices * per_slice
        coordinator = env.get(COORDINATOR_ENV, "")
        if count > 1 and not coordinator:
            raise TopologyError(f"env {COORDINATOR_ENV}: required with {count} trainer processes")
    else:
        # A sampler replica (one slice) is a group of its own, headed by its pod 0.
        process_id, count = worker, per_slice
        coordinator = f"{naming.hostname(name, role, slice_id, 0)}.{naming.subdomain(name)}" if name else ""
    tpu_env: dict[str, str] = {}
    if name:
        addresses = [
            f"{naming.hostname(name, role, slice_id, h)}.{naming.subdomain(name)}:{TPU_PROCESS_PORT_BASE + c}"
            for h in range(hosts)
            for c in range(containers)
        ]
        tpu_env = {
            "TPU_WORKER_ID": str(worker),
            "TPU_WORKER_HOSTNAMES": ",".join(a.rsplit(":", 1)[0] for a in addresses),
            "TPU_PROCESS_ADDRESSES": ",".join(addresses),
            "TPU_PROCESS_PORT": str(TPU_PROCESS_PORT_BASE + container),
        }
    return ProcessTopology(
        role=role,
        slice_id=slice_id,
        host_id=host_id,
        container=container,
        slices=slices,
        hosts_per_slice=hosts,
        containers_per_host=containers,
        chips=_int(env, CHIPS_ENV, 0),
        process_id=process_id,
        num_processes=count,
        coordinator=coordinator,
        tpu_env=tpu_env,
    )


# --- the environment a container gets, downward-API fields resolved -----------------------------------

JOBSET_LABEL = "jobset.sigs.k8s.io"
_FIELD = re.compile(r"^metadata\.(labels|annotations)\['(?P<key>[^']+)'\]$")


@dataclass(frozen=True)
class ContainerEnv:
    """One container of one pod of one Job of a rendered JobSet, with its resolved environment."""

    role: str
    job_index: int
    pod_index: int
    container: str
    container_index: int
    env: dict[str, str]


def pod_metadata(
    jobset: Mapping[str, Any], rjob: Mapping[str, Any], job_index: int, pod_index: int
) -> dict[str, Any]:
    """The labels, annotations, name and namespace the JobSet and Job controllers give one pod: JobSet
    labels and annotates every pod with its jobset-name, replicatedjob-name, replicatedjob-replicas,
    job-index and (with spec.coordinator) the coordinator's DNS name
    (https://github.com/kubernetes-sigs/jobset: api/jobset/v1alpha2/jobset_types.go names them);
    the Job controller adds batch.kubernetes.io/job-completion-index in Indexed mode."""
    meta = jobset["metadata"]
    js_name = meta["name"]
    spec = jobset["spec"]
    job_name = f"{js_name}-{rjob['name']}-{job_index}"
    shared = {
        f"{JOBSET_LABEL}/jobset-name": js_name,
        f"{JOBSET_LABEL}/replicatedjob-name": rjob["name"],
        f"{JOBSET_LABEL}/replicatedjob-replicas": str(rjob.get("replicas", 1)),
        f"{JOBSET_LABEL}/job-index": str(job_index),
        "batch.kubernetes.io/job-completion-index": str(pod_index),
    }
    coord = spec.get("coordinator")
    if coord:
        subdomain = spec.get("network", {}).get("subdomain", js_name)
        host = f"{js_name}-{coord['replicatedJob']}-{coord.get('jobIndex', 0)}-{coord.get('podIndex', 0)}"
        shared[f"{JOBSET_LABEL}/coordinator"] = f"{host}.{subdomain}"
    tmpl = rjob["template"]["spec"]["template"]
    labels = {**tmpl.get("metadata", {}).get("labels", {}), **shared}
    annotations = {**tmpl.get("metadata", {}).get("annotations", {}), **shared}
    return {
        "name": f"{job_name}-{pod_index}-xxxxx",
        "namespace": meta.get("namespace", "default"),
        "labels": labels,
        "annotations": annotations,
    }


def _resolve(item: Mapping[str, Any], meta: Mapping[str, Any]) -> str | None:
    if "value" in item:
        return str(item["value"])
    source = item.get("valueFrom", {})
    ref = source.get("fieldRef")
    if ref is not None:
        path = ref["fieldPath"]
        if path == "metadata.name":
            return str(meta["name"])
        if path == "metadata.namespace":
            return str(meta["namespace"])
        m = _FIELD.match(path)
        if m is None:
            raise TopologyError(f"env {item['name']}: fieldRef {path!r} is not resolved here")
        value = meta[m.group(1)].get(m["key"])
        # The kubelet sets an empty string for a label or annotation the pod does not carry.
        return "" if value is None else str(value)
    if "secretKeyRef" in source:
        return None  # a Secret's value: not part of the topology
    raise TopologyError(f"env {item.get('name')}: unsupported valueFrom {sorted(source)}")


def container_envs(jobset: Mapping[str, Any]) -> Iterator[ContainerEnv]:
    """Every container of every pod of every Job of a rendered JobSet, with the environment it starts
    with: the render's values, the downward-API fields resolved as the controllers set them, and
    ``JOB_COMPLETION_INDEX`` (the Job controller's, Indexed mode)."""
    for rjob in jobset["spec"]["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        pods = int(job_spec.get("completions", job_spec.get("parallelism", 1)))
        for j in range(int(rjob.get("replicas", 1))):
            for p in range(pods):
                meta = pod_metadata(jobset, rjob, j, p)
                for ci, c in enumerate(job_spec["template"]["spec"]["containers"]):
                    env: dict[str, str] = {}
                    if job_spec.get("completionMode") == "Indexed":
                        env[COMPLETION_INDEX_ENV] = str(p)
                    for item in c.get("env", []):
                        value = _resolve(item, meta)
                        if value is not None:
                            env[item["name"]] = value
                    yield ContainerEnv(rjob["name"], j, p, c["name"], ci, env)


__all__ = [
    "CHIPS_ENV",
    "CONTAINERS_ENV",
    "CONTAINER_INDEX_ENV",
    "HOSTS_ENV",
    "SLICES_ENV",
    "TPU_PROCESS_PORT_BASE",
    "ContainerEnv",
    "ProcessTopology",
    "TopologyError",
    "container_envs",
    "pod_metadata",
    "process_topology",
]
