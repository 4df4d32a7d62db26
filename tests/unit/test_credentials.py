"""The run's own credential (rljob.common.credentials): the token, its environment, its header and the
constant-time check of a header."""

from __future__ import annotations

import re

import pytest
from rljob.common import credentials
from rljob.recipes.runconfig import RUN_TOKEN_ENV


def test_a_new_token_is_43_url_safe_characters_and_fresh() -> None:
    tokens = {credentials.new_token() for _ in range(20)}
    assert len(tokens) == 20
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{43}", t) for t in tokens), tokens


def test_token_env_names_the_run_token_variable() -> None:
    assert credentials.token_env("abc") == {RUN_TOKEN_ENV: "abc"}
    drawn = credentials.token_env()
    assert list(drawn) == [RUN_TOKEN_ENV] and len(drawn[RUN_TOKEN_ENV]) == 43


@pytest.mark.parametrize(
    ("environ", "token"),
    [({RUN_TOKEN_ENV: "t0k"}, "t0k"), ({RUN_TOKEN_ENV: ""}, None), ({}, None), ({"OTHER": "x"}, None)],
)
def test_run_token_reads_the_variable_and_treats_empty_as_unset(
    environ: dict[str, str], token: str | None
) -> None:
    assert credentials.run_token(environ) == token


@pytest.mark.parametrize(
    ("token", "headers"), [("t0k", {"Authorization": "Bearer t0k"}), (None, {}), ("", {})]
)
def test_bearer(token: str | None, headers: dict[str, str]) -> None:
    assert credentials.bearer(token) == headers


@pytest.mark.parametrize(
    ("header", "ok"),
    [
        ("Bearer t0k", True),
        ("Bearer t0k ", False),
        ("bearer t0k", False),
        ("t0k", False),
        ("Bearer t0", False),
        ("Bearer t0kk", False),
        ("", False),
        (None, False),
    ],
)
def test_authorized_takes_only_the_exact_header(header: str | None, ok: bool) -> None:
    assert credentials.authorized(header, "t0k") is ok


def test_authorized_accepts_what_bearer_sends() -> None:
    token = credentials.new_token()
    assert credentials.authorized(credentials.bearer(token)["Authorization"], token)
    assert not credentials.authorized(credentials.bearer(credentials.new_token())["Authorization"], token)
