"""The background adapter publisher: LATEST never names a version whose files are not all written, a
newer export supersedes a queued one, the last export is flushed at close, upload errors surface on the
caller's thread."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rljob.trainer.export import AdapterPublisher, PublishError, latest_version, publish_adapter, read_adapter


def _tensors(version: int) -> dict[str, np.ndarray]:
    return {"a.lora_A.weight": np.full((256, 1024), version, np.float32), "a.lora_B.weight": np.arange(8.0)}


def test_latest_only_names_complete_versions_and_close_flushes(tmp_path: Path) -> None:
    uri = str(tmp_path / "adapters")

    def slow_publish(u: str, v: int, t: dict[str, np.ndarray], c: dict[str, Any]) -> str:
        time.sleep(0.05)
        return publish_adapter(u, v, t, c)

    pub = AdapterPublisher(uri, {"r": 8}, publish=slow_publish)
    seen: list[int] = []
    problems: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            v = latest_version(uri)
            if v is None:
                continue
            try:
                tensors, config = read_adapter(uri, v)
            except FileNotFoundError as e:
                problems.append(f"LATEST={v} but {e}")
                continue
            if config != {"r": 8} or float(tensors["a.lora_A.weight"][0, 0]) != v:
                problems.append(f"LATEST={v} names other contents")
            seen.append(v)

    t = threading.Thread(target=reader)
    t.start()
    for v in range(12):
        pub.submit(v, _tensors(v))  # returns at once: the training loop never waits for an upload
        time.sleep(0.01)
    pub.close()
    stop.set()
    t.join()
    assert problems == []
    assert seen == sorted(seen), "LATEST moved backwards"
    assert latest_version(uri) == 11 and pub.published == 11
    assert pub.superseded, "exports queued behind a slow upload were not superseded"
    written = {int(p.name[1:]) for p in (tmp_path / "adapters").glob("v*")}
    assert written.isdisjoint(pub.superseded) and 11 in written


def test_upload_error_surfaces_at_the_next_submit_and_at_close(tmp_path: Path) -> None:
    def broken(u: str, v: int, t: dict[str, np.ndarray], c: dict[str, Any]) -> str:
        raise OSError("bucket gone")

    pub = AdapterPublisher(str(tmp_path), {}, publish=broken)
    pub.submit(1, _tensors(1))
    with pytest.raises(PublishError, match=r"/v\d+: adapter upload failed: bucket gone"):
        for v in range(2, 500):  # the next step's submit raises once the upload has failed
            pub.submit(v, _tensors(v))
            time.sleep(0.01)
    with contextlib.suppress(PublishError):  # an export queued before the failure surfaced fails too
        pub.flush(timeout=10)
    pub.submit(1000, _tensors(1000))
    with pytest.raises(PublishError, match=r"/v1000: adapter upload failed"):
        pub.close()
    assert latest_version(str(tmp_path)) is None
