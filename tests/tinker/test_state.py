"""The Tinker service's state on storage (rljob.trainer.tinker.server.state), on a local directory: where
each object lives and that what is written reads back."""

from __future__ import annotations

import json
from pathlib import Path

from rljob.trainer.tinker.server.auth import storage_key
from rljob.trainer.tinker.server.state import CHECKPOINTS_INDEX, REGISTRY, SAMPLING_DIR, SESSIONS_DIR, State


def _state(tmp_path: Path) -> State:
    return State(str(tmp_path / "ckpt"), str(tmp_path / "adapters"))


def test_the_registry_round_trips_under_the_tinker_folder(tmp_path: Path) -> None:
    st = _state(tmp_path)
    assert st.read_registry() == {}
    st.write_registry({"m1": {"owner": "k-1"}})
    assert st.read_registry() == {"models": {"m1": {"owner": "k-1"}}}
    assert json.loads((tmp_path / "ckpt" / "tinker" / REGISTRY).read_text()) == {
        "models": {"m1": {"owner": "k-1"}}
    }


def test_sessions_one_object_each_and_a_legacy_registry_s_too(tmp_path: Path) -> None:
    st = _state(tmp_path)
    (tmp_path / "ckpt" / "tinker").mkdir(parents=True)
    (tmp_path / "ckpt" / "tinker" / REGISTRY).write_text(
        json.dumps({"models": {}, "sessions": {"old": "k-0"}})
    )
    st.put_session("s/1", "k-1")
    st.put_session("s2", "k-2")
    assert (tmp_path / "ckpt" / "tinker" / SESSIONS_DIR / f"{storage_key('s/1')}.json").exists()
    assert st.sessions() == {"old": "k-0", "s/1": "k-1", "s2": "k-2"}
    st.drop_session("s/1")
    assert st.sessions() == {"old": "k-0", "s2": "k-2"}


def test_sampling_sessions(tmp_path: Path) -> None:
    st = _state(tmp_path)
    st.put_sampling("a", {"id": "a", "n": 1})
    st.put_sampling("b", {"id": "b", "n": 2})
    assert sorted(st.sampling(), key=lambda o: o["id"]) == [{"id": "a", "n": 1}, {"id": "b", "n": 2}]
    st.drop_sampling(["a"])
    st.drop_sampling([])
    assert st.sampling() == [{"id": "b", "n": 2}]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "tinker" / SAMPLING_DIR).iterdir()) == ["b.json"]


def test_a_model_s_folders_and_index_are_under_its_storage_key(tmp_path: Path) -> None:
    st = _state(tmp_path)
    model = "org/model.1"
    key = storage_key(model)
    assert st.model_dir(model, "auto") == f"{tmp_path}/ckpt/tinker/{key}/auto"
    assert st.sampler_dir(model, "w") == f"{tmp_path}/adapters/tinker/{key}/w"
    assert st.index(model) == {}
    st.write_index(model, {"c1": {"kind": "state"}})
    assert st.index(model) == {"c1": {"kind": "state"}}
    assert (tmp_path / "ckpt" / "tinker" / key / CHECKPOINTS_INDEX).exists()
    assert st.index("other") == {}
