"""Shared pytest set-up. Fixture modules live in tests/fixtures/; register each one below (one line each).

tests/ (not the repo root: ./operator would shadow the stdlib) goes on sys.path so that the fixture
modules import as `fixtures.<name>` under --import-mode=importlib.
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

pytest_plugins = [
    "fixtures.gcs",
    "fixtures.trainer_run",
    "fixtures.cluster",
    "fixtures.operator",
    "fixtures.cpu_sampler",
]
