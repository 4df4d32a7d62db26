"""What a sampler must never be sent (rljob.trainer.tinker.server.sampling_routes.sampling_problems): one
line per problem of a sampling request, none for a good one."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from rljob.trainer.tinker.server.sampling_routes import MAX_SEED, MAX_STOPS, bad_request, sampling_problems

GOOD = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": None, "stop": None}


def _sp(**over: Any) -> SimpleNamespace:
    return SimpleNamespace(**{**GOOD, **over})


@pytest.mark.parametrize(
    ("prompt", "over", "want"),
    [
        ([1, 2, 3], {}, []),
        ([], {"seed": 0, "stop": "\n", "temperature": 0.0}, []),
        ([1, 9, 3], {"seed": MAX_SEED, "stop": [0, 9, "x"], "top_k": 5}, []),
        ([1, 10], {}, ["prompt: token 10 at 1 is outside the vocabulary [0, 10)"]),
        ([-1, 3], {}, ["prompt: token -1 at 0 is outside the vocabulary [0, 10)"]),
        ([1], {"temperature": float("nan")}, ["sampling_params.temperature: nan; a finite number >= 0"]),
        ([1], {"temperature": -0.5}, ["sampling_params.temperature: -0.5; a finite number >= 0"]),
        ([1], {"top_p": 0.0}, ["sampling_params.top_p: 0.0; in (0, 1]"]),
        ([1], {"top_p": 1.01}, ["sampling_params.top_p: 1.01; in (0, 1]"]),
        ([1], {"top_k": -2}, ["sampling_params.top_k: -2; -1 (off) or more"]),
        ([1], {"seed": -1}, ["sampling_params.seed: -1; 0..2^63-1"]),
        ([1], {"seed": MAX_SEED + 1}, [f"sampling_params.seed: {MAX_SEED + 1}; 0..2^63-1"]),
        ([1], {"stop": [10]}, ["sampling_params.stop: token ids must lie in [0, 10)"]),
        (
            [1],
            {"stop": ["s"] * (MAX_STOPS + 1)},
            [f"sampling_params.stop: {MAX_STOPS + 1} entries; at most {MAX_STOPS}"],
        ),
    ],
)
def test_sampling_problems(prompt: list[int], over: dict[str, Any], want: list[str]) -> None:
    assert sampling_problems(np.array(prompt, np.int64), _sp(**over), 10) == want


def test_every_problem_at_once() -> None:
    got = sampling_problems(np.array([99]), _sp(temperature=-1.0, top_p=2.0, top_k=-3, seed=-1), 10)
    assert [line.split(":")[0] for line in got] == [
        "prompt",
        "sampling_params.temperature",
        "sampling_params.top_p",
        "sampling_params.top_k",
        "sampling_params.seed",
    ]


def test_without_a_vocabulary_token_ids_are_not_checked() -> None:
    assert sampling_problems(np.array([10**9]), _sp(stop=[10**9]), None) == []


def test_bad_request_carries_every_line() -> None:
    err = bad_request(["a: x", "b: y"])
    assert err.status == 400
    assert json.loads(err.text or "") == {"error": "a: x\nb: y"}
