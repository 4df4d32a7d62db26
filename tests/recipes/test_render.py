"""The rendered objects: JobSet webhook defaults written out, roles, env, placement, run ConfigMap."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.recipes import manifest, objects, recipe_manifest, resolve
from rljob.recipes import plan, podpolicy, render
from rljob.recipes.api import RLJob, Toleration
from rljob.recipes.runconfig import RunConfig


def _webhook_default(js: dict[str, Any]) -> dict[str, Any]:
    """JobSet v0.11.0's defaulting webhook (pkg/webhooks/jobset_webhook.go Default) plus the CRD's
    schema defaults, ported: applied to our render it must change nothing."""
    js = copy.deepcopy(js)
    spec = js["spec"]
    spec.setdefault("successPolicy", {"operator": "All"})
    spec.setdefault("startupPolicy", {"startupPolicyOrder": "AnyOrder"})
    for rj in spec["replicatedJobs"]:
        rj.setdefault("replicas", 1)
        rj.setdefault("groupName", "default")
        rj["template"]["spec"].setdefault("completionMode", "Indexed")
        rj["template"]["spec"]["template"]["spec"].setdefault("restartPolicy", "OnFailure")
    net = spec.setdefault("network", {})
    net.setdefault("enableDNSHostnames", True)
    net.setdefault("publishNotReadyAddresses", True)
    if "failurePolicy" in spec:
        spec["failurePolicy"].setdefault("restartStrategy", "Recreate")
        for i, rule in enumerate(spec["failurePolicy"].get("rules", [])):
            rule.setdefault("name", f"failurePolicyRule{i}")
    return js


def _role(js: dict[str, Any], name: str) -> dict[str, Any]:
    return next(rj for rj in js["spec"]["replicatedJobs"] if rj["name"] == name)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize(
    "doc",
    [
        manifest({}),
        recipe_manifest("qwen3.5-397b-a17b-tpu7x"),
        manifest({"trainer": {"tpu": "v5p-16", "slices": 2}}),
    ],
    ids=["minimal", "397b", "multislice"],
)
def test_webhook_defaults_written_out(doc: dict[str, Any]) -> None:
    js = objects(doc)[-1]
    assert _webhook_default(js) == js
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    assert js["spec"]["coordinator"] == {"replicatedJob": "trainer", "jobIndex": 0, "podIndex": 0}


def test_roles_single_slice() -> None:
    js = objects(manifest({"sampler": {"replicas": 3}}))[-1]
    trainer, sampler = _role(js, "trainer"), _role(js, "sampler")
    t = trainer["template"]["spec"]
    assert (trainer["replicas"], t["parallelism"], t["completions"], t["backoffLimit"]) == (1, 1, 1, 0)
    assert sampler["replicas"] == 3
    for rj in (trainer, sampler):
        assert rj["template"]["metadata"]["annotations"] == {
            "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
        }
        pod = rj["template"]["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        assert pod["nodeSelector"] == {
            "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
            "cloud.google.com/gke-tpu-topology": "2x2x1",
        }
        assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert [c["resources"]["limits"] for c in pod["containers"]] == [{"google.com/tpu": 4}]
        assert "hostNetwork" not in pod
    tc = trainer["template"]["spec"]["template"]["spec"]["containers"][0]
    env = _env(tc)
    assert env["RLJOB_CONFIG"] == "/etc/rljob/run.json" and env["RLJOB_ROLE"] == "trainer"
    assert env["JAX_COORDINATOR_ADDRESS"] == "t-trainer-0-0.t:8482"
    assert not any(k.startswith("MEGASCALE_") for k in env)
    sc = sampler["template"]["spec"]["template"]["spec"]["containers"][0]
    assert sc["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # The console scripts of pyproject [project.scripts], reading the mounted run config.
    assert sc["command"] == ["rljob-sampler", "--config", "/etc/rljob/run.json"]
    assert tc["command"] == ["rljob-trainer", "--config", "/etc/rljob/run.json"]


def test_multislice_trainer() -> None:
    js = objects(manifest({"trainer": {"tpu": "v5p-16", "slices": 2}}))[-1]
    trainer = _role(js, "trainer")
    assert (trainer["replicas"], trainer["template"]["spec"]["parallelism"]) == (2, 2)
    pod = trainer["template"]["spec"]["template"]["spec"]
    # The pod network, as for one slice: host-network pods would not get the ServiceAccount's Workload
    # Identity on GKE (the bucket grant of docs/gke.md).
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    assert pod["serviceAccountName"] == "t-rljob"
    env = _env(pod["containers"][0])
    ann = "metadata.annotations['jobset.sigs.k8s.io/{}']"
    assert env["MEGASCALE_NUM_SLICES"] == {"fieldRef": {"fieldPath": ann.format("replicatedjob-replicas")}}
    assert env["MEGASCALE_SLICE_ID"] == {"fieldRef": {"fieldPath": ann.format("job-index")}}
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == {"fieldRef": {"fieldPath": ann.format("coordinator")}}
    sampler_env = _env(_role(js, "sampler")["template"]["spec"]["template"]["spec"]["containers"][0])
    assert not any(k.startswith("MEGASCALE_") for k in sampler_env)


def test_tpu7x_two_containers() -> None:
    js = objects(recipe_manifest("qwen3.5-397b-a17b-tpu7x"))[-1]
    pod = _role(js, "trainer")["template"]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["trainer-0", "trainer-1"]
    assert [c["resources"]["limits"] for c in pod["containers"]] == [{"google.com/tpu": 2}] * 2
    assert [_env(c)["RLJOB_CONTAINER_INDEX"] for c in pod["containers"]] == ["0", "1"]
    assert [len(c["ports"]) for c in pod["containers"]] == [1, 0]  # one coordinator port per pod
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4x8"
    assert _role(js, "trainer")["template"]["spec"]["parallelism"] == 32
    sampler = _role(js, "sampler")["template"]["spec"]
    assert (
        sampler["parallelism"] == 2 and len(sampler["template"]["spec"]["containers"]) == 1
    )  # tpu7x-16: 2 hosts


def test_run_configmap_holds_the_plan() -> None:
    doc = manifest({"queueName": "team-a", "priorityClassName": "high", "suspend": True})
    (cm,), js = [o for o in objects(doc) if o["kind"] == "ConfigMap"], objects(doc)[-1]
    assert (cm["kind"], cm["metadata"]["name"], list(cm["data"])) == ("ConfigMap", "t-run", ["run.json"])
    run = RunConfig.model_validate(json.loads(cm["data"]["run.json"]))
    assert run == RunConfig.model_validate_json(resolve(doc).model_dump_json(exclude_none=True))
    vol = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"][0]
    assert vol == {"name": "run-config", "configMap": {"name": "t-run"}}
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert js["spec"]["suspend"] is True
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert (pod["priorityClassName"], pod["serviceAccountName"]) == ("high", "t-rljob")


def test_values_cannot_break_the_yaml() -> None:
    """Every value goes through tojson: free text with YAML syntax (the strings the API lets through: a
    prompt template, a MaxText value) stays one string in run.json, and the YAML stream still parses."""
    import yaml

    template = "img: {{a: [1]}}\n- x # {question}\n---\n"
    maxtext = {"remat_policy": "p: q"}
    doc = manifest({"dataset": {"promptTemplate": template}, "trainer": {"maxtext": maxtext}})
    objs = objects(doc)
    run = json.loads(objs[3]["data"]["run.json"])
    assert run["spec"]["dataset"]["promptTemplate"] == template
    assert run["trainer"]["maxtext"]["remat_policy"] == "p: q"
    assert list(yaml.safe_load_all(render.to_yaml(objs))) == objs


def test_pods_identity_is_rendered_with_least_privilege() -> None:
    """`rljob render | kubectl apply` alone starts pods: their ServiceAccount and its progress RBAC are
    part of the render (the operator applies the same objects)."""
    sa, role, binding, _cm, _netpol, js = objects(manifest({}))
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert (sa["kind"], sa["metadata"]["name"]) == ("ServiceAccount", pod["serviceAccountName"])
    assert role["kind"] == "Role" and role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["t-progress"],
            "verbs": ["get", "patch"],
        }
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "t-rljob", "namespace": sa["metadata"]["namespace"]}
    ]


@pytest.mark.parametrize(
    ("doc", "multi_host"),
    [(manifest({}), False), (manifest({"sampler": {"tpu": "v5p-16", "replicas": 2}}), True)],
    ids=["single-host sampler", "multi-host sampler"],
)
def test_every_container_takes_the_runs_token_from_its_credentials_secret(
    doc: dict[str, Any], multi_host: bool
) -> None:
    """The run's token (the Secret `<rljob>-credentials` the operator creates) reaches every trainer and
    sampler container as RLJOB_RUN_TOKEN; a multi-host replica's Ray nodes also get Ray's token
    authentication (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN from the same Secret)."""
    from rljob.recipes.runconfig import RUN_TOKEN_ENV

    js = objects(doc)[-1]
    token = {"secretKeyRef": {"name": "t-credentials", "key": "token"}}
    for name in ("trainer", "sampler"):
        for c in _role(js, name)["template"]["spec"]["template"]["spec"]["containers"]:
            env = _env(c)
            assert env[RUN_TOKEN_ENV] == token, name
            ray = {k: env.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
            on = name == "sampler" and multi_host
            assert ray == ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token} if on else dict.fromkeys(ray))
    # The render holds no Secret (the token is the operator's, random per run): only references to it.
    assert not [o for o in objects(doc) if o["kind"] == "Secret"]


def _restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The Pod Security Standards' `restricted` checks (https://kubernetes.io/docs/concepts/security/
    pod-security-standards/) that apply to a rendered pod: host namespaces, privileged, capabilities,
    volume types, privilege escalation, non-root, seccomp."""
    out = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(field)
    psc = pod.get("securityContext") or {}
    for c in pod["containers"]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []) or set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities")
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")) or 0 in (
            sc.get("runAsUser"),
            psc.get("runAsUser"),
        ):
            out.append(f"{name}: runAsNonRoot")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{name}: hostPort")
    allowed = {
        "configMap",
        "emptyDir",
        "projected",
        "secret",
        "downwardAPI",
        "persistentVolumeClaim",
        "ephemeral",
        "csi",
    }
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= allowed:
            out.append(f"volume {v['name']}: {sorted(kinds - allowed)}")
    return out


