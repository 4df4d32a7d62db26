"""The chip tier (marker ``tpu``): what only a TPU runs, on a TPU, with the values asserted.

Skipped where JAX sees no TPU (every machine of CI, which has none; ``make test`` collects and skips them).
On a TPU machine: hack/tpu/README.md (``make tpu-bundle``, then ``pytest -m tpu tests/tpu`` with
``JAX_PLATFORMS=tpu,cpu``). Each test appends its figures as JSON lines (``test``, ``metric``, ``value``,
context) to ``$RLJOB_TPU_FIGURES`` when set, so a run's numbers come back as one file.

One program holds the chip at a time: run the tier in one process (no ``-n``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

Record = Callable[..., None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.tpu)


@pytest.fixture(scope="session")
def chip() -> Any:
    """The TPU device the tier runs on; the test is skipped without one."""
    if "tpu" not in os.environ.get("JAX_PLATFORMS", "tpu"):
        pytest.skip("JAX_PLATFORMS leaves the TPU out (set JAX_PLATFORMS=tpu,cpu on a TPU machine)")
    import jax

    devices = [d for d in jax.devices() if d.platform == "tpu"]
    if not devices:
        pytest.skip("no TPU: the chip tier runs on a TPU machine (hack/tpu/README.md)")
    return devices[0]


@pytest.fixture(scope="session")
def record() -> Iterator[Record]:
    """``record(test, metric, value, **context)``: one JSON line to $RLJOB_TPU_FIGURES (and stdout)."""
    path = os.environ.get("RLJOB_TPU_FIGURES")
    out = open(path, "a") if path else None  # noqa: SIM115

    def write(test: str, metric: str, value: float, **context: Any) -> None:
        line = json.dumps({"test": test, "metric": metric, "value": value, **context})
        print(line)
        if out is not None:
            out.write(line + "\n")
            out.flush()

    yield write
    if out is not None:
        out.close()
