"""The GCS emulator for local runs and tests (contract 6): fake-gcs-server on a free loopback port.

The binary is built from its Go module at the version pinned in hack/versions.env by
hack/build-fake-gcs-server.sh (into .cache/, once per version), or taken from ``RLJOB_FAKE_GCS_SERVER``.
Clients reach it exactly as GCS through the variables of :func:`emulator_env`: google-cloud-storage and
gcsfs read ``STORAGE_EMULATOR_HOST``, tensorstore (orbax's array layer) ``TENSORSTORE_GCS_HTTP_URL``.

  binary = fake_gcs_server_binary()
  proc, endpoint = start_fake_gcs_server(binary, workdir)
  os.environ.update(emulator_env(endpoint))
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from rljob.common.http import NO_RETRY, HttpError, shared
from rljob.common.ports import free_port

__all__ = ["BUILD_SCRIPT", "create_bucket", "emulator_env", "fake_gcs_server_binary", "start_fake_gcs_server"]

BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "hack" / "build-fake-gcs-server.sh"


def emulator_env(endpoint: str) -> dict[str, str]:
    """Environment variables pointing every GCS client we use at ``endpoint``."""
    return {
        "STORAGE_EMULATOR_HOST": endpoint,
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        # No ambient credentials: clients fall back to anonymous access against the emulator.
        "GOOGLE_CLOUD_PROJECT": "rljob-test",
    }


def fake_gcs_server_binary() -> Path:
    """``RLJOB_FAKE_GCS_SERVER`` or the binary hack/build-fake-gcs-server.sh builds (or reuses)."""
    override = os.environ.get("RLJOB_FAKE_GCS_SERVER")
    if override:
        return Path(override)
    out = subprocess.run([str(BUILD_SCRIPT)], check=True, capture_output=True, text=True, timeout=1200).stdout
    return Path(out.strip().splitlines()[-1])


def start_fake_gcs_server(binary: Path, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start an in-memory fake-gcs-server on a free loopback port; returns (process, endpoint) once it
    answers. Its log goes to ``workdir/fake-gcs-server.log``."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_path = workdir / "fake-gcs-server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                str(binary),
                *("-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory"),
                *("-public-host", f"127.0.0.1:{port}", "-external-url", endpoint, "-log-level", "warn"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
        )
    deadline = time.monotonic() + 30
    while True:
        try:
            if shared().get(f"{endpoint}/storage/v1/b", timeout=2, retry=NO_RETRY).status == 200:
                return proc, endpoint
        except HttpError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"fake-gcs-server did not start; see {log_path}")
        time.sleep(0.1)


def create_bucket(endpoint: str, name: str) -> None:
    """Create a bucket on the emulator at ``endpoint`` (the JSON API's buckets.insert)."""
    shared().post(f"{endpoint}/storage/v1/b?project=rljob-test", json={"name": name}, timeout=10)


def main(argv: list[str] | None = None) -> int:
    """``python -m rljob.local.gcs_emulator --workdir DIR --bucket NAME``: start the emulator with a
    bucket, print ``{"endpoint": ..., "env": emulator_env(...)}`` as one JSON line and serve until
    SIGTERM (``rljob drill``, whose command line cannot import the trainer package, runs it this way)."""
    import argparse
    import json
    import signal

    p = argparse.ArgumentParser(prog="python -m rljob.local.gcs_emulator")
    p.add_argument("--workdir", required=True)
    p.add_argument("--bucket", action="append", default=[])
    args = p.parse_args(argv)
    proc, endpoint = start_fake_gcs_server(fake_gcs_server_binary(), Path(args.workdir))
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    for bucket in args.bucket:
        create_bucket(endpoint, bucket)
    print(json.dumps({"endpoint": endpoint, "env": emulator_env(endpoint)}), flush=True)
    code = proc.wait()
    return 0 if code in (0, -signal.SIGTERM) else 1


if __name__ == "__main__":
    raise SystemExit(main())
