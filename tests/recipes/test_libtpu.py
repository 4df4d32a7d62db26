"""spec.trainer.libtpuFlags (rljob.recipes.libtpu): one map, applied as LIBTPU_INIT_ARGS to every trainer
container and the compile preflight (never a sampler), merged recipe < profile < manifest key by key, and
every malformed flag refused with its key named."""

from __future__ import annotations

from typing import Any

import pytest
from fixtures.recipes import manifest, objects, problems, recipe_manifest, resolve
from hypothesis import given
from hypothesis import strategies as st
from rljob.recipes import libtpu, render

VMEM = "xla_tpu_scoped_vmem_limit_kib"


def _envs(js: dict[str, Any], role: str) -> list[dict[str, str]]:
    rj = next(r for r in js["spec"]["replicatedJobs"] if r["name"] == role)
    containers = rj["template"]["spec"]["template"]["spec"]["containers"]
    return [{e["name"]: e.get("value") for e in c["env"]} for c in containers]


def test_the_flags_reach_every_trainer_container_and_the_preflight_not_the_sampler() -> None:
    doc = manifest(
        {
            "trainer": {
                "tpu": "tpu7x-8",
                "libtpuFlags": {VMEM: 65472, "xla_enable_async_all_gather": True},
                "preflight": {"compile": True},
            },
        }
    )
    run = resolve(doc)
    assert run.trainer.libtpu_flags == {"xla_enable_async_all_gather": "true", VMEM: "65472"}
    want = "--xla_enable_async_all_gather=true --xla_tpu_scoped_vmem_limit_kib=65472"
    trainers = _envs(objects(doc)[-1], "trainer")
    assert len(trainers) == 2 and all(env[libtpu.ENV] == want for env in trainers)
    assert all(libtpu.ENV not in env for env in _envs(objects(doc)[-1], "sampler"))
    job = render.preflight_job(run)
    assert job is not None
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e.get("value") for e in c["env"]}[libtpu.ENV] == want


def test_no_flags_no_env() -> None:
    assert all(libtpu.ENV not in env for env in _envs(objects(manifest({}))[-1], "trainer"))


def test_the_recipe_sets_the_scoped_vmem_and_a_manifest_overrides_or_removes_it_key_by_key() -> None:
    doc = recipe_manifest("qwen3.5-397b-a17b-tpu7x")
    assert resolve(doc).trainer.libtpu_flags == {VMEM: "65472"}
    doc["spec"].setdefault("trainer", {})["libtpuFlags"] = {
        VMEM: 32768,
        "xla_enable_async_all_gather": "true",
    }
    assert resolve(doc).trainer.libtpu_flags == {"xla_enable_async_all_gather": "true", VMEM: "32768"}
    doc["spec"]["trainer"]["libtpuFlags"] = {VMEM: None}
    assert resolve(doc).trainer.libtpu_flags == {}


BAD = [
    ("--xla_foo", 1, "spec.trainer.libtpuFlags.--xla_foo: not a libtpu flag name"),
    ("xla_foo", "a b", "spec.trainer.libtpuFlags.xla_foo: the value must be 1 to 1024 characters without"),
    ("xla_foo", "", "spec.trainer.libtpuFlags.xla_foo: the value must be 1 to 1024 characters without"),
    ("xla_foo", [1], "spec.trainer.libtpuFlags.xla_foo: the value must be a string, number or boolean"),
    (
        VMEM,
        65536,
        f"spec.trainer.libtpuFlags.{VMEM}: 65536 KiB; a tpu7x device's scoped VMEM is at most 65472",
    ),
    (VMEM, "64M", f"spec.trainer.libtpuFlags.{VMEM}: an integer number of KiB"),
    # an odd key is quoted, so the line stays `path: message`
    ("", 1, 'spec.trainer.libtpuFlags[""]: not a libtpu flag name'),
    ("a b", 1, 'spec.trainer.libtpuFlags["a b"]: not a libtpu flag name'),
    ("x.y", 1, 'spec.trainer.libtpuFlags["x.y"]: not a libtpu flag name'),
]


