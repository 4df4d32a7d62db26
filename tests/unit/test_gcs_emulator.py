"""The GCS emulator's wiring (rljob.local.gcs_emulator): the environment that points every client at it and
the binary it runs. The emulator itself serves tests/unit/test_storage.py (tests/fixtures/gcs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rljob.local import gcs_emulator


def test_emulator_env_points_every_client_at_the_endpoint() -> None:
    assert gcs_emulator.emulator_env("http://127.0.0.1:4443") == {
        "STORAGE_EMULATOR_HOST": "http://127.0.0.1:4443",
        "TENSORSTORE_GCS_HTTP_URL": "http://127.0.0.1:4443",
        "GOOGLE_CLOUD_PROJECT": "rljob-test",
    }


def test_the_binary_override_is_taken_as_is(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    binary = tmp_path / "fake-gcs-server"
    binary.write_text("")
    monkeypatch.setenv("RLJOB_FAKE_GCS_SERVER", str(binary))
    assert gcs_emulator.fake_gcs_server_binary() == binary


def test_the_build_script_is_the_repo_s() -> None:
    assert (
        gcs_emulator.BUILD_SCRIPT.name == "build-fake-gcs-server.sh" and gcs_emulator.BUILD_SCRIPT.is_file()
    )
