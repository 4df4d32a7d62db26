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


# ---------------------------------------------------------------------------- the policy as a code boundary

_SP = "spec.trainer.template.spec"
_ROOTS = "(allowed: /data, /mnt, /etc/rljob-user): a mount elsewhere can cover the image's own files"
_POL = "(the operator's pod policy: {})"
SITE = "/opt/rljob/lib/python3.12/site-packages"

HOSTILE_MOUNTS: list[tuple[str, str, str | None]] = [
    # (name, mountPath, subPath): each would put the manifest's bytes where the image keeps code
    ("over-the-entrypoint", "/opt/rljob/bin/rljob-trainer", "run.sh"),
    ("a-pth-in-site-packages", f"{SITE}/zz-hook.pth", "hook.pth"),
    ("over-site-packages", SITE, None),
    ("over-the-interpreter", "/usr/local/bin/python3", "py"),
    ("ld-so-preload", "/etc/ld.so.preload", "preload"),
    ("home-user-site", "/root/.local/lib/python3.12/site-packages", None),
    ("backstep-out-of-a-root", "/data/../opt/rljob", None),
    ("a-root-s-name-as-a-prefix", "/database", None),
    ("over-the-venv", "/opt", None),
]


@pytest.mark.parametrize(("name", "path", "sub"), HOSTILE_MOUNTS, ids=[m[0] for m in HOSTILE_MOUNTS])
def test_a_mount_over_the_image_is_refused(name: str, path: str, sub: str | None) -> None:
    """A configMap mounted (subPath or whole) anywhere but the mount roots is refused with one line: the
    roots are directories the images do not have, so nothing mounted can replace the image's code."""
    mount: dict[str, Any] = {"name": "c", "mountPath": path}
    if sub is not None:
        mount["subPath"] = sub
    spec = _t({"volumes": [{"name": "c", "configMap": {"name": "payload"}}], "volumeMounts": [mount]})
    got = [line for line in _problems(spec) if "pod policy" in line]
    assert got == [
        f"{_SP}.volumeMounts[0].mountPath: {path} is not under an allowed mount root {_ROOTS} "
        + _POL.format("mountRoots")
    ]


HOSTILE_ENV: list[tuple[str, str]] = [
    # (name, the refused pattern it matches): each runs or loads code at start
    ("PYTHONWARNINGS", "PYTHON*"),  # "ignore::evil.Warning" imports module evil
    ("PYTHONBREAKPOINT", "PYTHON*"),
    ("PYTHONPYCACHEPREFIX", "PYTHON*"),
    ("PYTHONSTARTUP", "PYTHON*"),
    ("PYTHONPATH", "PYTHON*"),
    ("PYTHON_GIL", "PYTHON*"),
    ("BROWSER", "BROWSER"),
    ("MPLBACKEND", "MPLBACKEND"),  # module://evil
    ("LD_AUDIT", "LD_*"),
    ("LD_PRELOAD", "LD_*"),
    ("GCONV_PATH", "GCONV_PATH"),
    ("GLIBC_TUNABLES", "GLIBC_TUNABLES"),
    ("OPENSSL_CONF", "OPENSSL_CONF"),  # an engine is a shared library
    ("TPU_LIBRARY_PATH", "TPU_LIBRARY_PATH"),
    ("PJRT_NAMES_AND_LIBRARY_PATHS", "PJRT_*"),
    ("TF_PLUGGABLE_DEVICE_LIBRARY_PATH", "TF_PLUGGABLE_DEVICE_LIBRARY_PATH"),
    ("NCCL_NET_PLUGIN", "NCCL_NET_PLUGIN"),
    ("PATH", "PATH"),
    ("HOME", "HOME"),
    ("BASH_ENV", "BASH_ENV"),
    ("BASH_FUNC_ls%%", "BASH_FUNC_*"),
    ("PS4", "PS4"),
    ("PERL5OPT", "PERL5OPT"),
    ("NODE_OPTIONS", "NODE_OPTIONS"),
    ("JAVA_TOOL_OPTIONS", "JAVA_TOOL_OPTIONS"),
    ("GIT_SSH_COMMAND", "GIT_*"),
]


