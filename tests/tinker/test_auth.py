"""Who is calling (rljob.trainer.tinker.server.auth): the Secret's keys, a key's owner id, which keys are
accepted, and a model id as one storage path segment."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rljob.trainer.tinker.server import auth


@pytest.mark.parametrize(
    ("raw", "keys", "problems"),
    [
        ("tml-a,tml-b", {"tml-a", "tml-b"}, 0),
        (" tml-a , ,tml-a,", {"tml-a"}, 0),
        ("", set(), 0),
        ("tml-a,abc,tml-", {"tml-a"}, 2),
        ("TML-a", set(), 1),
    ],
)
def test_parse_api_keys(raw: str, keys: set[str], problems: int) -> None:
    got, lines = auth.parse_api_keys(raw)
    assert got == frozenset(keys)
    assert len(lines) == problems
    assert all("must start with tml-" in line for line in lines)
    assert not any(k in line for line in lines for k in ("abc", "TML-a"))  # keys are never echoed


def test_the_problems_name_the_entry() -> None:
    _, lines = auth.parse_api_keys("tml-a,abc,tml-")
    assert [line.split(" is ")[0] for line in lines] == ["entry 2", "entry 3"]


def test_key_owner_is_a_digest_that_holds_no_key() -> None:
    owner = auth.key_owner("tml-secret")
    assert re.fullmatch(r"k-[0-9a-f]{32}", owner)
    assert "secret" not in owner
    assert owner == auth.key_owner("tml-secret") != auth.key_owner("tml-secres")


ALLOWED = frozenset({"tml-a", "tml-b"})


@pytest.mark.parametrize(
    ("key", "dev", "accepted"),
    [
        ("tml-a", False, True),
        ("tml-b", False, True),
        ("tml-c", False, False),
        ("tml-c", True, True),  # the development switch takes any tml- key
        ("abc", True, False),  # but only those
        (None, True, False),
        ("", False, False),
        ("tml-" + "x" * (auth.MAX_KEY_BYTES - 4), True, True),
        ("tml-" + "x" * (auth.MAX_KEY_BYTES - 3), True, False),
    ],
)
def test_authenticate(key: str | None, dev: bool, accepted: bool) -> None:
    got = auth.authenticate(key, ALLOWED, dev_any_key=dev)
    assert got == (auth.key_owner(key) if accepted and key else None)


def test_storage_key_keeps_safe_characters_and_escapes_the_rest() -> None:
    assert auth.storage_key("Model-1") == "Model-1"
    assert auth.storage_key("a_b.c/d") == "a_5fb_2ec_2fd"
    assert auth.storage_key("..") == "_2e_2e"
    assert auth.storage_key("é") == "_c3_a9"


@given(st.text(), st.text())
def test_storage_key_is_one_to_one_and_one_segment(a: str, b: str) -> None:
    ka, kb = auth.storage_key(a), auth.storage_key(b)
    assert (ka == kb) is (a == b)
    assert "/" not in ka and ka not in (".", "..")
    assert re.fullmatch(r"[A-Za-z0-9_-]*", ka)