@pytest.mark.parametrize(("name", "value", "line"), BAD)
def test_a_bad_flag_is_refused_naming_its_key(name: str, value: Any, line: str) -> None:
    found = problems(manifest({"trainer": {"tpu": "tpu7x-8", "libtpuFlags": {name: value}}}))
    assert any(p.startswith(line) for p in found), found


def test_every_bad_flag_at_once() -> None:
    flags = {f"{name}{i}": value for i, (name, value, _) in enumerate(BAD[:4])}
    flags[VMEM] = 65536
    found = problems(manifest({"trainer": {"tpu": "tpu7x-8", "libtpuFlags": flags}}))
    assert sorted(p.split(":")[0] for p in found) == sorted(f"spec.trainer.libtpuFlags.{k}" for k in flags)


def test_the_vmem_cap_is_the_generations() -> None:
    """A v5p's cap is not known to the plan: the compiler judges it there."""
    assert not problems(manifest({"trainer": {"libtpuFlags": {VMEM: 65536}}}))


def test_the_trainer_template_may_not_set_the_env_a_sampler_template_may() -> None:
    env = [{"name": libtpu.ENV, "value": "--xla_foo=1"}]
    found = problems(manifest({"trainer": {"template": {"spec": {"env": env}}}}))
    assert found == [
        "spec.trainer.template.spec.env[0].name: LIBTPU_INIT_ARGS is set by rljob from "
        "spec.trainer.libtpuFlags (set the flags there)"
    ]
    assert not problems(manifest({"sampler": {"template": {"spec": {"env": env}}}}))


_NAMES = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,30}", fullmatch=True)
_VALUES = st.one_of(
    st.booleans(),
    st.integers(-(10**9), 10**9),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40),
)


@given(st.dictionaries(_NAMES, _VALUES, max_size=8))
def test_init_args_split_back_into_the_flags(flags: dict[str, Any]) -> None:
    """What libtpu (and MaxText's parse_libtpu_flags_to_dict) reads back: one --name=value per flag."""
    assert not libtpu.problems(flags, "tpu-v5p-slice")
    resolved = libtpu.resolve(flags)
    args = libtpu.init_args(resolved)
    back = dict(tok[2:].split("=", 1) for tok in args.split())
    assert back == resolved == {k: libtpu.value_text(v) for k, v in flags.items()}


_CLOUD_TPU_INIT = """
import json, os, sys
os.environ["JAX_FORCE_TPU_INIT"] = "1"  # run JAX's TPU-machine set-up on this CPU machine
from jax._src import cloud_tpu_init
cloud_tpu_init.cloud_tpu_init()
print(json.dumps(os.environ.get("LIBTPU_INIT_ARGS", "")))
"""


@pytest.mark.jax
@pytest.mark.parametrize(
    "flags",
    [{}, {"xla_tpu_scoped_vmem_limit_kib": "65472"}, {libtpu.TPU_MACHINE_FLAG: "false", "xla_x": "1"}],
)
def test_the_compile_stage_sets_what_jax_sets_on_a_tpu_machine(flags: dict[str, str]) -> None:
    """JAX's persistent cache hashes LIBTPU_INIT_ARGS into its keys: the compile stage's variable must be, as
    a set of flags, what JAX's own TPU-machine set-up (jax._src.cloud_tpu_init, run here by its own force
    switch) makes of the trainer container's. Without it a program compiled here was looked up on a v5e chip
    under another key and compiled again (hack/tpu/cache_probe.py)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, libtpu.ENV: libtpu.init_args(flags)}
    out = subprocess.run(
        [sys.executable, "-c", _CLOUD_TPU_INIT],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    on_tpu_machine = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(on_tpu_machine.split()) == sorted(libtpu.tpu_machine_args(flags).split())
    assert (
        sorted(on_tpu_machine.split()) != sorted(libtpu.init_args(flags).split())
        or libtpu.TPU_MACHINE_FLAG in flags
    )
