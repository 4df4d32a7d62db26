"""The metrics endpoint's authorization (rljob.operator.metrics.Authorizer) against a recorded API: which
reviews it sends, what it answers, what it caches. The real API server answers them in
test_namespaced_cluster.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rljob.operator.metrics import Authorizer


class Api:
    """TokenReview / SubjectAccessReview answers by token; records every request."""

    def __init__(self, users: dict[str, str | None], allowed: set[str]) -> None:
        self.users, self.allowed = users, allowed
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((path.rsplit("/", 1)[-1], body))
        if path.endswith("/tokenreviews"):
            user = self.users.get(body["spec"]["token"])
            if user is None:
                return {"status": {"authenticated": False}}
            return {
                "status": {"authenticated": True, "user": {"username": user, "groups": ["g"], "uid": "u"}}
            }
        return {"status": {"allowed": body["spec"]["user"] in self.allowed}}


@pytest.mark.parametrize(
    ("header", "code", "reviews"),
    [
        (None, 401, []),
        ("Basic abc", 401, []),
        ("Bearer ", 401, []),
        ("Bearer bogus", 401, ["tokenreviews"]),
        ("Bearer nobody-token", 403, ["tokenreviews", "subjectaccessreviews"]),
        ("Bearer reader-token", 200, ["tokenreviews", "subjectaccessreviews"]),
    ],
)
def test_only_callers_allowed_to_get_metrics(header: str | None, code: int, reviews: list[str]) -> None:
    api = Api({"nobody-token": "nobody", "reader-token": "reader"}, allowed={"reader"})
    assert asyncio.run(Authorizer(api).status(header)) == code
    assert [c[0] for c in api.calls] == reviews
    for kind, body in api.calls:
        if kind == "subjectaccessreviews":
            spec = body["spec"]
            assert spec["nonResourceAttributes"] == {"path": "/metrics", "verb": "get"}
            assert (spec["groups"], spec["uid"]) == (["g"], "u")


def test_answers_are_cached_an_allowed_one_longer() -> None:
    now = [100.0]
    api = Api({"reader-token": "reader", "nobody-token": "nobody"}, allowed={"reader"})
    auth = Authorizer(api, ttl_s=60, denied_ttl_s=5)

    async def scrape(token: str) -> int:
        return await auth.status(f"Bearer {token}")

    import rljob.operator.metrics as m

    real = m.time.monotonic
    m.time.monotonic = lambda: now[0]
    try:
        assert asyncio.run(scrape("reader-token")) == 200 and asyncio.run(scrape("nobody-token")) == 403
        assert len(api.calls) == 4
        now[0] += 4
        assert asyncio.run(scrape("reader-token")) == 200 and asyncio.run(scrape("nobody-token")) == 403
        assert len(api.calls) == 4  # both cached
        now[0] += 2
        api.allowed.add("nobody")  # granted meanwhile: seen once the refusal expires
        assert asyncio.run(scrape("nobody-token")) == 200 and asyncio.run(scrape("reader-token")) == 200
        assert len(api.calls) == 6
    finally:
        m.time.monotonic = real
