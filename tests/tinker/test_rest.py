"""RestClient's routes' parameters (rljob.trainer.tinker.server.rest); the routes themselves answer the
Tinker SDK's RestClient in tests/tinker/test_tinker_sdk.py."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request
from rljob.trainer.tinker.engine import RequestError
from rljob.trainer.tinker.server import rest


@pytest.mark.parametrize(("query", "value"), [("", 20), ("?limit=5", 5), ("?limit=0", 0), ("?offset=3", 20)])
def test_an_integer_parameter_or_its_default(query: str, value: int) -> None:
    assert rest._int_param(make_mocked_request("GET", "/x" + query), "limit", 20) == value


@pytest.mark.parametrize("raw", ["-1", "1.5", "x", "%20"])
def test_anything_but_a_non_negative_integer_is_refused_naming_it(raw: str) -> None:
    with pytest.raises(RequestError, match=r"^limit: .*; a non-negative integer$"):
        rest._int_param(make_mocked_request("GET", f"/x?limit={raw}"), "limit", 20)


def test_times_are_utc_iso() -> None:
    assert rest._iso(0) == "1970-01-01T00:00:00+00:00"
    assert rest._iso(1.5) == "1970-01-01T00:00:01.500000+00:00"
