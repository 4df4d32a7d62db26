"""Caches that make a restart cheap (rljob.common.caches): copied between storage.cache and local disk,
and the CPU sampler's second start on a fresh disk restoring its JAX compilation cache and compiling nothing
new (it says what it restored and how long it took)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rljob.common import caches
from rljob.common.credentials import bearer, new_token, token_env
from rljob.common.storage import open_store
from rljob.local.localrun import local_run_config
from rljob.recipes.runconfig import LOCAL_CACHE_ENV

TOKEN = new_token()  # the run's token: the sampler requires it


def test_restore_and_save_copy_only_what_is_missing(tmp_path: Path) -> None:
    uri = str(tmp_path / "storage" / "cache" / "jax")
    first = tmp_path / "disk1" / "jax"
    (first / "sub").mkdir(parents=True)
    (first / "a-cache").write_bytes(b"a" * 10)
    (first / "sub" / "b-cache").write_bytes(b"bb")
    (first / "c.rljob-partial").write_bytes(b"half")  # an interrupted copy is never seeded
    assert caches.save(uri, first) == 2
    assert sorted(open_store(uri).list()) == ["a-cache", "sub/b-cache"]
    assert caches.save(uri, first) == 0  # storage already has them

    second = tmp_path / "disk2" / "jax"
    r = caches.restore("jax", uri, second)
    assert (r.files, r.present, r.bytes) == (2, 0, 12)
    assert (second / "sub" / "b-cache").read_bytes() == b"bb"
    assert "restored 2 files" in r.line()
    again = caches.restore("jax", uri, second)
    assert (again.files, again.present) == (0, 2)
    empty = caches.restore("jax", str(tmp_path / "nothing"), tmp_path / "disk3")
    assert (empty.files, empty.present) == (0, 0) and "first start" in empty.line()


def test_a_linked_file_is_saved_once(tmp_path: Path) -> None:
    """The Hugging Face cache links each snapshot file to its blob: the weights are saved (and restored onto
    the next host's cache disk, rljob.recipes.disk) once, not twice."""
    uri = str(tmp_path / "storage" / "cache" / "hf")
    local = tmp_path / "disk" / "hf"
    blob = local / "models--o--m" / "blobs" / "0123abcd"
    snapshot = local / "models--o--m" / "snapshots" / "rev" / "model.safetensors"
    blob.parent.mkdir(parents=True)
    snapshot.parent.mkdir(parents=True)
    blob.write_bytes(b"w" * 100)
    snapshot.symlink_to(os.path.relpath(blob, snapshot.parent))
    assert caches.save(uri, local) == 1
    assert open_store(uri).list() == ["models--o--m/blobs/0123abcd"]
    r = caches.restore("hf", uri, tmp_path / "disk2" / "hf")
    assert (r.files, r.bytes) == (1, 100)


def _start(cfg: Path, port: int, local: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "rljob.sampler.main", "--config", str(cfg), "--backend", "cpu"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--no-watch"]
    env = {**os.environ, LOCAL_CACHE_ENV: str(local), **token_env(TOKEN)}
    return subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)


def _serve_one_and_stop(proc: subprocess.Popen[str], port: int) -> str:
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the CPU sampler did not come up"
        try:
            models = urllib.request.Request(f"{base}/v1/models", headers=bearer(TOKEN))
            with urllib.request.urlopen(models, timeout=2) as r:
                model = json.loads(r.read())["data"][0]["id"]
            break
        except OSError:
            time.sleep(1.0)
    # As vLLM with --api-key: /health open, every /v1 path only with the run's token.
    with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
        assert r.status == 200
    for headers in ({}, bearer("not-the-token")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(f"{base}/v1/models", headers=headers), timeout=2)
        assert refused.value.code == 401
    body = json.dumps({"model": model, "prompt": [[1, 2, 3]], "max_tokens": 4, "logprobs": 0}).encode()
    req = urllib.request.Request(
        f"{base}/v1/completions", body, {"Content-Type": "application/json", **bearer(TOKEN)}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        assert len(json.loads(r.read())["choices"]) == 1
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    return err


@pytest.mark.jax
@pytest.mark.slow
def test_a_restart_on_a_fresh_disk_restores_the_compilation_cache_and_compiles_nothing_new(
    gcs_bucket: str, tmp_path: Path
) -> None:
    port = 18000 + os.getpid() % 1000
    cfg = tmp_path / "run.json"
    rc = local_run_config(gcs_bucket, port, tmp_path / "progress.json")
    cfg.write_text(rc.model_dump_json(by_alias=True))

    err1 = _serve_one_and_stop(_start(cfg, port, tmp_path / "disk1"), port)
    assert "cache jax-sampler: nothing at" in err1 and "(first start)" in err1
    saved = [
        ln for ln in err1.splitlines() if "new files saved to" in ln and ln.startswith("cache jax-sampler")
    ]
    assert saved and int(saved[-1].split(": ")[1].split()[0]) > 0, err1[-2000:]

    # The replacement machine: an empty local disk, the same storage.
    err2 = _serve_one_and_stop(_start(cfg, port, tmp_path / "disk2"), port)
    restored = [ln for ln in err2.splitlines() if ln.startswith("cache jax-sampler: restored")]
    assert restored, err2[-2000:]
    print(restored[0])  # what was restored and how long it took
    n = int(restored[0].split("restored ")[1].split()[0])
    assert n == len(open_store(f"{rc.storage.cache}/{caches.JAX_SAMPLER}").list()) > 0
    # Every compilation of the second start was a cache hit: nothing new to seed.
    assert "cache jax-sampler: 0 new files saved to" in err2, err2[-2000:]
