"""Render an RLJob into Kubernetes objects: the pods' ServiceAccount, Role and RoleBinding, the run
ConfigMap, the API Service (spec.service), the NetworkPolicies (rljob.recipes.network) and the JobSet.

The small objects are built here as data. The JobSet comes from a template
(recipes/templates/jobset.yaml.j2) that renders YAML whose every value goes through `tojson`; the YAML
is parsed back into data, and the JobSet is validated against JobSet's CRD schema. What `rljob render`
prints is what the operator applies: both call `render`.

How `tojson` works here (`_render`): it sets each value aside as data (a JSON round trip of it: what
parsing its JSON text as YAML gives) and writes a placeholder scalar in its place, so the YAML parsed is
only the template's skeleton. A skeleton's text seldom changes from one job to another, so its parse is
cached; the placeholders are then replaced by the values. Parsing every value's JSON as YAML made a
render ~4x slower (PyYAML builds each node in Python), and the operator renders every new RLJob.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any

from rljob.recipes import (
    failure,
    libtpu,
    naming,
    network,
    overrides,
    placement,
    plan,
    podpolicy,
    podspec,
    topology,
)
from rljob.recipes.api import RLJob
from rljob.recipes.runconfig import (
    API_KEYS_ENV,
    API_KEYS_SECRET_KEY,
    CACHE_VOLUME,
    CONFIG_DIR,
    CONFIG_ENV,
    CONFIG_KEY,
    CONFIG_PATH,
    COORDINATOR_PORT,
    LOCAL_CACHE_ENV,
    RAY_AUTH_MODE_ENV,
    RAY_AUTH_TOKEN_ENV,
    RAY_HEAD_ENV,
    RAY_PORT,
    RAY_PORT_ENV,
    RUN_TOKEN_ENV,
    RUN_TOKEN_SECRET_KEY,
    SAMPLER_HOSTS_ENV,
    SAMPLER_PORT,
    PreflightPlacement,
)
from rljob.recipes.tpu import TPU_RESOURCE

if TYPE_CHECKING:
    import jinja2
    from rljob.recipes.api import PodTemplate
    from rljob.recipes.runconfig import CacheDisk, RunConfig, TpuPlan

# The images' entrypoints: the package's console scripts, reading the mounted run.json.
TRAINER_COMMAND = ["rljob-trainer", "--config", CONFIG_PATH]
SAMPLER_COMMAND = ["rljob-sampler", "--config", CONFIG_PATH]
JOBSET_LABELS = "jobset.sigs.k8s.io"
API_PORT_NAME = "api"
RBAC_API_VERSION = "rbac.authorization.k8s.io/v1"


class RenderError(RuntimeError):
    """A rendered object failed JobSet's schema: a bug in rljob, never the user's input."""


_REF = "__rljob_value_"  # placeholder scalars: __rljob_value_<n>__ (see the module docstring)


@cache
def _env() -> jinja2.Environment:
    import jinja2

    @jinja2.pass_context
    def tojson(context: Any, value: Any) -> str:
        refs: list[Any] = context["_refs"]
        refs.append(_value(value))  # as jinja's own tojson: keys sorted
        return f"{_REF}{len(refs) - 1}__"

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("rljob.recipes", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )
    env.filters["tojson"] = tojson
    env.globals["jobset_api_version"] = naming.JOBSET_API_VERSION
    return env


@lru_cache(maxsize=64)
def _skeleton(text: str) -> tuple[Any, ...]:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return tuple(doc for doc in yaml.load_all(text, Loader=loader) if doc is not None)


def _fill(node: Any, refs: list[Any]) -> Any:
    """A copy of a cached skeleton with every placeholder replaced by its value."""
    if isinstance(node, dict):
        return {_fill(k, refs): _fill(v, refs) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, refs) for v in node]
    if isinstance(node, str) and node.startswith(_REF) and node.endswith("__"):
        return refs[int(node[len(_REF) : -2])]
    return node


def _render(template: str, **context: Any) -> list[Any]:
    """The YAML documents a template renders, as data."""
    refs: list[Any] = []
    text = _env().get_template(template).render(_refs=refs, **context)
    return [_fill(doc, refs) for doc in _skeleton(text)]


def _value(value: Any) -> Any:
    """A value as the templates' `tojson` sets it into an object: a JSON round trip, keys sorted (so
    each object gets its own copy, and `to_yaml` prints no YAML aliases)."""
    return json.loads(json.dumps(value, sort_keys=True))


def _metadata(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": namespace, "labels": _value(labels)}


def run_labels(rljob: str) -> dict[str, str]:
    """The labels of every object of the run named ``rljob`` (the operator's own children's too)."""
    return {
        "app.kubernetes.io/name": "rljob",
        "app.kubernetes.io/instance": rljob,
        "app.kubernetes.io/managed-by": "rljob",
        naming.RUN_LABEL: rljob,
    }


def labels(run: RunConfig, role: str | None = None) -> dict[str, str]:
    out = run_labels(run.name)
    if role:
        out["app.kubernetes.io/component"] = role
        out[naming.ROLE_LABEL] = role
    return out


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def _run_token(run: RunConfig, name: str) -> dict[str, Any]:
    """Env ``name`` holding the run's token, from the Secret the operator creates for the run."""
    ref = {"name": naming.credentials_secret(run.name), "key": RUN_TOKEN_SECRET_KEY}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


