"""Pod overrides (spec.trainer.template / spec.sampler.template): merged into the rendered pods, and every
override that would break the TPU placement or rljob's own wiring refused with its field named."""

from __future__ import annotations

import copy
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.recipes import manifest, objects, problems
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rljob.recipes import overrides, podpolicy, render
from rljob.recipes.api import RLJob

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen3-8b-v5p-spot-gcsfuse.yaml"
RLJOB = Path(sys.executable).parent / "rljob"

HF_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
GCS_VOLUME = {
    "name": "data",
    "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {"bucketName": "b"}},
}
GOOD: dict[str, Any] = {
    "metadata": {"labels": {"team": "rl"}, "annotations": {"gke-gcsfuse/volumes": "true"}},
    "spec": {
        "env": [HF_ENV, {"name": "WANDB_PROJECT", "value": "rl"}],
        "envFrom": [{"prefix": "WANDB_", "secretRef": {"name": "wandb"}}],
        "volumes": [GCS_VOLUME, {"name": "scratch", "emptyDir": {}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
        "resources": {"requests": {"memory": "64Gi"}, "limits": {"cpu": "100", "ephemeral-storage": "100Gi"}},
        "tolerations": [{"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true"}],
        "nodeSelector": {"cloud.google.com/gke-spot": "true"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "cloud.google.com/reservation-name", "operator": "Exists"}
                            ]
                        }
                    ]
                }
            }
        },
        "serviceAccountName": "rl-wi",
    },
}


def _pod(js: dict[str, Any], role: str) -> dict[str, Any]:
    rj = next(r for r in js["spec"]["replicatedJobs"] if r["name"] == role)
    pod: dict[str, Any] = rj["template"]["spec"]["template"]
    return pod


def test_overrides_are_merged_into_the_role_and_only_it() -> None:
    # serviceAccountName rl-wi: a ServiceAccount the operator's pod policy allows (rljob.recipes.podpolicy).
    policy = podpolicy.PodPolicy(service_accounts=("rl-wi",))
    objs = render.render(RLJob.model_validate(manifest({"trainer": {"template": GOOD}})), policy)
    js = objs[-1]
    pod, sampler = _pod(js, "trainer"), _pod(js, "sampler")
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert pod["metadata"]["labels"]["rljob.dev/role"] == "trainer"
    assert pod["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "rl-wi"
    assert spec["nodeSelector"] == {
        "cloud.google.com/gke-spot": "true",
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x2x1",
    }
    assert [t["key"] for t in spec["tolerations"]] == ["google.com/tpu", "cloud.google.com/gke-spot"]
    assert spec["affinity"] == GOOD["spec"]["affinity"]
    assert [v["name"] for v in spec["volumes"]] == ["run-config", "dshm", "rljob-cache", "data", "scratch"]
    # the template's ephemeral-storage (here a limit, which sets the request) sizes rljob's cache volume too
    assert spec["volumes"][2]["emptyDir"] == {"sizeLimit": "100Gi"}
    (c,) = spec["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["HF_TOKEN"] == HF_ENV and env["RLJOB_CONFIG"]["value"] == "/etc/rljob/run.json"
    assert [e["name"] for e in c["env"]][-2:] == ["HF_TOKEN", "WANDB_PROJECT"]  # after rljob's
    assert c["envFrom"] == [{"prefix": "WANDB_", "secretRef": {"name": "wandb"}}]
    assert c["volumeMounts"][-1] == {"name": "data", "mountPath": "/data", "readOnly": True}
    assert c["resources"] == {
        # the user's memory request wins over the 4Gi floor; a limit without a request sets it
        "requests": {"cpu": "100", "memory": "64Gi", "ephemeral-storage": "100Gi", "google.com/tpu": 4},
        "limits": {"cpu": "100", "ephemeral-storage": "100Gi", "google.com/tpu": 4},
    }
    # The trainer's own ServiceAccount keeps the progress ConfigMap.
    binding = next(o for o in objs if o["kind"] == "RoleBinding")
    assert [s["name"] for s in binding["subjects"]] == ["t-rljob", "rl-wi"]
    # The sampler is untouched.
    assert "annotations" not in sampler["metadata"] and sampler["spec"]["serviceAccountName"] == "t-rljob"
    assert "envFrom" not in sampler["spec"]["containers"][0]


def test_two_containers_per_host_each_get_the_container_fields() -> None:
    doc = manifest({"trainer": {"tpu": "tpu7x-8", "template": {"spec": {"env": [HF_ENV]}}}})
    containers = _pod(objects(doc)[-1], "trainer")["spec"]["containers"]
    assert len(containers) == 2
    assert all(c["env"][-1] == HF_ENV for c in containers)


def test_without_a_template_nothing_changes() -> None:
    plain = objects(manifest({}))
    empty = objects(manifest({"trainer": {"template": {}}, "sampler": {"template": {"spec": {}}}}))
    # The run config (objects[3]) differs: it holds spec.
    assert render.to_yaml(plain[:3] + plain[4:-1]) == render.to_yaml(empty[:3] + empty[4:-1])
    assert plain[-1] == empty[-1]


def test_rendered_env_names_are_all_reserved() -> None:
    """RESERVED_ENV is the render's own list: every name any example or service render sets is in it."""
    docs = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "examples").glob("*.yaml"))]
    docs.append(manifest({"trainer": {"tpu": "v5p-16", "slices": 2}}))
    for doc in docs:
        for role in ("trainer", "sampler"):
            for c in _pod(objects(doc)[-1], role)["spec"]["containers"]:
                user = {e["name"] for e in overrides.env(None)}
                for e in c["env"]:
                    if e["name"] not in ("HF_TOKEN",) and e["name"] not in user:
                        reserved = overrides.RESERVED_ENV | (
                            overrides.TRAINER_RESERVED_ENV if role == "trainer" else set()
                        )
                        assert e["name"] in reserved or e["name"].startswith(
                            overrides.RESERVED_ENV_PREFIXES
                        ), e["name"]