@pytest.mark.parametrize(
    "spec",
    [{}, {"trainer": {"tpu": "tpu7x-16"}}, {"trainer": {"slices": 2}}],
    ids=["v5p single slice", "tpu7x two containers", "two slices"],
)
def test_pods_meet_the_restricted_profile_but_for_the_named_exception(spec: dict[str, Any]) -> None:
    """Every rendered pod passes `restricted` but for the one exception rljob.recipes.podspec names: its
    TPU containers run as the images' user, root (no runAsNonRoot). The sampler gets no API token; /dev/shm
    is bounded; every TPU container requests a CPU and memory floor, its share of the cache disk and its
    chips, limits only its chips; a failed container's log tail becomes its termination message."""
    js, run = objects(manifest(spec))[-1], resolve(manifest(spec))
    for rj in js["spec"]["replicatedJobs"]:
        pod = rj["template"]["spec"]["template"]["spec"]
        violations = _restricted_violations(pod)
        assert violations == [f"{c['name']}: runAsNonRoot" for c in pod["containers"]], (
            rj["name"],
            violations,
        )
        assert pod["automountServiceAccountToken"] is (rj["name"] == "trainer")
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"] == {
            "medium": "Memory",
            "sizeLimit": {"trainer": "8Gi", "sampler": "32Gi"}[rj["name"]],
        }
        for c in pod["containers"]:
            res = c["resources"]
            chips = res["limits"]["google.com/tpu"]
            disk = (run.trainer if rj["name"] == "trainer" else run.sampler).cache_disk
            assert res == {
                "requests": {
                    "cpu": "1",
                    "memory": "4Gi",
                    "ephemeral-storage": disk.request,
                    "google.com/tpu": chips,
                },
                "limits": {"google.com/tpu": chips},
            }
            assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_the_preflight_job_is_the_trainer_pod_without_the_tpu() -> None:
    """spec.trainer.preflight.compile: the trainer template's env, volumes, mounts, annotations and
    ServiceAccount reach the preflight pod (its storage credentials); its TPU, node selector and tolerations
    do not: the pod goes where the operator's pod policy says (by default, nodes that run the GKE metadata
    server), and a policy's placement does not change what the digest names."""
    path = Path(__file__).resolve().parents[2] / "examples" / "qwen3-8b-v5p-spot-gcsfuse.yaml"
    doc = yaml.safe_load(path.read_text())
    assert render.preflight_job(resolve(doc)) is None  # off by default
    doc["spec"]["trainer"]["preflight"] = {"compile": True, "memory": "12Gi"}
    run = resolve(doc)
    job = render.preflight_job(run)
    assert job is not None and [o["kind"] for o in render.objects(run)][-2:] == ["Job", "JobSet"]
    pod = job["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    js = render.jobset(run)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    (trainer,) = js["spec"]["containers"]
    assert c["image"] == trainer["image"] and c["securityContext"] == trainer["securityContext"]
    assert pod["spec"]["securityContext"] == js["spec"]["securityContext"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in c[
        "env"
    ]
    assert {"name": "prompts", "mountPath": "/data", "readOnly": True} in c["volumeMounts"]
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["run-config", "rljob-cache", "prompts"]
    assert pod["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    assert pod["spec"]["serviceAccountName"] == js["spec"]["serviceAccountName"]
    assert pod["spec"]["nodeSelector"] == {podpolicy.METADATA_SERVER_LABEL: "true"}
    assert "tolerations" not in pod["spec"]
    policy = podpolicy.PodPolicy(
        preflight_node_selector={"cloud.google.com/gke-nodepool": "compile"},
        preflight_tolerations=(
            Toleration(key="dedicated", operator="Equal", value="compile", effect="NoSchedule"),
        ),
    )
    placed = render.preflight_job(plan.resolve(RLJob.model_validate(doc), policy))
    assert placed is not None and placed["metadata"]["name"] == job["metadata"]["name"]
    assert placed["spec"]["template"]["spec"]["nodeSelector"] == {"cloud.google.com/gke-nodepool": "compile"}
    assert placed["spec"]["template"]["spec"]["tolerations"] == [
        {"key": "dedicated", "operator": "Equal", "value": "compile", "effect": "NoSchedule"}
    ]
    assert (
        c["resources"]["limits"] == {"memory": "12Gi"} and "google.com/tpu" not in c["resources"]["requests"]
    )
    # The digest names what is compiled: suspend and queueName do not change it, a MaxText key does.
    name = job["metadata"]["name"]
    same = copy.deepcopy(doc)
    same["spec"].update(suspend=True, queueName="q")
    assert render.preflight_job(resolve(same))["metadata"]["name"] == name  # type: ignore[index]
    other = copy.deepcopy(doc)
    other["spec"]["trainer"]["maxtext"] = {"remat_policy": "full"}
    assert render.preflight_job(resolve(other))["metadata"]["name"] != name  # type: ignore[index]
