"""JAX's own Cloud TPU cluster detection (jax/_src/clusters/cloud_tpu_cluster.py, GkeTpuCluster: the path
``jax.distributed.initialize()`` takes on a GKE TPU pod when given no arguments) reads the environment
every trainer container runs with (the render's values, the downward-API fields resolved, and the libtpu
variables rljob.recipes.topology exports before JAX starts) and must reach the process id and count the
trainer passes explicitly. If they disagreed, the platform's and rljob's view of the same pod would
differ; the deliberately broken variant (TPU_WORKER_ID of the pod alone, as GKE's webhook sets it for one
container per pod) shows the comparison catches it on the two-container tpu7x pods."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from fixtures.recipes import manifest, objects
from rljob.recipes import naming, topology

GOLDEN = Path(__file__).parents[1] / "recipes" / "golden"


def _jobsets() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(GOLDEN.glob("*.yaml")):
        docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
        (js,) = [d for d in docs if d["kind"] == "JobSet"]
        out.append((path.stem, js))
    return out


def _multislice() -> list[tuple[str, dict[str, Any]]]:
    # No golden has several slices: MEGASCALE_SLICE_ID and MEGASCALE_NUM_SLICES join the computation.
    out = []
    for name, tpu, slices in (("multislice-v5p", "v5p-16", 3), ("multislice-tpu7x", "tpu7x-16", 2)):
        objs = objects(manifest({"trainer": {"tpu": tpu, "slices": slices}}, name=name[-5:].strip("-")))
        (js,) = [o for o in objs if o["kind"] == "JobSet"]
        out.append((name, js))
    return out


CASES = _jobsets() + _multislice()


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _jax_view(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    from jax._src.clusters import cloud_tpu_cluster as ctc

    # Off a TPU VM there is no metadata server: a variable the pod lacks is absent, not fetched.
    monkeypatch.setattr(ctc, "get_tpu_env_value_from_metadata", lambda key: None)
    with _environ(env):
        return ctc.GkeTpuCluster.get_process_id(), ctc.GkeTpuCluster.get_process_count()


@pytest.mark.parametrize(("name", "js"), CASES, ids=[c[0] for c in CASES])
def test_jax_detection_agrees_with_the_trainer(
    name: str, js: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    envs = [c for c in topology.container_envs(js) if c.role == naming.TRAINER]
    seen = []
    for c in envs:
        top = topology.process_topology(c.env)
        got = _jax_view({**c.env, **top.tpu_env}, monkeypatch)
        assert got == (top.process_id, top.num_processes), (c.job_index, c.pod_index, c.container)
        seen.append(got[0])
    assert sorted(seen) == list(range(len(envs)))


def test_a_per_pod_worker_id_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """TPU_WORKER_ID as the pod's index alone (both containers of a tpu7x pod the same worker): JAX's
    view then differs from the trainer's, and the comparison above would fail."""
    multi = [(n, js) for n, js in CASES if "tpu7x" in n]
    assert multi
    differs = 0
    for _, js in multi:
        for c in topology.container_envs(js):
            if c.role != naming.TRAINER or c.container_index == 0:
                continue
            top = topology.process_topology(c.env)
            broken = {**c.env, **top.tpu_env, "TPU_WORKER_ID": str(c.pod_index)}
            differs += _jax_view(broken, monkeypatch) != (top.process_id, top.num_processes)
    assert differs > 0
