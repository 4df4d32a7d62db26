"""spec.service (service mode, the Tinker API): plan defaults and refusals, the rendered Service and URL."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from rljob.recipes import naming, plan, render
from rljob.recipes.api import RLJob

BASE: dict[str, Any] = {
    "apiVersion": "rljob.dev/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "tk", "namespace": "team"},
    "spec": {
        "model": {"name": "Qwen/Qwen3-8B"},
        "trainer": {"tpu": "v5p-8"},
        "sampler": {"tpu": "v5p-8"},
        "storage": {"root": "gs://bucket/runs"},
        "service": {"api": "tinker", "apiKeySecret": "tk-keys"},
    },
}


def job(**spec: Any) -> RLJob:
    doc = copy.deepcopy(BASE)
    for k, v in spec.items():
        if v is None:
            doc["spec"].pop(k, None)
        elif isinstance(v, dict) and isinstance(doc["spec"].get(k), dict):
            doc["spec"][k].update(v)
        else:
            doc["spec"][k] = v
    return RLJob.model_validate(doc)


def test_defaults_size_the_samplers_for_every_client() -> None:
    rc = plan.resolve(job())
    svc = rc.spec.service
    assert svc is not None and (svc.port, svc.max_training_clients, svc.checkpoint_every) == (8080, 8, 1)
    assert rc.sampler.max_loras == 8
    rc = plan.resolve(job(service={"maxTrainingClients": 3}))
    assert rc.sampler.max_loras == 3 and rc.spec.service and rc.spec.service.max_training_clients == 3
    # loop mode keeps its own default
    assert plan.resolve(job(service=None)).sampler.max_loras == 2


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"sampler": {"maxLoras": 4}}, "spec.sampler.maxLoras: 4 is below spec.service.maxTrainingClients 8"),
        ({"service": {"api": "openai"}}, "spec.service.api"),
        ({"service": {"maxTrainingClients": 0}}, "spec.service.maxTrainingClients"),
        ({"service": {"port": 80}}, "spec.service.port"),
        ({"service": {"apiKeySecret": None}}, "spec.service.apiKeySecret: required: name a Secret"),
        ({"service": {"apiKeySecret": ""}}, "spec.service.apiKeySecret"),
        ({"service": {"apiKeySecret": "Keys_1"}}, "spec.service.apiKeySecret"),
    ],
    ids=[
        "maxLoras",
        "api",
        "clients",
        "port",
        "no-key-secret",
        "empty-key-secret",
        "secret-name",
    ],
)
def test_refused(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises((plan.PlanError, ValueError)) as err:
        plan.resolve(job(**spec))
    text = "\n".join(err.value.problems) if isinstance(err.value, plan.PlanError) else str(err.value)
    assert problem in text


def test_render_adds_the_api_service_and_port() -> None:
    rc = plan.resolve(job(service={"port": 9000, "apiKeySecret": "keys"}))
    objs = render.objects(rc)
    kinds = [o["kind"] for o in objs]
    assert kinds.index("Service") < kinds.index("JobSet")
    (svc,) = [o for o in objs if o["kind"] == "Service"]
    assert svc["metadata"]["name"] == naming.api_service("tk") == "tk-api"
    assert svc["spec"]["ports"] == [{"name": "api", "port": 9000, "targetPort": "api", "protocol": "TCP"}]
    sel = svc["spec"]["selector"]
    assert sel["rljob.dev/role"] == "trainer" and sel["batch.kubernetes.io/job-completion-index"] == "0"
    js = objs[-1]
    trainer = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "api", "containerPort": 9000, "protocol": "TCP"} in trainer["ports"]
    env = {e["name"]: e for e in trainer["env"]}
    assert env["RLJOB_TINKER_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-keys"}
    # every pod label the selector needs is on the trainer pods
    pod_labels = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["labels"]
    assert {k: v for k, v in sel.items() if k.startswith("rljob.dev/")}.items() <= pod_labels.items()
    assert render.api_url(rc) == "http://tk-api.team.svc:9000"


def test_loop_mode_renders_no_service() -> None:
    rc = plan.resolve(job(service=None))
    assert "Service" not in [o["kind"] for o in render.objects(rc)] and render.api_url(rc) is None


@pytest.mark.parametrize(
    ("trainer", "processes"),
    [({"tpu": "v5p-16"}, 2), ({"tpu": "v5p-16", "slices": 2}, 4)],
    ids=["hosts", "slices"],
)
def test_multi_host_trainer_serves_from_process_zero(trainer: dict[str, Any], processes: int) -> None:
    """A trainer of several hosts (and slices) serves the API: the plan accepts it, and the Service selects
    the pod of process 0 only (the first Job of the trainer's replicated job, its completion index 0),
    whose first container has the port; every process runs the service (rljob.trainer.tinker.main)."""
    from rljob.recipes import topology

    rc = plan.resolve(job(trainer=trainer))
    assert rc.trainer.slices * rc.trainer.tpu.hosts * rc.trainer.tpu.containers_per_host == processes
    objs = render.objects(rc)
    (svc,) = [o for o in objs if o["kind"] == "Service"]
    sel = svc["spec"]["selector"]
    assert (
        sel["jobset.sigs.k8s.io/job-index"] == "0" and sel["batch.kubernetes.io/job-completion-index"] == "0"
    )
    assert sel["jobset.sigs.k8s.io/jobset-name"] == rc.job_set_name and sel["rljob.dev/role"] == "trainer"
    js = objs[-1]
    (trainer_job,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == naming.TRAINER]
    assert trainer_job["replicas"] == rc.trainer.slices
    assert trainer_job["template"]["spec"]["completions"] == rc.trainer.tpu.hosts
    first = trainer_job["template"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "api", "containerPort": 8080, "protocol": "TCP"} in first["ports"]
    # the pod the Service selects (slice 0, host 0) runs process 0 in its first container
    env = {e["name"]: str(e.get("value", "")) for e in first["env"]}
    env.update({topology.JOB_INDEX_ENV: "0", topology.COMPLETION_INDEX_ENV: "0"})
    top = topology.process_topology(env)
    assert (top.process_id, top.num_processes) == (0, processes)
