"""kopf wiring: the settings chosen for scale, and the admission handler's answers."""

from __future__ import annotations

import asyncio
import copy
import logging
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from rljob.operator import conditions as c
from rljob.operator.config import OperatorConfig
from rljob.operator.handlers import configure, on_validate

TESTED_MODULES = ("rljob.operator.config",)

REPO = Path(__file__).resolve().parents[2]


def example() -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load((REPO / "examples" / "qwen3-8b-v5p.yaml").read_text())
    body["metadata"]["namespace"] = "ns"
    return body


def validate(body: dict[str, Any], old: dict[str, Any] | None = None) -> None:
    operation = "UPDATE" if old is not None else "CREATE"
    asyncio.run(on_validate(kopf.Body(body), old=kopf.Body(old) if old else None, operation=operation))


def test_settings_for_scale() -> None:
    settings = kopf.OperatorSettings()
    configure(settings, OperatorConfig(webhook_enabled=False))
    assert settings.peering.standalone is True
    assert settings.queueing.worker_limit == 50
    assert settings.posting.loggers is False and settings.posting.level == logging.WARNING
    assert settings.persistence.finalizer == c.FINALIZER
    assert settings.scanning.disabled is True
    assert settings.watching.server_timeout == 300 and settings.watching.reconnect_backoff == 1.0
    assert settings.admission.server is None and settings.admission.managed is None
    configure(settings, OperatorConfig(webhook_cert=None, webhook_key=None))
    assert isinstance(settings.admission.server, kopf.WebhookServer)


def test_admission_accepts_the_example() -> None:
    validate(example())


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"lora": {"rank": 7}}, "spec.lora.rank"),
        ({"trainer": {"tpu": "v5p-8", "mesh": {"fsdp": 3}}}, "spec.trainer.mesh"),
        ({"bogus": 1}, "spec.bogus"),
        # Each of these crashed the webhook (an HTTP 500 with the exception's text) or made it allocate ~1 GB.
        ({"recipe": "../../examples/qwen3-8b-v5p"}, "spec.recipe"),
        ({"recipe": "a" * 300}, "spec.recipe"),
        ({"dataset": {"promptTemplate": "{question.x}"}}, "spec.dataset.promptTemplate"),
        ({"dataset": {"promptTemplate": "{question:>999999999}"}}, "spec.dataset.promptTemplate"),
        ({"algorithm": {"maxPromptTokens": 10**400}}, "spec.algorithm.maxPromptTokens"),
        ({"trainer": {"tpu": "v5p-8", "microBatchSize": 4 * 10**400}}, "spec.trainer.microBatchSize"),
        ({"queueName": "my queue"}, "spec.queueName"),
    ],
)
def test_admission_refuses_naming_the_field(patch: dict[str, Any], field: str) -> None:
    body = example()
    body["spec"].update(patch)
    with pytest.raises(kopf.AdmissionError) as err:
        validate(body)
    assert str(err.value).startswith(field) and err.value.code == 422


def test_admission_update_only_suspend_and_queue_may_change() -> None:
    old = example()
    new = copy.deepcopy(old)
    new["spec"].update(suspend=True, queueName="q")
    validate(new, old)
    new["spec"]["algorithm"] = {"steps": 7}
    with pytest.raises(kopf.AdmissionError) as err:
        validate(new, old)
    assert str(err.value).startswith("spec.algorithm: immutable")