def _env_common(run: RunConfig, role: str) -> list[dict[str, Any]]:
    return [
        {"name": CONFIG_ENV, "value": CONFIG_PATH},
        _run_token(run, RUN_TOKEN_ENV),
        {"name": topology.NAME_ENV, "value": run.name},
        {"name": topology.ROLE_ENV, "value": role},
        {"name": "POD_NAME", **_field("metadata.name")},
        {"name": "POD_NAMESPACE", **_field("metadata.namespace")},
        {"name": "JOBSET_NAME", **_field(f"metadata.labels['{JOBSET_LABELS}/jobset-name']")},
        {"name": "JOB_INDEX", **_field(f"metadata.labels['{JOBSET_LABELS}/job-index']")},
        {"name": "POD_INDEX", **_field("metadata.labels['batch.kubernetes.io/job-completion-index']")},
    ]


def _template(run: RunConfig, role: str) -> PodTemplate | None:
    spec = run.spec
    return spec.trainer.template if role == naming.TRAINER else spec.sampler.template


def _cache_disk(run: RunConfig, role: str) -> CacheDisk:
    return run.trainer.cache_disk if role == naming.TRAINER else run.sampler.cache_disk


def _containers(run: RunConfig, role: str, tpu: TpuPlan, jobs: int) -> list[dict[str, Any]]:
    """The TPU containers of one pod of a role; each knows its place (rljob.recipes.topology reads it)."""
    out = []
    template = _template(run, role)
    disk = _cache_disk(run, role)
    n = tpu.containers_per_host
    for i in range(n):
        env = _env_common(run, role)
        env += [
            {"name": topology.SLICES_ENV, "value": str(jobs)},
            {"name": topology.HOSTS_ENV, "value": str(tpu.hosts)},
            {"name": topology.CONTAINER_INDEX_ENV, "value": str(i)},
            {"name": topology.CONTAINERS_ENV, "value": str(n)},
            {"name": topology.CHIPS_ENV, "value": str(tpu.chips_per_container)},
        ]
        ports: list[dict[str, Any]] = []
        if role == naming.TRAINER:
            env.append({"name": topology.COORDINATOR_ENV, "value": run.endpoints.coordinator})
            if run.trainer.libtpu_flags:
                env.append({"name": libtpu.ENV, "value": libtpu.init_args(run.trainer.libtpu_flags)})
            if run.trainer.slices > 1:
                annotation = "metadata.annotations['{}/{}']"
                env += [
                    {
                        "name": "MEGASCALE_NUM_SLICES",
                        **_field(annotation.format(JOBSET_LABELS, "replicatedjob-replicas")),
                    },
                    {"name": "MEGASCALE_SLICE_ID", **_field(annotation.format(JOBSET_LABELS, "job-index"))},
                    {
                        "name": "MEGASCALE_COORDINATOR_ADDRESS",
                        **_field(annotation.format(JOBSET_LABELS, "coordinator")),
                    },
                ]
            if i == 0:
                ports.append({"name": "coordinator", "containerPort": COORDINATOR_PORT, "protocol": "TCP"})
            svc = run.spec.service
            if svc is not None and i == 0:
                ports.append({"name": API_PORT_NAME, "containerPort": svc.port, "protocol": "TCP"})
                if svc.api_key_secret:
                    ref = {"name": svc.api_key_secret, "key": API_KEYS_SECRET_KEY}
                    env.append({"name": API_KEYS_ENV, "valueFrom": {"secretKeyRef": ref}})
        else:
            ports.append({"name": "http", "containerPort": SAMPLER_PORT, "protocol": "TCP"})
            if tpu.hosts > 1:  # one vLLM server over the replica's hosts: a Ray cluster, head in pod 0
                env += [
                    {"name": SAMPLER_HOSTS_ENV, "value": str(tpu.hosts)},
                    {"name": RAY_HEAD_ENV, "value": naming.replica_head(run.name, role)},
                    {"name": RAY_PORT_ENV, "value": str(RAY_PORT)},
                    # Ray's token authentication on the replica's Ray cluster (runconfig.RAY_AUTH_MODE_ENV).
                    {"name": RAY_AUTH_MODE_ENV, "value": "token"},
                    _run_token(run, RAY_AUTH_TOKEN_ENV),
                ]
                ports.append({"name": "ray", "containerPort": RAY_PORT, "protocol": "TCP"})
        out.append(
            {
                "name": role if n == 1 else f"{role}-{i}",
                "env": env + overrides.env(template),
                "env_from": overrides.env_from(template),
                "ports": ports,
                "resources": overrides.resources(
                    podspec.resources(tpu.chips_per_container, TPU_RESOURCE, disk.request), template
                ),
                "volume_mounts": overrides.volume_mounts(template),
            }
        )
    return out