def test_every_code_loading_variable_is_refused_by_default() -> None:
    """The issue's variables and one of each class, set by value and by valueFrom (a Secret's key): one
    refusal line each, naming the pattern."""
    names = [n for n, _ in HOSTILE_ENV if "%" not in n]  # the API's env-name pattern refuses % already
    by_value = [{"name": n, "value": "x"} for n in names]
    by_ref = [{"name": n, "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}} for n in names]
    spec = {**_t({"env": by_value}), **_t({"env": by_ref}, "sampler")}
    got = [line for line in _problems(spec) if "pod policy" in line]
    pattern = dict(HOSTILE_ENV)
    assert got == [
        f"spec.{role}.template.spec.env[{i}].name: {n} is refused (matches {pattern[n]}) "
        + _POL.format("refusedEnv")
        for role in ("trainer", "sampler")
        for i, n in enumerate(names)
    ]
    assert all(fnmatch_refused(n) == p for n, p in HOSTILE_ENV)


def fnmatch_refused(name: str) -> str | None:
    import fnmatch

    return next((p for p in podpolicy.DEFAULT.refused_env if fnmatch.fnmatchcase(name, p)), None)


@pytest.mark.parametrize("prefix", ["PY", "PYTHON", "PJRT_", "GIT", "P", "LD_", "H"])
def test_an_env_from_prefix_that_can_form_a_refused_name_is_refused(prefix: str) -> None:
    spec = _t({"envFrom": [{"prefix": prefix, "secretRef": {"name": "s"}}]})
    got = [line for line in _problems(spec) if "pod policy" in line]
    assert len(got) == 1 and got[0].startswith(f"{_SP}.envFrom[0].prefix: {prefix} could form a refused name")


def test_what_the_boundary_still_allows() -> None:
    """Data under the roots (a subPath included), ordinary variables and prefixes pass the default."""
    spec = _t(
        {
            "volumes": [
                {"name": "c", "configMap": {"name": "prompts"}},
                {"name": "d", "persistentVolumeClaim": {"claimName": "data"}},
                {"name": "s", "secret": {"secretName": "keys"}},
            ],
            "volumeMounts": [
                {"name": "d", "mountPath": "/data"},
                {"name": "c", "mountPath": "/mnt/prompts/p.jsonl", "subPath": "p.jsonl"},
                {"name": "s", "mountPath": "/etc/rljob-user/keys", "readOnly": True},
            ],
            "env": [
                {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                {"name": "HF_HUB_OFFLINE", "value": "1"},
                {"name": "XLA_FLAGS", "value": "--xla_dump_to=/tmp/x"},
            ],
            "envFrom": [{"prefix": "WANDB_", "secretRef": {"name": "wandb"}}],
        }
    )
    assert problems(manifest(spec)) == []


@pytest.mark.parametrize(
    ("policy", "error"),
    [
        (
            {"mountRoots": ["data"]},
            "mountRoots: Value error, 'data' is not an absolute, normalised directory",
        ),
        ({"mountRoots": ["/data/../opt"]}, "mountRoots: Value error, '/data/../opt' is not an absolute"),
        ({"mountRoots": ["/data/"]}, "mountRoots: Value error, '/data/' is not an absolute"),
        ({"refusedEnv": ["*_PATH"]}, "refusedEnv: Value error, '*_PATH': a name or a prefix followed by one"),
        ({"refusedEnv": ["LD_?"]}, "refusedEnv: Value error, 'LD_?': a name or a prefix"),
    ],
)
def test_a_policy_with_a_root_or_pattern_it_cannot_enforce_is_refused(
    policy: dict[str, Any], error: str
) -> None:
    with pytest.raises(podpolicy.PolicyError) as info:
        podpolicy.parse(policy, "p")
    assert info.value.problems[0].startswith(f"p: {error}"), info.value.problems


def test_a_policy_can_move_the_mount_roots() -> None:
    mount = {"name": "c", "mountPath": "/workspace/x"}
    spec = _t({"volumes": [{"name": "c", "configMap": {"name": "x"}}], "volumeMounts": [mount]})
    assert _problems(spec, podpolicy.PodPolicy(mount_roots=("/workspace",))) == []
    assert _problems(spec, podpolicy.PodPolicy(mount_roots=("/",))) == []
    assert len(_problems(spec)) == 1
