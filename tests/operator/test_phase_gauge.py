"""The operator's gauge rljob_operator_rljobs{phase}: RLJobs per phase, kept as the watch reports them."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY
from rljob.operator.cache import Caches
from rljob.recipes.api import Phase


def _body(name: str, rv: int, phase: str | None, uid: str = "u") -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": name, "namespace": "ns", "uid": f"{uid}-{name}", "resourceVersion": str(rv)},
        "spec": {},
    }
    if phase is not None:
        body["status"] = {"phase": phase}
    return body


def _gauge() -> dict[str, float]:
    return {
        p.value: REGISTRY.get_sample_value("rljob_operator_rljobs", {"phase": p.value}) or 0.0 for p in Phase
    }


def test_phase_gauge_follows_the_watch() -> None:
    caches = Caches()
    assert set(_gauge().values()) == {0.0}  # every phase is exported, at 0
    caches.put_rljob(_body("a", 1, None))  # no status yet: Pending
    caches.put_rljob(_body("b", 1, "Running"))
    assert _gauge()["Pending"] == 1 and _gauge()["Running"] == 1
    caches.put_rljob(_body("a", 2, "Running"))
    assert _gauge()["Pending"] == 0 and _gauge()["Running"] == 2
    caches.put_rljob(_body("a", 1, "Failed"))  # an older resourceVersion is ignored
    assert _gauge()["Running"] == 2 and _gauge()["Failed"] == 0
    caches.put_rljob(_body("b", 3, "Succeeded"))
    caches.put_rljob(_body("a", 1, "Pending", uid="v"))  # deleted and created again under the same name
    assert _gauge() == {**dict.fromkeys(_gauge(), 0.0), "Pending": 1.0, "Succeeded": 1.0}
    caches.drop_rljob(("ns", "b"))
    caches.drop_rljob(("ns", "a"))
    caches.drop_rljob(("ns", "missing"))
    assert set(_gauge().values()) == {0.0}