def _role(run: RunConfig, role: str) -> dict[str, Any]:
    spec = run.spec
    if role == naming.TRAINER:
        tpu, replicas, image, command = (
            run.trainer.tpu,
            run.trainer.slices,
            spec.trainer.image,
            TRAINER_COMMAND,
        )
    else:
        tpu, replicas, image, command = (
            run.sampler.tpu,
            run.sampler.replicas,
            spec.sampler.image,
            SAMPLER_COMMAND,
        )
    template = _template(run, role)
    return {
        "name": role,
        "replicas": replicas,
        "hosts": tpu.hosts,
        "labels": labels(run, role),
        "pod_labels": {**labels(run, role), **overrides.pod_labels(template)},
        "pod_annotations": overrides.pod_annotations(template),
        "job_annotations": placement.job_annotations(),
        "node_selector": {**placement.node_selector(tpu), **overrides.node_selector(template)},
        "tolerations": placement.tolerations() + overrides.tolerations(template),
        "affinity": overrides.affinity(template),
        "service_account": overrides.service_account(template) or naming.service_account(run.name),
        "volumes": overrides.volumes(template),
        "cache_path": _cache_disk(run, role).path,
        "cache_size_limit": _cache_disk(run, role).size_limit,
        "grace_seconds": 120 if role == naming.TRAINER else 30,
        "automount_token": podspec.mounts_api_token(role),
        "shm_size": podspec.SHM_SIZE[role],
        "image": image,
        "command": command,
        "containers": _containers(run, role, tpu, replicas),
    }


