"""Adapter hot-swap: the watcher follows LATEST on the GCS emulator into a live CPU sampler over HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from rljob.sampler.adapters import (
    AdapterStore,
    AdapterWatcher,
    LoraEndpoint,
    ServerError,
    adapter_name,
    parse_latest,
    version_of,
)
from rljob.sampler.cpu_server import CpuSampler
from rljob.trainer.export import publish_adapter
from rljob.trainer.model import Policy

TESTED_MODULES = ("rljob.sampler.cpu_server",)

pytestmark = pytest.mark.jax


@pytest.mark.parametrize(("text", "version"), [("3", 3), ("v12\n", 12), ('{"version": 7}', 7), (" 0 ", 0)])
def test_parse_latest(text: str, version: int) -> None:
    assert parse_latest(text) == version


@pytest.mark.parametrize("text", ["", "vx", "latest"])
def test_parse_latest_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_latest(text)


def test_names_round_trip() -> None:
    assert version_of(adapter_name("my-job", 41)) == 41
    assert version_of("my-job") is None


@pytest.fixture
def policy(cpu_policy: Policy) -> Policy:
    return cpu_policy


@pytest.fixture
def server(cpu_sampler: tuple[str, CpuSampler]) -> tuple[str, CpuSampler]:
    return cpu_sampler


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _publish(uri: str, policy: Policy, lora: Any, version: int, **config: Any) -> None:
    publish_adapter(uri, version, policy.peft.to_peft(lora), {**policy.peft.config(), **config})


def _perturbed(policy: Policy, scale: float, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    peft = {
        k: v + scale * rng.standard_normal(v.shape).astype(np.float32)
        for k, v in policy.peft.to_peft(policy.lora0).items()
    }
    return policy.peft.from_peft(peft)


def test_watcher_swaps_versions_load_then_unload(
    gcs_bucket: str, server: tuple[str, CpuSampler], policy: Policy, tmp_path: Path
) -> None:
    base_url, _sampler = server
    uri = f"{gcs_bucket}/ns/job/adapters"
    watcher = AdapterWatcher(AdapterStore(uri), LoraEndpoint(base_url), tmp_path / "local", "job")
    assert watcher.poll_once() is None and watcher.served_version is None  # nothing published yet

    _publish(uri, policy, policy.lora0, 0)
    rec = watcher.poll_once()
    assert rec is not None and rec.version == 0 and rec.name == "job-v0"
    assert watcher.poll_once() is None  # no new version: no work

    lora1 = _perturbed(policy, 0.3, 1)
    _publish(uri, policy, lora1, 1)
    rec = watcher.poll_once()
    assert rec is not None and rec.version == 1
    ids = [m["id"] for m in _get(f"{base_url}/v1/models")["data"]]
    assert ids == [policy.spec.base_model, "job-v1"]  # v0 unloaded after v1 loaded
    assert not (tmp_path / "local" / "v0").exists()

    # The served v1 is the published weights: the sampler's log-probs equal the trainer's on them.
    resp = _post(
        f"{base_url}/v1/completions",
        {
            "model": "job-v1",
            "prompt": [[1, 5, 17]],
            "n": 4,
            "max_tokens": 2,
            "temperature": 1.0,
            "seed": 3,
            "logprobs": 0,
            "return_token_ids": True,
        },
    )
    assert resp["model"] == "job-v1" and resp["adapter_version"] == 1
    for ch in resp["choices"]:
        seq = [1, 5, 17, *ch["token_ids"]]
        t = jnp.asarray([seq])
        lp = policy.next_token_logprobs(lora1, t, jnp.arange(len(seq))[None], jnp.ones_like(t))
        np.testing.assert_allclose(np.asarray(lp)[0, 3:], ch["logprobs"]["token_logprobs"], atol=1e-5)


def test_broken_adapter_keeps_serving_previous(
    gcs_bucket: str, server: tuple[str, CpuSampler], policy: Policy, tmp_path: Path
) -> None:
    base_url, _ = server
    uri = f"{gcs_bucket}/adapters"
    watcher = AdapterWatcher(AdapterStore(uri), LoraEndpoint(base_url), tmp_path / "local", "job")
    _publish(uri, policy, policy.lora0, 0)
    watcher.poll_once()
    # v1 claims another rank (as a trainer with a different spec.lora.rank would export).
    _publish(uri, policy, policy.lora0, 1, r=4)
    with pytest.raises(ServerError, match="rank"):
        watcher.poll_once()
    assert watcher.served_version == 0
    assert [m["id"] for m in _get(f"{base_url}/v1/models")["data"]][1:] == ["job-v0"]


def test_unknown_model_is_404(server: tuple[str, CpuSampler]) -> None:
    base_url, _ = server
    req = urllib.request.Request(
        f"{base_url}/v1/completions", json.dumps({"model": "nope-v3", "prompt": [1]}).encode()
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 404
