"""Shared pytest set-up. Fixture modules live in tests/fixtures/; register each one below (one line each).

tests/ (not the repo root: ./operator would shadow the stdlib) goes on sys.path so that the fixture
modules import as `fixtures.<name>` under --import-mode=importlib.
"""

import os
import sys
from pathlib import Path

# The dev venv has libtpu (pyproject's compile extra, for `rljob drill --compile`): every test runs JAX on
# the CPU, in this process and in the processes it starts with its environment, unless the caller set a
# platform. The compile stage's TPU topology comes from libtpu whatever this says.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

pytest_plugins = [
    "fixtures.gcs",
    "fixtures.trainer_run",
    "fixtures.cluster",
    "fixtures.operator",
    "fixtures.cpu_sampler",
    "fixtures.kueue",
]


EXIT_GRACE_S = 60.0


def pytest_unconfigure(config: object) -> None:
    """Fail fast, with every thread's stack, if the process does not exit after the run.

    A thread a test leaves blocked (a non-daemon thread, or a ThreadPoolExecutor worker, which Python
    joins at exit) keeps pytest alive after its summary; CI then hits its wall-clock limit with no clue.
    This daemon thread dumps the stacks and exits with 3 instead."""
    import faulthandler
    import os
    import threading
    import time

    def watchdog() -> None:
        time.sleep(EXIT_GRACE_S)
        sys.stderr.write(
            f"\npytest: still running {EXIT_GRACE_S:.0f}s after the session ended; a test left a thread "
            "blocked. Stacks:\n"
        )
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()