def jobset(run: RunConfig) -> dict[str, Any]:
    """The JobSet of a resolved run, validated against JobSet's schema."""
    from rljob.recipes.schema import validate_jobset

    spec = run.spec
    job_labels = labels(run)
    if spec.queue_name:
        job_labels["kueue.x-k8s.io/queue-name"] = spec.queue_name
    obj: dict[str, Any]
    (obj,) = _render(
        "jobset.yaml.j2",
        name=run.job_set_name,
        namespace=run.namespace,
        labels=job_labels,
        suspend=spec.suspend,
        subdomain=naming.subdomain(run.name),
        coordinator_role=naming.TRAINER,
        annotations=failure.budget_annotations(
            spec.failure_policy.max_restarts, spec.failure_policy.max_sampler_restarts, run.sampler_failure
        ),
        failure_policy=failure.jobset_failure_policy(
            spec.failure_policy.max_restarts, spec.failure_policy.max_sampler_restarts, run.sampler_failure
        ),
        pod_failure_policy=failure.pod_failure_policy(),
        roles=[_role(run, naming.TRAINER), _role(run, naming.SAMPLER)],
        priority_class_name=spec.priority_class_name,
        pod_security=podspec.pod_security_context(),
        container_security=podspec.container_security_context(),
        termination_message_policy=podspec.TERMINATION_MESSAGE_POLICY,
        config_dir=CONFIG_DIR,
        cache_volume=CACHE_VOLUME,
        run_configmap=naming.run_configmap(run.name),
    )
    problems = validate_jobset(obj)
    if problems:
        raise RenderError("rendered JobSet fails JobSet's CRD schema:\n" + "\n".join(problems))
    return obj


PREFLIGHT_CONTAINER = "compile"
PREFLIGHT_TTL_SECONDS = 24 * 3600  # a finished preflight Job is kept a day (its outcome stays in the status)
TERMINATION_LOG = "/dev/termination-log"  # the container's terminationMessagePath (Kubernetes' default)


