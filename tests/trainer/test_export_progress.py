"""Adapter export (PEFT layout on the GCS emulator, LATEST last), progress sinks (file, the Kubernetes
ConfigMap patch against a local HTTP server), JSON step lines and TensorBoard events."""

from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from rljob.common.storage import open_store
from rljob.recipes.api import ProgressReport
from rljob.trainer.export import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    latest_version,
    publish_adapter,
    read_adapter,
)
from rljob.trainer.progress import ConfigMapSink, FileSink, Reporter, StepLog
from safetensors.numpy import load as st_load

TESTED_MODULES = ("rljob.trainer.progress",)


def _tensors() -> dict[str, np.ndarray]:
    out = {}
    for i in range(2):
        out[f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"] = np.full(
            (8, 64), i, np.float32
        )
        out[f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight"] = np.zeros(
            (64, 8), np.float32
        )
    return out


CONFIG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules": ["q_proj"]}


@pytest.mark.parametrize("backend", ["gcs", "local"])
def test_publish_adapter(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    root = request.getfixturevalue("gcs_bucket") + "/a" if backend == "gcs" else str(tmp_path / "a")
    adapters = f"{root}/adapters"
    assert latest_version(adapters) is None
    for v in (0, 1, 2):
        uri = publish_adapter(adapters, v, _tensors(), CONFIG)
        assert uri.endswith(f"/v{v}") and latest_version(adapters) == v
    store = open_store(adapters)
    assert set(store.list()) == {"LATEST"} | {
        f"v{v}/{f}" for v in (0, 1, 2) for f in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)
    }
    raw = store.read(f"v2/{ADAPTER_WEIGHTS}")
    assert raw is not None
    loaded = st_load(raw)  # plain safetensors, as vLLM / peft read it
    assert set(loaded) == set(_tensors())
    assert loaded["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (8, 64)
    tensors, config = read_adapter(adapters, 2)
    assert config == CONFIG and tensors.keys() == loaded.keys()


def test_latest_is_written_last(tmp_path: Path) -> None:
    """A reader following LATEST always finds a complete version: record the write order."""
    order: list[str] = []
    from rljob.trainer import export

    real = export.open_store

    class Spy:
        def __init__(self, uri: str) -> None:
            self.inner = real(uri)
            self.uri = self.inner.uri

        def write(self, key: str, data: bytes) -> None:
            order.append(key)
            self.inner.write(key, data)

    export.open_store = Spy  # type: ignore[assignment]
    try:
        publish_adapter(str(tmp_path / "ad"), 5, _tensors(), CONFIG)
    finally:
        export.open_store = real
    assert order[-1] == "LATEST" and set(order[:-1]) == {f"v5/{ADAPTER_WEIGHTS}", f"v5/{ADAPTER_CONFIG}"}


class _KubeApi(http.server.BaseHTTPRequestHandler):
    requests: ClassVar[list[tuple[str, str, str, dict[str, Any]]]] = []

    def do_PATCH(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(
            (self.path, self.headers.get("Authorization", ""), self.headers.get("Content-Type", ""), body)
        )
        out = json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def kube_api() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KubeApi)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _KubeApi.requests = []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_configmap_sink_patches_progress_key(kube_api: str) -> None:
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = kube_api
    cfg.api_key = {"authorization": "sa-token"}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    sink = ConfigMapSink("job-progress", "team", "progress.json", api_client=client.ApiClient(cfg))
    rep = Reporter(sink)
    rep.update(step=3, reward_mean=0.5, last_checkpoint_step=3, adapter_version=3)
    (path, auth, ctype, body) = _KubeApi.requests[-1]
    assert path == "/api/v1/namespaces/team/configmaps/job-progress"
    assert auth == "Bearer sa-token"
    assert "merge-patch" in ctype or "strategic-merge-patch" in ctype
    report = ProgressReport.model_validate_json(body["data"]["progress.json"])
    assert (report.step, report.reward_mean, report.adapter_version) == (3, 0.5, 3)
    assert report.update_time is not None


def test_file_sink_and_failed_sink_not_fatal(tmp_path: Path) -> None:
    rep = Reporter(FileSink(str(tmp_path / "p" / "progress.json")))
    rep.update(step=1, resumed_from_step=0)
    got = json.loads((tmp_path / "p" / "progress.json").read_text())
    assert got["step"] == 1 and got["resumedFromStep"] == 0

    class Broken:
        def write(self, report: ProgressReport) -> None:
            raise ConnectionError("api server down")

    bad = Reporter(Broken())
    bad.update(step=2)  # logged, not raised
    assert bad.report.step == 2


def test_step_log_json_lines_and_tensorboard(tmp_path: Path) -> None:
    out = io.StringIO()
    log = StepLog(str(tmp_path / "tb"), str(tmp_path / "steps.jsonl"), stream=out)
    log.step(1, {"loss": 0.25, "reward_mean": 0.5, "grad_norm": float("nan")})
    log.step(2, {"loss": 0.125, "reward_mean": 0.75})
    log.close()
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and lines[1]["loss"] == 0.125
    assert (tmp_path / "steps.jsonl").read_text().count("\n") == 2
    scalars = _read_events(tmp_path / "tb")
    assert scalars["train/loss"] == [(1, 0.25), (2, 0.125)]
    assert scalars["train/reward_mean"] == [(1, 0.5), (2, 0.75)]
    assert "train/grad_norm" not in scalars  # non-finite values are not plotted


def _read_events(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars from TFRecord event files (length, crc, payload, crc), parsed with tensorboardX's protos."""
    import struct

    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(logdir.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            ev = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out