BAD: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "tpu-node-selector",
        {"spec": {"nodeSelector": {"cloud.google.com/gke-tpu-topology": "2x2x2"}}},
        ['spec.trainer.template.spec.nodeSelector["cloud.google.com/gke-tpu-topology"]: the TPU node pool'],
    ),
    (
        "tpu-affinity",
        {
            "spec": {
                "affinity": {
                    "nodeAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "weight": 1,
                                "preference": {
                                    "matchExpressions": [
                                        {
                                            "key": "cloud.google.com/gke-tpu-accelerator",
                                            "operator": "In",
                                            "values": ["tpu7x"],
                                        }
                                    ]
                                },
                            }
                        ]
                    }
                }
            }
        },
        [
            "spec.trainer.template.spec.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
            ".preference.matchExpressions[0].key: cloud.google.com/gke-tpu-accelerator is chosen by"
        ],
    ),
    (
        "tpu-resources",
        {"spec": {"resources": {"limits": {"google.com/tpu": 8}, "requests": {"cpu": "8"}}}},
        ['spec.trainer.template.spec.resources.limits["google.com/tpu"]: the chips come from'],
    ),
    (
        "request-above-limit",
        {"spec": {"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "2000Mi"}}}},
        ["spec.trainer.template.spec.resources.requests.memory: 2Gi is above its limit 2000Mi"],
    ),
    (
        "reserved-env",
        {
            "spec": {
                "env": [{"name": "RLJOB_CONFIG", "value": "/x"}, {"name": "MEGASCALE_SLICE_ID", "value": "0"}]
            }
        },
        [
            "spec.trainer.template.spec.env[0].name: RLJOB_CONFIG is set by rljob",
            "spec.trainer.template.spec.env[1].name: MEGASCALE_SLICE_ID is set by rljob",
        ],
    ),
    (
        "env-twice-and-both-values",
        {
            "spec": {
                "env": [
                    {"name": "A", "value": "1"},
                    {"name": "A", "value": "2", **{"valueFrom": HF_ENV["valueFrom"]}},
                ]
            }
        },
        [
            "spec.trainer.template.spec.env[1].name: A is defined twice",
            "spec.trainer.template.spec.env[1]: value and valueFrom are exclusive",
        ],
    ),
    (
        "bad-value-from",
        {"spec": {"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "hf"}, "secretRef": {}}}]}},
        [
            'spec.trainer.template.spec.env[0].valueFrom.secretKeyRef: "key" is a required property',
            "spec.trainer.template.spec.env[0].valueFrom.secretRef: unknown field",
            "spec.trainer.template.spec.env[0].valueFrom: must name exactly one source",
        ],
    ),
    (
        "env-from-two-sources",
        {"spec": {"envFrom": [{"prefix": "A_", "secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]}},
        ["spec.trainer.template.spec.envFrom[0]: must name exactly one of configMapRef, secretRef"],
    ),
    (
        "reserved-volume-and-mount",
        {
            "spec": {
                "volumes": [{"name": "dshm", "emptyDir": {}}, {"name": "x", "emptyDir": {}, "secret": {}}],
                "volumeMounts": [
                    {"name": "x", "mountPath": "/etc/rljob"},
                    {"name": "nope", "mountPath": "/dev/shm/sub"},
                    {"name": "x", "mountPath": "/etc"},
                ],
            }
        },
        [
            "spec.trainer.template.spec.volumes[0].name: dshm is rljob's",
            "spec.trainer.template.spec.volumes[1]: must have exactly one volume source, has 2",
            "spec.trainer.template.spec.volumes[1].secret.secretName: required",
            "spec.trainer.template.spec.volumeMounts[0].mountPath: /etc/rljob overlaps rljob's",
            "spec.trainer.template.spec.volumeMounts[1].name: no volume nope in spec.trainer.template.spec",
            "spec.trainer.template.spec.volumeMounts[1].mountPath: /dev/shm/sub overlaps rljob's",
            "spec.trainer.template.spec.volumeMounts[2].mountPath: /etc overlaps rljob's",
            "spec.trainer.template.spec.volumeMounts[0].mountPath: /etc/rljob is not under an allowed",
            "spec.trainer.template.spec.volumeMounts[1].mountPath: /dev/shm/sub is not under an allowed",
            "spec.trainer.template.spec.volumeMounts[2].mountPath: /etc is not under an allowed mount root",
        ],
    ),
    (
        "volume-typo",
        {"spec": {"volumes": [{"name": "d", "csi": {"drivr": "gcsfuse.csi.storage.gke.io"}}]}},
        [
            "spec.trainer.template.spec.volumes[0].csi.drivr: unknown field",
            'spec.trainer.template.spec.volumes[0].csi: "driver" is a required property',
        ],
    ),
    (
        "gcsfuse-without-annotation",
        {"spec": {"volumes": [GCS_VOLUME]}},
        [
            "spec.trainer.template.metadata.annotations: a gcsfuse.csi.storage.gke.io volume needs "
            'gke-gcsfuse/volumes: "true"'
        ],
    ),
    (
        "reserved-labels",
        {
            "metadata": {
                "labels": {"rljob.dev/role": "x", "jobset.sigs.k8s.io/job-index": "1", "ok": "bad value"}
            }
        },
        [
            'spec.trainer.template.metadata.labels["rljob.dev/role"]: set by rljob, JobSet or Job',
            'spec.trainer.template.metadata.labels["jobset.sigs.k8s.io/job-index"]: set by rljob',
            "spec.trainer.template.metadata.labels.ok: must be a label value",
        ],
    ),
    (
        "bad-label-key",
        {"metadata": {"annotations": {"-bad": "x"}}},
        ["spec.trainer.template.metadata.annotations.-bad: must be a qualified name"],
    ),
    (
        "toleration-exists-with-value",
        {"spec": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v", "tolerationSeconds": 5}]}},
        [
            "spec.trainer.template.spec.tolerations[0].value: must be empty with operator Exists",
            "spec.trainer.template.spec.tolerations[0].tolerationSeconds: only read with effect NoExecute",
        ],
    ),
]


@pytest.mark.parametrize(("name", "template", "expected"), BAD, ids=[b[0] for b in BAD])
def test_bad_overrides_are_refused_with_the_field(
    name: str, template: dict[str, Any], expected: list[str]
) -> None:
    got = problems(manifest({"trainer": {"template": template}}))
    assert len(got) == len(expected), got
    for prefix in expected:  # each expected line once, in any order
        assert sum(line.startswith(prefix) for line in got) == 1, (prefix, got)


def test_every_problem_at_once_across_roles() -> None:
    doc = manifest(
        {
            "trainer": {
                "template": {"spec": {"nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu7x"}}}
            },
            "sampler": {"template": {"spec": {"env": [{"name": "POD_NAME", "value": "x"}]}}},
            "lora": {"rank": 3},
        }
    )
    got = problems(doc)
    assert any(p.startswith("spec.lora.rank") for p in got)
    assert any(
        p.startswith('spec.trainer.template.spec.nodeSelector["cloud.google.com/gke-tpu-accelerator"]')
        for p in got
    )
    assert any(p.startswith("spec.sampler.template.spec.env[0].name: POD_NAME") for p in got)


@pytest.mark.parametrize(
    ("template", "field"),
    [
        ({"spec": {"hostNetwork": True}}, "spec.trainer.template.spec.hostNetwork: unknown field"),
        (
            {"spec": {"resources": {"requests": {"cpu": "lots"}}}},
            "spec.trainer.template.spec.resources.requests.cpu",
        ),
        ({"spec": {"serviceAccountName": "Bad_SA"}}, "spec.trainer.template.spec.serviceAccountName"),
        ({"spec": {"env": [{"name": "1 x"}]}}, "spec.trainer.template.spec.env[0].name"),
    ],
)
def test_typed_fields_are_refused_at_parse(template: dict[str, Any], field: str) -> None:
    got = problems(manifest({"trainer": {"template": template}}))
    assert any(p.startswith(field) for p in got), got


def test_the_gke_example_renders_and_validates() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    js = objects(doc)[-1]
    trainer, sampler = _pod(js, "trainer"), _pod(js, "sampler")
    for pod in (trainer, sampler):
        assert pod["spec"]["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
        assert any(t["key"] == "cloud.google.com/gke-spot" for t in pod["spec"]["tolerations"])
        assert any(
            e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "hf-token"
            for e in pod["spec"]["containers"][0]["env"]
        )
    assert trainer["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    assert trainer["spec"]["volumes"][-1]["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    proc = subprocess.run([str(RLJOB), "validate", "-f", str(EXAMPLE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    explained = subprocess.run(
        [str(RLJOB), "plan", "-f", str(EXAMPLE)], capture_output=True, text=True
    ).stdout
    assert (
        "trainer pod overrides: labels team; annotations gke-gcsfuse/volumes; env HF_TOKEN (Secret "
        "hf-token/token); volumes prompts (csi); mounts /data; nodeSelector cloud.google.com/gke-spot=true; "
        "tolerations cloud.google.com/gke-spot\n"
    ) in explained
    # A deliberately broken copy (the FUSE annotation dropped, the TPU topology pinned) is refused, exit 2.
    broken = copy.deepcopy(doc)
    del broken["spec"]["trainer"]["template"]["metadata"]["annotations"]
    broken["spec"]["sampler"]["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] = (
        "2x2x2"
    )
    proc = subprocess.run(
        [str(RLJOB), "validate", "-f", "-"], input=yaml.safe_dump(broken), capture_output=True, text=True
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert any("spec.trainer.template.metadata.annotations: a gcsfuse" in line for line in lines), lines
    assert any(
        'spec.sampler.template.spec.nodeSelector["cloud.google.com/gke-tpu-topology"]' in line
        for line in lines
    )
    assert "Traceback" not in proc.stderr


_QUANTITIES = [
    ("1", 1),
    ("500m", Decimal("0.5")),
    ("4Gi", 4 << 30),
    ("2G", 2 * 10**9),
    ("1e3", 1000),
    ("1.5Ki", 1536),
    (7, 7),
]


@pytest.mark.parametrize(("text", "value"), _QUANTITIES)
def test_quantity(text: str | int, value: Decimal | int) -> None:
    assert overrides.quantity(text) == value


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(["", "k", "Ki", "M", "Mi", "G", "Gi", "m"]))
def test_quantity_orders_as_kubernetes(n: int, suffix: str) -> None:
    q = overrides.quantity(f"{n}{suffix}")
    assert q == n * overrides._SUFFIX[suffix]
    assert overrides.quantity(f"{n + 1}{suffix}") > q


_keys = st.sampled_from(
    [
        "name",
        "csi",
        "driver",
        "secret",
        "secretName",
        "emptyDir",
        "key",
        "valueFrom",
        "secretKeyRef",
        "",
        "x y",
    ]
)
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from(["", "a", "dshm", "/etc/rljob", "Exists"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
    max_leaves=8,
)


_volume = st.fixed_dictionaries(
    {"name": st.sampled_from(["a", "b", "dshm", "Bad"])},
    optional={
        "emptyDir": st.just({}) | st.fixed_dictionaries({"sizeLimit": st.sampled_from(["1Gi", "x"])}),
        "secret": st.fixed_dictionaries({"secretName": st.sampled_from(["hf", ""])}),
        "csi": st.fixed_dictionaries({"driver": st.sampled_from(["gcsfuse.csi.storage.gke.io", "d"])}),
    },
)
_value_from = st.fixed_dictionaries(
    {},
    optional={"secretKeyRef": st.fixed_dictionaries({"name": st.just("hf")}, optional={"key": st.just("t")})},
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    volumes=st.lists(_volume | st.dictionaries(_keys, _json, max_size=3), max_size=2),
    value_from=st.none() | _value_from | st.dictionaries(_keys, _json, max_size=2),
    affinity=st.just({}) | st.dictionaries(st.sampled_from(["nodeAffinity", "podAffinity", "bogus"]), _json),
    env_from=st.just([])
    | st.just([{"secretRef": {"name": "hf"}}])
    | st.lists(st.dictionaries(st.sampled_from(["secretRef", "configMapRef", "prefix"]), _json), max_size=2),
)
def test_free_form_overrides_are_refused_or_render_valid(
    volumes: list[dict[str, Any]],
    value_from: dict[str, Any] | None,
    affinity: dict[str, Any],
    env_from: list[Any],
) -> None:
    """Whatever the free-form parts hold, the plan refuses them with `spec.` lines or the render passes
    JobSet's schema (a RenderError would be a bug: an override the plan let through that breaks the pod)."""
    template = {
        "spec": {
            "volumes": volumes,
            "env": [] if value_from is None else [{"name": "X", "valueFrom": value_from}],
            "affinity": affinity,
            "envFrom": env_from,
        }
    }
    doc = manifest({"trainer": {"template": template}})
    got = problems(doc)
    if got:
        event("refused")
        assert all(line.startswith(("spec.", "(root)")) and "\n" not in line for line in got), got
    else:
        event("rendered")
        objects(doc)  # raises RenderError if the JobSet were invalid


def test_the_tinker_tls_names_are_the_templates_and_other_rljob_names_are_not() -> None:
    """docs/tinker.md gives the service its certificate through spec.trainer.template env: those two RLJOB_*
    names pass (they were refused with every RLJOB_* name), the rest of the prefix stays rljob's."""
    env = [
        {"name": name, "valueFrom": {"secretKeyRef": {"name": "tinker-api-tls", "key": key}}}
        for name, key in (("RLJOB_TINKER_TLS_CERT", "tls.crt"), ("RLJOB_TINKER_TLS_KEY", "tls.key"))
    ]
    assert not problems(manifest({"trainer": {"template": {"spec": {"env": env}}}}))
    found = problems(
        manifest({"trainer": {"template": {"spec": {"env": [{"name": "RLJOB_CONFIG", "value": "x"}]}}}})
    )
    assert found == [
        "spec.trainer.template.spec.env[0].name: RLJOB_CONFIG is set by rljob (the run's own coordinates)"
    ]