def preflight_digest(run: RunConfig) -> str:
    """What the compile preflight compiles, as hex digits: the run config without the two fields that may
    change while a run exists (spec.suspend, spec.queueName) and the preflight's placement (the operator's
    pod policy), which compile nothing."""
    spec = run.spec.model_copy(update={"suspend": False, "queue_name": None})
    stable = run.model_copy(update={"spec": spec, "preflight": None})
    text = stable.model_dump_json(exclude_none=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[: naming.PREFLIGHT_DIGEST]


def preflight_job(run: RunConfig) -> dict[str, Any] | None:
    """The compile preflight (spec.trainer.preflight.compile): a Job of one CPU pod of the trainer image
    running `python -m rljob.trainer.compilecheck` on the run ConfigMap, mounted as the trainer's is, with
    the trainer template's env, envFrom, volumes and ServiceAccount (its storage credentials) and the
    trainer pods' security contexts; no TPU, no TPU node selector or toleration: the nodes the operator's
    pod policy names (RunConfig.preflight: by default those that run the GKE metadata server). It writes
    JAX's persistent compilation cache to `{storage}/cache/jax-trainer/` (rljob.common.caches) and, on a
    refusal, one line per problem to its termination log. None when the preflight is off."""
    pf = run.spec.trainer.preflight
    if not pf.compile:
        return None
    template = _template(run, naming.TRAINER)
    disk = _cache_disk(run, naming.TRAINER)
    placement = run.preflight or PreflightPlacement(node_selector={}, tolerations=[])
    own = {**labels(run, "preflight"), naming.PREFLIGHT_LABEL: "true"}
    env = [
        {"name": CONFIG_ENV, "value": CONFIG_PATH},
        {"name": topology.NAME_ENV, "value": run.name},
        {"name": topology.ROLE_ENV, "value": "preflight"},
        {"name": "POD_NAME", **_field("metadata.name")},
        {"name": "POD_NAMESPACE", **_field("metadata.namespace")},
        # JAX's own backend stays on the CPU; libtpu compiles for the topology (trainer/compilecheck.py).
        {"name": "JAX_PLATFORMS", "value": "cpu"},
        {"name": LOCAL_CACHE_ENV, "value": disk.path},
    ]
    if (
        run.trainer.libtpu_flags
    ):  # the trainer's compiler flags: the preflight compiles what the trainer would
        env.append({"name": libtpu.ENV, "value": libtpu.init_args(run.trainer.libtpu_flags)})
    command = [
        "python",
        "-m",
        "rljob.trainer.compilecheck",
        "--config",
        CONFIG_PATH,
        "--cache-dir",
        disk.path,
        "--termination-log",
        TERMINATION_LOG,
    ]
    obj: dict[str, Any]
    (obj,) = _render(
        "preflight.yaml.j2",
        name=naming.preflight_job(run.name, preflight_digest(run)),
        namespace=run.namespace,
        labels=own,
        ttl_seconds=PREFLIGHT_TTL_SECONDS,
        container=PREFLIGHT_CONTAINER,
        pod_labels={**own, **overrides.pod_labels(template)},
        pod_annotations=overrides.pod_annotations(template),
        service_account=overrides.service_account(template) or naming.service_account(run.name),
        pod_security=podspec.pod_security_context(),
        container_security=podspec.container_security_context(),
        termination_message_policy=podspec.TERMINATION_MESSAGE_POLICY,
        priority_class_name=run.spec.priority_class_name,
        node_selector=placement.node_selector,
        tolerations=placement.tolerations,
        image=run.spec.trainer.image,
        command=command,
        env=env + overrides.env(template),
        env_from=overrides.env_from(template),
        resources={
            "requests": {"cpu": pf.cpu, "memory": pf.memory, "ephemeral-storage": disk.size_limit},
            "limits": {"memory": pf.memory},
        },
        config_dir=CONFIG_DIR,
        cache_volume=CACHE_VOLUME,
        cache_path=disk.path,
        cache_size_limit=disk.size_limit,
        volume_mounts=overrides.volume_mounts(template),
        volumes=overrides.volumes(template),
        run_configmap=naming.run_configmap(run.name),
    )
    return obj


# Kubernetes refuses a ConfigMap whose data exceeds 1 MiB (corev1 validation: MaxSecretSize applies to
# ConfigMaps too).
CONFIGMAP_MAX_BYTES = 1 << 20


def configmap(run: RunConfig) -> dict[str, Any]:
    """The run ConfigMap: RunConfig JSON under key run.json. PlanError when it would exceed 1 MiB."""
    run_json = run.model_dump_json(indent=1, exclude_none=True)
    size = len(run_json.encode("utf-8"))
    if size > CONFIGMAP_MAX_BYTES:
        raise plan.PlanError(
            [
                f"spec: the run config is {size} bytes, over the {CONFIGMAP_MAX_BYTES} bytes of a ConfigMap "
                "(shorten spec.dataset.promptTemplate or spec.trainer.maxtext)"
            ]
        )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(naming.run_configmap(run.name), run.namespace, labels(run)),
        "data": {CONFIG_KEY: run_json},
    }


def access(run: RunConfig) -> list[dict[str, Any]]:
    """The pods' ServiceAccount, and the Role + RoleBinding limited to the progress ConfigMap (bound to the
    trainer template's serviceAccountName too, when it names another)."""
    own = naming.service_account(run.name)
    trainer_sa = overrides.service_account(_template(run, naming.TRAINER))
    subjects = [own] + ([trainer_sa] if trainer_sa and trainer_sa != own else [])
    role, ns, own_labels = f"{run.name}-progress", run.namespace, labels(run)
    # Nothing else is granted to the pods: get and patch of the one progress ConfigMap (contract 4).
    rule = {
        "apiGroups": [""],
        "resources": ["configmaps"],
        "resourceNames": [naming.progress_configmap(run.name)],
        "verbs": ["get", "patch"],
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _metadata(own, ns, own_labels),
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": RBAC_API_VERSION,
            "kind": "Role",
            "metadata": _metadata(role, ns, own_labels),
            "rules": [rule],
        },
        {
            "apiVersion": RBAC_API_VERSION,
            "kind": "RoleBinding",
            "metadata": _metadata(role, ns, own_labels),
            "roleRef": {"apiGroup": RBAC_API_VERSION.split("/")[0], "kind": "Role", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns} for sa in subjects],
        },
    ]


