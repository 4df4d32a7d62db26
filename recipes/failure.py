"""Failure handling: the exit-code contract of every entrypoint and the JobSet rules that enforce it.

Contract 3:
- exit 0 (`EXIT_OK`): done;
- exit 2 (`EXIT_BAD_CONFIG`): bad configuration, the JobSet fails at once, no restart;
- any other non-zero exit: a restart counted against spec.failurePolicy.maxRestarts;
- preemption / maintenance (pod condition DisruptionTarget, e.g. node deleted or pod evicted): a
  restart NOT counted.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_BAD_CONFIG = 2
