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


def test_a_flood_of_unknown_tokens_costs_a_bounded_number_of_reviews() -> None:
    """10,000 unknown tokens at one instant: at most `burst` reviews reach the API (the rest 429 at once,
    no API call); the allowed scraper's cached answer survives the flood (refusals never evict it) and
    the cache never grows past its size."""
    import rljob.operator.metrics as m

    now = [100.0]
    api = Api({"reader-token": "reader"}, allowed={"reader"})
    real = m.time.monotonic
    m.time.monotonic = lambda: now[0]
    try:
        auth = Authorizer(api, size=64, rate_per_s=5, burst=20)

        async def flood() -> list[int]:
            assert await auth.status("Bearer reader-token") == 200
            return [await auth.status(f"Bearer unknown-{i}") for i in range(10_000)]

        codes = asyncio.run(flood())
        reviews = len(api.calls)
        assert (codes.count(401), codes.count(429), reviews) == (19, 10_000 - 19, 2 + 19)  # 10,000 tried
        assert asyncio.run(auth.status("Bearer reader-token")) == 200 and len(api.calls) == reviews
        assert len(auth._denied) <= 64 and len(auth._allowed) == 1
        now[0] += 1.0  # the bucket refills at rate_per_s
        codes = asyncio.run(_many(auth, [f"later-{i}" for i in range(100)]))
        assert codes.count(401) == 5 and codes.count(429) == 95
    finally:
        m.time.monotonic = real


async def _many(auth: Authorizer, tokens: list[str]) -> list[int]:
    return [await auth.status(f"Bearer {t}") for t in tokens]


def test_reviews_in_flight_are_bounded() -> None:
    """A slow API server: at most `concurrency` reviews wait on it; the other callers are 429 at once."""
    gate = asyncio.Event()
    in_flight = [0, 0]

    async def slow(method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        await gate.wait()
        in_flight[0] -= 1
        return {"status": {"authenticated": False}}

    async def go() -> list[int]:
        auth = Authorizer(slow, concurrency=3, burst=100)
        tasks = [asyncio.create_task(auth.status(f"Bearer t{i}")) for i in range(50)]
        await asyncio.sleep(0.05)
        gate.set()
        return list(await asyncio.gather(*tasks))

    codes = asyncio.run(go())
    assert in_flight[1] == 3 and codes.count(401) == 3 and codes.count(429) == 47


def test_an_allowed_token_is_not_evicted_by_refusals_and_the_cache_drops_one_entry_at_a_time() -> None:
    api = Api({"a": "reader", "b": "reader"}, allowed={"reader"})
    auth = Authorizer(api, size=2, burst=100)
    for token in ("a", "b", "x1", "x2", "x3"):
        asyncio.run(auth.status(f"Bearer {token}"))
    assert list(auth._allowed) and len(auth._allowed) == 2 and len(auth._denied) == 2
    calls = len(api.calls)
    assert asyncio.run(auth.status("Bearer a")) == 200 and len(api.calls) == calls  # still cached
