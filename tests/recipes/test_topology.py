"""rljob.recipes.topology: every container of every pod of every slice of every golden render (and of
multi-slice renders, which no golden has) gets a distinct JAX process id in 0..N-1, N = slices x hosts x
containers per host, and exactly one of them is the coordinator, the container that opens its port."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.recipes import manifest, objects
from rljob.recipes import naming, topology, tpu
from rljob.recipes.api import TpuSlice
from rljob.recipes.runconfig import COORDINATOR_PORT

GOLDEN = Path(__file__).parent / "golden"


def _jobset(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (js,) = [o for o in objs if o["kind"] == "JobSet"]
    return js


def _golden_jobsets() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(GOLDEN.glob("*.yaml")):
        docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
        out.append((path.stem, _jobset(docs)))
    return out


def _multislice_jobsets() -> list[tuple[str, dict[str, Any]]]:
    v5p = manifest({"trainer": {"tpu": "v5p-16", "slices": 3}}, name="ms")
    tpu7x = manifest({"trainer": {"tpu": "tpu7x-16", "slices": 2}}, name="ms7")
    return [("multislice-v5p", _jobset(objects(v5p))), ("multislice-tpu7x", _jobset(objects(tpu7x)))]


CASES = _golden_jobsets() + _multislice_jobsets()


def bijection_problems(ids: list[int], n: int) -> list[str]:
    """What keeps ``ids`` from being a bijection onto 0..n-1."""
    problems = [f"process id {i} taken by {c} containers" for i, c in Counter(ids).items() if c > 1]
    problems += [f"process id {i} outside 0..{n - 1}" for i in ids if not 0 <= i < n]
    if len(ids) != n:
        problems.append(f"{len(ids)} containers for {n} processes")
    return problems


def _trainer_count(js: dict[str, Any]) -> int:
    (rj,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == naming.TRAINER]
    spec = rj["template"]["spec"]
    return int(rj["replicas"]) * int(spec["completions"]) * len(spec["template"]["spec"]["containers"])


def _container_ports(js: dict[str, Any], role: str, index: int) -> list[int]:
    (rj,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == role]
    c = rj["template"]["spec"]["template"]["spec"]["containers"][index]
    return [int(p["containerPort"]) for p in c.get("ports", [])]


def _host_chips(js: dict[str, Any]) -> int:
    """Chips of one trainer host, by the generation and topology its pods select."""
    (rj,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == naming.TRAINER]
    sel = rj["template"]["spec"]["template"]["spec"]["nodeSelector"]
    slice_ = TpuSlice(accelerator=sel[tpu.ACCELERATOR_LABEL], topology=sel[tpu.TOPOLOGY_LABEL])
    return tpu.plan(slice_).chips_per_host


@pytest.mark.parametrize(("name", "js"), CASES, ids=[c[0] for c in CASES])
def test_trainer_processes_are_a_bijection_with_one_coordinator(name: str, js: dict[str, Any]) -> None:
    envs = [c for c in topology.container_envs(js) if c.role == naming.TRAINER]
    tops = [topology.process_topology(c.env) for c in envs]
    n = _trainer_count(js)
    assert {t.num_processes for t in tops} == {n}
    assert bijection_problems([t.process_id for t in tops], n) == []
    coordinators = [(c, t) for c, t in zip(envs, tops, strict=True) if t.is_coordinator]
    assert len(coordinators) == 1
    (c0, _) = coordinators[0]
    assert (c0.job_index, c0.pod_index, c0.container_index) == (0, 0, 0)
    # The coordinator's address is its own pod's DNS name, and that container opens the port.
    rljob = js["metadata"]["name"]
    assert {t.coordinator for t in tops} == {f"{naming.coordinator(rljob)}:{COORDINATOR_PORT}"}
    assert COORDINATOR_PORT in _container_ports(js, naming.TRAINER, c0.container_index)
    # libtpu's view: a worker id per container of the slice, its own address at that index, ports
    # distinct within a pod and never the coordinator's.
    by_slice: dict[int, list[tuple[Any, Any]]] = defaultdict(list)
    for c, t in zip(envs, tops, strict=True):
        by_slice[c.job_index].append((c, t))
        addresses = t.tpu_env["TPU_PROCESS_ADDRESSES"].split(",")
        me = addresses[int(t.tpu_env["TPU_WORKER_ID"])]
        host = naming.hostname(rljob, naming.TRAINER, c.job_index, c.pod_index)
        assert me == f"{host}.{naming.subdomain(rljob)}:{t.tpu_env['TPU_PROCESS_PORT']}"
        assert int(t.tpu_env["TPU_PROCESS_PORT"]) != COORDINATOR_PORT
        assert t.chips * t.containers_per_host == _host_chips(js)  # the host's chips, shared out
    for members in by_slice.values():
        per_slice = len(members)
        assert bijection_problems([int(t.tpu_env["TPU_WORKER_ID"]) for _, t in members], per_slice) == []


@pytest.mark.parametrize(("name", "js"), CASES, ids=[c[0] for c in CASES])
def test_each_sampler_replica_is_a_group_of_its_own(name: str, js: dict[str, Any]) -> None:
    groups: dict[int, list[topology.ProcessTopology]] = defaultdict(list)
    for c in topology.container_envs(js):
        if c.role == naming.SAMPLER:
            groups[c.job_index].append(topology.process_topology(c.env))
    assert groups
    for replica, tops in groups.items():
        n = tops[0].num_processes
        assert bijection_problems([t.process_id for t in tops], n) == []
        assert sum(t.is_coordinator for t in tops) == 1
        rljob = js["metadata"]["name"]
        head = f"{naming.hostname(rljob, naming.SAMPLER, replica, 0)}.{naming.subdomain(rljob)}"
        assert {t.coordinator for t in tops} == {head}


def test_the_check_catches_ids_from_the_completion_index_alone() -> None:
    """The formula the trainer used before (id = JOB_COMPLETION_INDEX) repeats ids on a tpu7x render:
    the bijection check must say so."""
    js = dict(CASES)["recipe-qwen3.5-397b-a17b-tpu7x"]
    envs = [c.env for c in topology.container_envs(js) if c.role == naming.TRAINER]
    old = [int(e["JOB_COMPLETION_INDEX"]) for e in envs]
    problems = bijection_problems(old, _trainer_count(js))
    assert any("taken by 2 containers" in p for p in problems), problems


def test_downward_api_fields_resolve_as_the_controllers_set_them() -> None:
    js = dict(CASES)["multislice-tpu7x"]
    env = next(
        c.env
        for c in topology.container_envs(js)
        if (c.role, c.job_index, c.pod_index, c.container_index) == (naming.TRAINER, 1, 1, 1)
    )
    assert env["JOB_INDEX"] == "1" and env["POD_INDEX"] == "1" and env["JOB_COMPLETION_INDEX"] == "1"
    assert env["MEGASCALE_SLICE_ID"] == "1" and env["MEGASCALE_NUM_SLICES"] == "2"
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == naming.coordinator("ms7")
    assert env["JOBSET_NAME"] == "ms7" and env["POD_NAME"].startswith("ms7-trainer-1-1-")
    top = topology.process_topology(env)
    # slice 1 of 2, host 1 of 2, container 1 of 2: (1 x 2 + 1) x 2 + 1
    assert (top.process_id, top.num_processes, top.tpu_env["TPU_WORKER_ID"]) == (7, 8, "3")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"RLJOB_CONTAINER_INDEX": "2"}, "RLJOB_CONTAINER_INDEX"),
        ({"JOB_INDEX": "x"}, "JOB_INDEX"),
        ({"JOB_COMPLETION_INDEX": "99"}, "JOB_COMPLETION_INDEX"),
        ({"JAX_COORDINATOR_ADDRESS": ""}, "JAX_COORDINATOR_ADDRESS"),
        ({"RLJOB_CONTAINERS_PER_HOST": "9"}, "RLJOB_CONTAINERS_PER_HOST"),
    ],
)
def test_a_bad_environment_names_the_variable(change: dict[str, str], field: str) -> None:
    js = dict(CASES)["multislice-tpu7x"]
    env = next(c.env for c in topology.container_envs(js) if c.role == naming.TRAINER)
    with pytest.raises(topology.TopologyError, match=f"env {field}"):
        topology.process_topology({**env, **change})
