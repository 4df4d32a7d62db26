"""Progress of a run: JSON log lines per step, TensorBoard event files, the ProgressReport (contract 4).

- :class:`StepLog` prints one JSON object per step to stdout (and appends it to a file when given):
  ``{"event": "step", "step": ..., "loss": ..., "reward_mean": ..., ...}``.
- TensorBoard scalars (tensorboardX), one tag `train/<metric>` per metric, go to a log directory; by
  default the run's StoragePaths.tensorboard under storage.root, so they outlive the pod (`rljob status`
  reads them). A gs:// directory is written through a local one: after each step the event file is
  uploaded whole with the run's Store (tensorboardX's own gs:// writer re-uploads from `__del__` at exit,
  which blocks a process whose storage is gone); an upload that fails is logged, never fatal.
- The :class:`~rljob.recipes.api.ProgressReport` goes to a sink: :class:`FileSink` (laptop, tests;
  written atomically) or :class:`ConfigMapSink` (in a pod: a merge patch of key ``progress.json`` of the
  ConfigMap ``<rljob>-progress`` through the pod's ServiceAccount token, or through the kubeconfig in
  ``KUBECONFIG`` where one is set; RBAC allows get/patch on that one ConfigMap). A failed report is
  logged and retried with the next step, never fatal: progress is observability, the checkpoint is the
  truth.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TextIO

from rljob.common.storage import LocalStore, Store, open_store
from rljob.recipes.api import ProgressReport
from rljob.recipes.runconfig import RunConfig

__all__ = ["ConfigMapSink", "FileSink", "ProgressSink", "Reporter", "StepLog", "sink_for"]

log = logging.getLogger("rljob.trainer.progress")


class ProgressSink(Protocol):
    def write(self, report: ProgressReport) -> None: ...


class FileSink:
    """The report as a JSON file (atomic replace)."""

    def __init__(self, path: str) -> None:
        p = Path(path)
        self._store = LocalStore(str(p.parent))
        self._name = p.name
        self.path = p

    def write(self, report: ProgressReport) -> None:
        self._store.write(self._name, report.model_dump_json(by_alias=True, exclude_none=True).encode())


class ConfigMapSink:
    """Merge-patches ``data[key]`` of ConfigMap ``name`` in ``namespace`` with the report JSON.

    ``api_client`` defaults to the in-cluster configuration (ServiceAccount token and CA mounted in the
    pod), or, where ``KUBECONFIG`` is set, to that kubeconfig: a local process standing in for a pod
    (``make demo``, hack/demo.py) gets one holding a token of the pod's ServiceAccount. Tests pass a
    client pointed at a local HTTP server."""

    def __init__(self, name: str, namespace: str, key: str, api_client: Any = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            if os.environ.get("KUBECONFIG"):
                api_client = config.new_client_from_config(config_file=os.environ["KUBECONFIG"])  # type: ignore[no-untyped-call]
            else:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
                api_client = client.ApiClient()
        self._api = client.CoreV1Api(api_client)
        self.name, self.namespace, self.key = name, namespace, key

    def write(self, report: ProgressReport) -> None:
        body = {"data": {self.key: report.model_dump_json(by_alias=True, exclude_none=True)}}
        self._api.patch_namespaced_config_map(self.name, self.namespace, body)


def sink_for(rc: RunConfig, in_cluster: bool) -> ProgressSink | None:
    """The sink RunConfig.progress names: the ConfigMap in a pod, else the local file (or none)."""
    if in_cluster and rc.progress.config_map:
        return ConfigMapSink(rc.progress.config_map, rc.namespace, rc.progress.key)
    if rc.progress.file:
        return FileSink(rc.progress.file)
    return None


class StepLog:
    """JSON lines per step (stdout and optionally a file) and TensorBoard scalars."""

    def __init__(
        self, tensorboard_dir: str | None = None, jsonl_path: str | None = None, stream: TextIO | None = None
    ) -> None:
        self._stream = stream or sys.stdout
        self._file = Path(jsonl_path) if jsonl_path else None
        self._tb: Any = None
        self._remote: Store | None = None
        self._local: Path | None = None
        if tensorboard_dir:
            from tensorboardX import SummaryWriter

            logdir = tensorboard_dir
            if tensorboard_dir.startswith("gs://"):
                import tempfile

                self._remote = open_store(tensorboard_dir)
                self._local = Path(tempfile.mkdtemp(prefix="rljob-tb-"))
                logdir = str(self._local)
            self._tb = SummaryWriter(logdir=logdir, flush_secs=5)

    def event(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, sort_keys=True, default=_jsonable)
        print(line, file=self._stream, flush=True)
        if self._file is not None:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            with self._file.open("a", encoding="utf-8") as f:
                f.write(line + "\n")

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.event("step", step=step, **metrics)
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(float(v)):
                    self._tb.add_scalar(f"train/{k}", float(v), global_step=step)
            self._tb.flush()
            self._upload()

    def _upload(self) -> None:
        if self._remote is None or self._local is None:
            return
        for f in sorted(self._local.glob("events.out.tfevents.*")):
            try:
                self._remote.write(f.name, f.read_bytes())
            except Exception as e:  # observability only: never fail the run over it
                log.warning("TensorBoard events not uploaded (%s): %s", type(e).__name__, e)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._upload()
            self._tb = None


def _jsonable(x: Any) -> Any:
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


class Reporter:
    """Keeps the latest ProgressReport and writes it to a sink after every change."""

    def __init__(self, sink: ProgressSink | None) -> None:
        self.sink = sink
        self.report = ProgressReport()

    def update(self, **fields: Any) -> None:
        data = self.report.model_dump(by_alias=False)
        data.update(fields)
        if "step" in fields and "message" not in fields:
            data["message"] = None  # a step was reported: what preceded the first one is over
        data["update_time"] = datetime.now(UTC)
        self.report = ProgressReport.model_validate(data)
        if self.sink is None:
            return
        try:
            self.sink.write(self.report)
        except Exception as e:  # observability only: never fail the run over a report
            log.warning("progress report not written (%s): %s", type(e).__name__, e)