def api_service(run: RunConfig) -> list[dict[str, Any]]:
    """The Service in front of the first trainer pod when the run serves an API (spec.service); none
    otherwise."""
    svc = run.spec.service
    if svc is None:
        return []
    selector = {
        naming.RUN_LABEL: run.name,
        naming.ROLE_LABEL: naming.TRAINER,
        f"{JOBSET_LABELS}/jobset-name": run.job_set_name,
        f"{JOBSET_LABELS}/job-index": "0",
        "batch.kubernetes.io/job-completion-index": "0",
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(naming.api_service(run.name), run.namespace, labels(run, naming.TRAINER)),
            "spec": {
                "type": "ClusterIP",
                "selector": _value(selector),
                "ports": [
                    {"name": API_PORT_NAME, "port": svc.port, "targetPort": API_PORT_NAME, "protocol": "TCP"}
                ],
            },
        }
    ]


def network_policies(run: RunConfig) -> list[dict[str, Any]]:
    """The run's NetworkPolicies (rljob.recipes.network): its pods admit only each other, and the API port
    (spec.service) admits the client namespaces."""
    ns, own_labels = run.namespace, labels(run)
    return network.policies(
        run,
        _metadata(naming.network_policy(run.name), ns, own_labels),
        _metadata(naming.api_network_policy(run.name), ns, labels(run, naming.TRAINER)),
        API_PORT_NAME,
    )


def api_url(run: RunConfig) -> str | None:
    """The in-cluster URL of the run's API (status.url), or None without spec.service."""
    svc = run.spec.service
    if svc is None:
        return None
    return naming.api_url(run.name, run.namespace, svc.port)


def to_yaml(objs: list[dict[str, Any]]) -> str:
    """A YAML stream of objects, as `rljob render` prints it (key order kept)."""
    return _yaml_dump(objs)


@cache
def _dumper() -> type:
    import yaml

    base = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

    def text(dumper: Any, value: str) -> Any:
        style = "|" if "\n" in value else None  # multi-line values (run.json) as literal blocks
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    dumper: type = type("RljobDumper", (base,), {})
    dumper.add_representer(str, text)  # type: ignore[attr-defined]
    return dumper


def _yaml_dump(objs: list[dict[str, Any]]) -> str:
    import yaml

    return yaml.dump_all(objs, Dumper=_dumper(), sort_keys=False, explicit_start=True, width=1 << 16)


def render(
    job: RLJob, policy: podpolicy.PodPolicy = podpolicy.DEFAULT, *, restart_job: bool = True
) -> list[dict[str, Any]]:
    """Every object of a job, in apply order: the pods' ServiceAccount, Role and RoleBinding, the run
    ConfigMap, the API Service of a run with spec.service, the NetworkPolicies (before the pods they
    cover), the compile preflight's Job (spec.trainer.preflight.compile), then the JobSet. The operator
    creates the preflight Job before the JobSet and the JobSet only once the Job succeeded. `rljob render`
    prints exactly
    these and the operator applies exactly these (plus the progress ConfigMap and the run's credentials
    Secret, whose random token no render holds: rljob.common.credentials). Raises
    PlanError. `policy`: the operator's pod policy (rljob.recipes.podpolicy); `restart_job`: whether the
    cluster's JobSet admits the failure action RestartJob (rljob.recipes.plan.resolve)."""
    return objects(plan.resolve(job, policy, restart_job=restart_job))


def objects(run: RunConfig) -> list[dict[str, Any]]:
    """The objects of a resolved run, in apply order (see `render`)."""
    pre = preflight_job(run)
    return [
        *access(run),
        configmap(run),
        *api_service(run),
        *network_policies(run),
        *([pre] if pre else []),
        jobset(run),
    ]
