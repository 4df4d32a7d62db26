"""The status models the operator writes: what a fresh or partly-scheduled job reports must validate
(the operator reads its own status back through them)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from rljob.recipes.api import RLJobStatus


@pytest.mark.parametrize(
    "status",
    [
        {},
        {"roles": {"trainer": {"ready": 0, "total": 0}, "sampler": {"ready": 0, "total": 0}}},
        {"restarts": {"used": 0, "left": 0}, "progress": {"step": 0}},
        {"phase": "Running", "roles": {"trainer": {"ready": 2, "total": 2}}, "jobSetName": "j"},
    ],
)
def test_status_a_job_can_report_validates_and_round_trips(status: dict[str, Any]) -> None:
    parsed = RLJobStatus.model_validate(status)
    assert RLJobStatus.model_validate(parsed.model_dump(by_alias=True)) == parsed


@pytest.mark.parametrize(
    ("status", "field"),
    [
        ({"roles": {"trainer": {"ready": -1, "total": 0}}}, "roles.trainer.ready"),
        ({"roles": {"sampler": {"ready": 0, "total": -2}}}, "roles.sampler.total"),
        ({"restarts": {"used": -1}}, "restarts.used"),
        ({"phase": "Exploded"}, "phase"),
    ],
)
def test_impossible_status_is_refused(status: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as err:
        RLJobStatus.model_validate(status)
    assert [".".join(map(str, e["loc"])) for e in err.value.errors()] == [field]
