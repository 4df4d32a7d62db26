"""The operator's pod policy (rljob.recipes.podpolicy): what the default refuses, what a policy allows, and
the same policy read from the chart's values, the operator's environment and `rljob validate --pod-policy`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.recipes import manifest, objects, problems
from rljob.operator.config import OperatorConfig
from rljob.recipes import plan, podpolicy
from rljob.recipes.api import RLJob

REPO = Path(__file__).resolve().parents[2]
RLJOB = Path(sys.executable).parent / "rljob"
SA_TOKEN = {"serviceAccountToken": {"path": "token", "audience": "api"}}


def _t(spec: dict[str, Any], role: str = "trainer") -> dict[str, Any]:
    return {role: {"template": {"spec": spec}}}


def _problems(spec: dict[str, Any], policy: podpolicy.PodPolicy = podpolicy.DEFAULT) -> list[str]:
    try:
        plan.resolve(RLJob.model_validate(manifest(spec)), policy)
    except plan.PlanError as e:
        return e.problems
    return []


# The issue's hostile templates: each refused by the default policy, with the policy key that allows it.
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "hostpath-root",
        _t(
            {
                "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
                "volumeMounts": [{"name": "h", "mountPath": "/h"}],
            }
        ),
        "spec.trainer.template.spec.volumes[0].hostPath:",
        "volumeTypes",
    ),
    (
        "projected-token",
        _t({"volumes": [{"name": "p", "projected": {"sources": [SA_TOKEN]}}]}, "sampler"),
        "spec.sampler.template.spec.volumes[0].projected:",
        "volumeTypes",
    ),
    (
        "other-csi-driver",
        _t({"volumes": [{"name": "c", "csi": {"driver": "secrets-store.csi.k8s.io"}}]}),
        "spec.trainer.template.spec.volumes[0].csi.driver:",
        "csiDrivers",
    ),
    (
        "other-service-account",
        _t({"serviceAccountName": "operator-admin"}),
        "spec.trainer.template.spec.serviceAccountName:",
        "serviceAccounts",
    ),
    (
        "ld-preload",
        _t({"env": [{"name": "LD_PRELOAD", "value": "/x.so"}]}),
        "spec.trainer.template.spec.env[0]",
        "refusedEnv",
    ),
    (
        "pythonpath",
        _t({"env": [{"name": "PYTHONPATH", "value": "/x"}]}),
        "spec.trainer.template.spec.env[0]",
        "refusedEnv",
    ),
    (
        "envfrom-without-prefix",
        _t({"envFrom": [{"secretRef": {"name": "s"}}]}),
        "spec.trainer.template.spec.envFrom[0].prefix:",
        "allowEnvFromWithoutPrefix",
    ),
    (
        "envfrom-prefix-forms-ld",
        _t({"envFrom": [{"prefix": "LD_", "secretRef": {"name": "s"}}]}),
        "spec.trainer.template.spec.envFrom[0].prefix:",
        "refusedEnv",
    ),
    (
        "tolerate-everything",
        _t({"tolerations": [{"operator": "Exists"}]}),
        "spec.trainer.template.spec.tolerations[0]:",
        "allowTolerateEverything",
    ),
    (
        "system-priority",
        {"priorityClassName": "system-node-critical"},
        "spec.priorityClassName:",
        "priorityClasses",
    ),
]


@pytest.mark.parametrize(("name", "spec", "field", "key"), REFUSED, ids=[r[0] for r in REFUSED])
def test_the_default_policy_refuses(name: str, spec: dict[str, Any], field: str, key: str) -> None:
    got = _problems(spec)
    hits = [line for line in got if line.startswith(field)]
    assert hits, got
    assert all(f"(the operator's pod policy: {key})" in line for line in hits), hits


def test_a_policy_allows_what_it_lists() -> None:
    policy = podpolicy.PodPolicy(
        volume_types=(*podpolicy.DEFAULT_VOLUME_TYPES, "hostPath", "projected"),
        csi_drivers=(podpolicy.GCSFUSE_DRIVER, "secrets-store.csi.k8s.io"),
        allow_service_account_tokens=True,
        service_accounts=("rl-wi",),
        priority_classes=("rl-high",),
        refused_env=(),
        allow_tolerate_everything=True,
    )
    spec = _t(
        {
            "volumes": [
                {"name": "h", "hostPath": {"path": "/var/data"}},
                {"name": "p", "projected": {"sources": [SA_TOKEN]}},
                {"name": "c", "csi": {"driver": "secrets-store.csi.k8s.io"}},
            ],
            "serviceAccountName": "rl-wi",
            "env": [{"name": "PYTHONPATH", "value": "/x"}],
            "envFrom": [{"secretRef": {"name": "s"}}],
            "tolerations": [{"operator": "Exists"}],
        }
    )
    assert _problems({**spec, "priorityClassName": "rl-high"}, policy) == []
    # ... and refuses what it does not list.
    got = _problems({"priorityClassName": "rl-low"}, policy)
    assert got == [
        "spec.priorityClassName: rl-low is not allowed (allowed: rl-high) (the operator's pod policy: "
        "priorityClasses)"
    ]


def test_image_prefixes() -> None:
    policy = podpolicy.PodPolicy(image_prefixes=("us-docker.pkg.dev/p/rl/",))
    got = _problems({}, policy)  # the default images are not under that prefix
    assert [line.split(":")[0] for line in got] == ["spec.trainer.image", "spec.sampler.image"], got
    ok = {
        "trainer": {"image": "us-docker.pkg.dev/p/rl/trainer:1"},
        "sampler": {"image": "us-docker.pkg.dev/p/rl/s:1"},
    }
    assert _problems(ok, policy) == []


def test_the_run_s_own_service_account_and_safe_values_pass() -> None:
    spec = _t(
        {
            "serviceAccountName": "t-rljob",
            "envFrom": [{"prefix": "WANDB_", "secretRef": {"name": "wandb"}}],
            "tolerations": [{"key": "cloud.google.com/gke-spot", "operator": "Exists"}],
            "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "data"}}],
        }
    )
    assert problems(manifest(spec)) == []
    objects(manifest(spec))


def test_the_chart_default_is_the_operator_default() -> None:
    values = yaml.safe_load((REPO / "charts" / "rljob" / "values.yaml").read_text())
    assert podpolicy.parse(values["podPolicy"], "values.yaml") == podpolicy.DEFAULT
    config = OperatorConfig.from_env({podpolicy.ENV: json.dumps(values["podPolicy"])})
    assert config.pod_policy == podpolicy.DEFAULT
    assert OperatorConfig.from_env({}).pod_policy == podpolicy.DEFAULT


def test_a_bad_policy_is_refused_with_its_field() -> None:
    with pytest.raises(podpolicy.PolicyError, match="RLJOB_POD_POLICY: volumeTyps: Extra inputs"):
        OperatorConfig.from_env({podpolicy.ENV: '{"volumeTyps": []}'})


def test_rljob_validate_takes_the_policy(tmp_path: Path) -> None:
    doc = manifest(_t({"serviceAccountName": "rl-wi"}))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    refused = subprocess.run([RLJOB, "validate", "-f", path], capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "spec.trainer.template.spec.serviceAccountName" in refused.stderr
    pol = tmp_path / "policy.yaml"
    pol.write_text("serviceAccounts: [rl-wi]\n")
    cmd = [str(RLJOB), "validate", "-f", str(path), "--pod-policy", str(pol)]
    allowed = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert allowed.returncode == 0, allowed.stderr
    pol.write_text("serviceAcounts: [rl-wi]\n")
    bad = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "serviceAcounts" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(("name", "spec", "field", "key"), REFUSED, ids=[r[0] for r in REFUSED])
def test_allow_all_allows_each(name: str, spec: dict[str, Any], field: str, key: str) -> None:
    """rljob doctor's policy (podpolicy.ALLOW_ALL): the operator's webhook applies the real one."""
    assert not [line for line in _problems(spec, podpolicy.ALLOW_ALL) if "pod policy" in line]
