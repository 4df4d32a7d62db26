"""rljob.common.storage, the one layer over run storage: the same answers from a local directory and from
GCS (the emulator), atomic local writes, directory downloads (GCS's large objects in ranged reads), and
GCS errors as OSErrors that name what went wrong."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rljob.common import storage
from rljob.common.storage import NoCredentials, StorageError, open_store
from rljob.sampler.adapters import AdapterStore


@pytest.fixture(params=["local", "gcs"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "gcs":
        return str(request.getfixturevalue("gcs_bucket")) + "/ns/job"
    return str(tmp_path / "ns" / "job")


def test_write_read_list_delete(root: str) -> None:
    store = open_store(root)
    assert store.uri == root
    assert store.read("LATEST") is None and store.list() == [] and not store.exists("LATEST")
    for key in ("v1/adapter_config.json", "v1/adapter_model.safetensors", "v10/adapter_config.json"):
        store.write(key, key.encode())
    store.write("LATEST", b"1")
    assert store.read("v1/adapter_config.json") == b"v1/adapter_config.json"
    assert store.exists("LATEST") and not store.exists("v2/adapter_config.json")
    assert store.list() == [
        "LATEST",
        "v1/adapter_config.json",
        "v1/adapter_model.safetensors",
        "v10/adapter_config.json",
    ]
    assert store.list("v1/") == ["v1/adapter_config.json", "v1/adapter_model.safetensors"]
    assert store.list("v1") == [*store.list("v1/"), "v10/adapter_config.json"]  # a prefix, not a folder
    store.write("LATEST", b"10")  # overwrite
    assert store.read("LATEST") == b"10"
    store.delete("v10/adapter_config.json")
    store.delete("v10/adapter_config.json")  # deleting what is gone is not an error
    assert store.list("v10") == []


def test_download_copies_a_prefix_into_a_directory(root: str, tmp_path: Path) -> None:
    store = open_store(root)
    store.write("v3/adapter_model.safetensors", b"w" * 100)
    store.write("v3/sub/extra.json", b"{}")
    store.write("v30/adapter_config.json", b"not v3")
    dest = tmp_path / "out"
    assert store.download("v3/", dest) == ["v3/adapter_model.safetensors", "v3/sub/extra.json"]
    assert (dest / "adapter_model.safetensors").read_bytes() == b"w" * 100
    assert (dest / "sub" / "extra.json").read_bytes() == b"{}"
    assert sorted(p.name for p in dest.rglob("*")) == ["adapter_model.safetensors", "extra.json", "sub"]
    assert store.download("v4/", tmp_path / "none") == []


def test_gcs_downloads_large_objects_in_ranged_reads(
    gcs_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage, "CHUNKED_DOWNLOAD_BYTES", 1000)
    monkeypatch.setattr(storage, "CHUNK_BYTES", 256)
    data = os.urandom(4000)
    store = open_store(f"{gcs_bucket}/adapters")
    store.write("v1/adapter_model.safetensors", data)
    store.download("v1/", tmp_path, workers=4)
    assert (tmp_path / "adapter_model.safetensors").read_bytes() == data


def test_local_writes_are_atomic_and_hide_temporary_files(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    store.write("a/b", b"1")
    (tmp_path / "a" / ".b.partial").write_bytes(b"half")  # a writer's temporary file
    assert store.list() == ["a/b"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".b.partial", "b"]  # no temp left


def test_gcs_folder_placeholders_are_not_objects(gcs_bucket: str) -> None:
    store = open_store(gcs_bucket)
    store.write("adapters/v1/", b"")  # what a console "create folder" leaves
    store.write("adapters/v1/adapter_config.json", b"{}")
    assert store.list("adapters/") == ["adapters/v1/adapter_config.json"]


def test_gcs_errors_are_storage_errors(gcs_emulator: object) -> None:
    store = open_store("gs://rljob-no-such-bucket/x")
    assert store.read("LATEST") is None  # a missing bucket reads as a missing object
    with pytest.raises(StorageError) as e:
        store.write("LATEST", b"1")
    assert isinstance(e.value, OSError) and "rljob-no-such-bucket" in str(e.value)


def test_no_credentials_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # no metadata server probe
    with pytest.raises(NoCredentials):
        open_store("gs://bucket/ns/job")


def test_adapter_store_follows_latest_on_either_backend(root: str, tmp_path: Path) -> None:
    adapters = AdapterStore(f"{root}/adapters")
    assert adapters.latest() is None
    store = open_store(f"{root}/adapters")
    store.write("v2/adapter_config.json", b'{"r": 4}')
    store.write("LATEST", b"v2\n")
    assert adapters.latest() == 2
    path = adapters.download(2, tmp_path / "local" / "v2")
    assert (path / "adapter_config.json").read_bytes() == b'{"r": 4}'
    assert not (tmp_path / "local" / "v2.partial").exists()
    with pytest.raises(FileNotFoundError, match=r"/adapters/v3/ is empty$"):
        adapters.download(3, tmp_path / "local" / "v3")
    assert not (tmp_path / "local" / "v3").exists() and not (tmp_path / "local" / "v3.partial").exists()


# A key, or an object's name below a download's prefix, that climbs out of its folder ("ABS": an absolute
# path, made inside the test's own tmp_path so that a store that took it would write only there).
HOSTILE = ["../x", "a/../../x", "ABS", "v1/../../../x"]


@pytest.mark.parametrize("key", HOSTILE)
def test_keys_that_climb_out_are_refused(root: str, tmp_path: Path, key: str) -> None:
    """Every key operation refuses a key with a '..' segment or an absolute one, before touching storage:
    a local store would otherwise read, write or delete outside its root."""
    store = open_store(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    if key == "ABS":
        key = str(tmp_path / "abs" / "x")
    for op in (
        lambda: store.write(key, b"owned"),
        lambda: store.read(key),
        lambda: store.exists(key),
        lambda: store.delete(key),
        lambda: store.download(key.rpartition("/")[0] + "/" if "/" in key else key, outside / "dest"),
    ):
        with pytest.raises(StorageError, match="leads outside"):
            op()
    assert not list(outside.rglob("*")) and not (tmp_path / "x").exists() and not (tmp_path / "abs").exists()


def test_a_gcs_download_keeps_every_object_inside_dest(gcs_bucket: str, tmp_path: Path) -> None:
    """An object named `v1/../x` (anyone who can write the bucket can make one; GCS takes the name
    literally) is refused by the download instead of writing `dest/../x`, outside dest."""
    from google.cloud import storage as gcs  # type: ignore[import-untyped]

    bucket = gcs_bucket.removeprefix("gs://")
    client = gcs.Client()
    for name in ("v1/adapter_config.json", "v1/../escaped.json"):
        client.bucket(bucket).blob(f"job/{name}").upload_from_string(b"{}")
    store = open_store(f"{gcs_bucket}/job")
    assert "job/v1/../escaped.json" in [b.name for b in client.list_blobs(bucket)]  # GCS took the name
    dest = tmp_path / "area" / "dest"
    with pytest.raises(StorageError, match="leads outside"):
        store.download("v1/", dest)
    assert not (tmp_path / "area" / "escaped.json").exists()
    assert not list((tmp_path / "area").rglob("escaped.json"))
