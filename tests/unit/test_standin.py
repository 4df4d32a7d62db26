"""tests/fixtures/standin.py without a cluster: a pod's container environment resolved as the kubelet does
and the run config's endpoints moved to 127.0.0.1 (what `make demo` gives its local processes)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import yaml
from fixtures.k8s import pod_spec
from fixtures.standin import PodSpecError, container_env, field_ref, local_run_config
from kubernetes import client


class StubCore:
    """The two reads container_env makes, from dicts."""

    def __init__(self, config_maps: dict[str, dict[str, str]], secrets: dict[str, dict[str, str]]) -> None:
        self.config_maps, self.secrets = config_maps, secrets

    def read_namespaced_config_map(self, name: str, namespace: str) -> client.V1ConfigMap:
        return client.V1ConfigMap(data=self.config_maps[name])

    def read_namespaced_secret(self, name: str, namespace: str) -> client.V1Secret:
        data = {k: base64.b64encode(v.encode()).decode() for k, v in self.secrets[name].items()}
        return client.V1Secret(data=data)


def _pod(env: list[client.V1EnvVar], env_from: list[client.V1EnvFromSource] | None = None) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name="job-trainer-0-0-abcde",
            namespace="ns1",
            uid="u-1",
            labels={"jobset.sigs.k8s.io/job-index": "0"},
            annotations={"batch.kubernetes.io/job-completion-index": "1"},
        ),
        spec=client.V1PodSpec(
            containers=[client.V1Container(name="trainer", env=env, env_from=env_from)],
            node_name="node-a",
            service_account_name="job-rljob",
        ),
        status=client.V1PodStatus(pod_ip="10.0.0.9"),
    )


def _field(path: str) -> client.V1EnvVarSource:
    return client.V1EnvVarSource(field_ref=client.V1ObjectFieldSelector(field_path=path))


def test_container_env_resolves_like_the_kubelet() -> None:
    env = [
        client.V1EnvVar(name="PLAIN", value="v"),
        client.V1EnvVar(name="EMPTY"),
        client.V1EnvVar(name="POD_NAME", value_from=_field("metadata.name")),
        client.V1EnvVar(
            name="JOB_INDEX", value_from=_field("metadata.labels['jobset.sigs.k8s.io/job-index']")
        ),
        client.V1EnvVar(
            name="JOB_COMPLETION_INDEX",
            value_from=_field("metadata.annotations['batch.kubernetes.io/job-completion-index']"),
        ),
        client.V1EnvVar(name="MISSING_LABEL", value_from=_field("metadata.labels['nope']")),
        client.V1EnvVar(name="NODE", value_from=_field("spec.nodeName")),
        client.V1EnvVar(name="IP", value_from=_field("status.podIP")),
        client.V1EnvVar(
            name="FROM_CM",
            value_from=client.V1EnvVarSource(
                config_map_key_ref=client.V1ConfigMapKeySelector(name="cm", key="k")
            ),
        ),
        client.V1EnvVar(
            name="TOKEN",
            value_from=client.V1EnvVarSource(secret_key_ref=client.V1SecretKeySelector(name="s", key="hf")),
        ),
        client.V1EnvVar(
            name="OPTIONAL_ABSENT",
            value_from=client.V1EnvVarSource(
                config_map_key_ref=client.V1ConfigMapKeySelector(name="cm", key="absent", optional=True)
            ),
        ),
        client.V1EnvVar(name="A_SHARED", value="explicit env wins"),
    ]
    env_from = [
        client.V1EnvFromSource(config_map_ref=client.V1ConfigMapEnvSource(name="bulk"), prefix="A_"),
        client.V1EnvFromSource(secret_ref=client.V1SecretEnvSource(name="s")),
    ]
    core = StubCore(
        {"cm": {"k": "from-cm"}, "bulk": {"SHARED": "from-envFrom", "ONLY": "o"}}, {"s": {"hf": "t0k"}}
    )
    got = container_env(core, _pod(env, env_from), pod_spec(_pod(env, env_from)).containers[0])  # type: ignore[arg-type]
    assert got == {
        "A_SHARED": "explicit env wins",
        "A_ONLY": "o",
        "hf": "t0k",
        "PLAIN": "v",
        "EMPTY": "",
        "POD_NAME": "job-trainer-0-0-abcde",
        "JOB_INDEX": "0",
        "JOB_COMPLETION_INDEX": "1",
        "MISSING_LABEL": "",
        "NODE": "node-a",
        "IP": "10.0.0.9",
        "FROM_CM": "from-cm",
        "TOKEN": "t0k",
    }


def test_unsupported_references_are_named() -> None:
    with pytest.raises(PodSpecError, match=r"fieldRef spec\.hostname"):
        field_ref(_pod([]), "spec.hostname")
    env = [
        client.V1EnvVar(
            name="X",
            value_from=client.V1EnvVarSource(
                config_map_key_ref=client.V1ConfigMapKeySelector(name="cm", key="no")
            ),
        )
    ]
    with pytest.raises(PodSpecError, match="env X: configMap cm has no key no"):
        container_env(StubCore({"cm": {}}, {}), _pod(env), pod_spec(_pod(env)).containers[0])  # type: ignore[arg-type]


def test_local_run_config_moves_only_the_endpoints() -> None:
    from rljob.local.localrun import LOCAL_MANIFEST
    from rljob.recipes import render
    from rljob.recipes.plan import parse_manifest, resolve

    manifest: dict[str, Any] = json.loads(json.dumps(LOCAL_MANIFEST))
    rc = resolve(parse_manifest(yaml.safe_dump(manifest)))
    cm = next(o for o in render.objects(rc) if o["kind"] == "ConfigMap")
    text = cm["data"]["run.json"]
    before, after = json.loads(text), json.loads(local_run_config(text, [4001], 4002))
    assert after["endpoints"] == {"samplers": ["http://127.0.0.1:4001"], "coordinator": "127.0.0.1:4002"}
    assert before["endpoints"]["samplers"][0].startswith("http://rl-cpu-sampler-0-0.")
    assert {k: v for k, v in after.items() if k != "endpoints"} == {
        k: v for k, v in before.items() if k != "endpoints"
    }
    with pytest.raises(PodSpecError, match=r"endpoints\.samplers: 1 samplers, 2 local ports"):
        local_run_config(text, [1, 2], 3)
