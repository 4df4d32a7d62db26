"""Whether the cluster's JobSet admits the failure action RestartJob: an input of every plan this operator
makes (rljob.recipes.plan.resolve `restart_job`), from the chart's `jobset.restartJob`
(RLJOB_JOBSET_RESTART_JOB):

- enabled: render the sampler's own restart (RestartJob) without asking; a JobSet without the gate
  refuses every run, which the RLJob's status then says;
- disabled: render the fallback (a sampler crash restarts the whole run, rljob.recipes.failure);
- auto (the default): a server-side dry run of rljob.recipes.failure.restart_job_probe at start-up, the
  same JobSet `rljob doctor` dry-runs; while that cannot tell (JobSet not installed yet, its webhook
  down), RestartJob is assumed, and a run's JobSet that the webhook refuses for the gate turns it off for
  every later plan (the refused run is planned again at its retry).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rljob.operator import k8s
from rljob.recipes import failure

logger = logging.getLogger(__name__)

SETTINGS = ("auto", "enabled", "disabled")


class RestartJobGate:
    """The current answer, `admitted`; `changed` is called (to drop cached plans) when it flips."""

    def __init__(self, setting: str = "auto", changed: Callable[[], None] | None = None) -> None:
        if setting not in SETTINGS:
            raise ValueError(f"RLJOB_JOBSET_RESTART_JOB: {setting!r} is not one of {', '.join(SETTINGS)}")
        self.setting = setting
        self.admitted = setting != "disabled"
        self.changed = changed

    def _set(self, admitted: bool, why: str) -> None:
        if admitted != self.admitted:
            self.admitted = admitted
            logger.warning(
                "JobSet's failure action RestartJob is %s (%s): from now on %s",
                "admitted" if admitted else "refused",
                why,
                failure.explain(failure.sampler_failure(admitted)),
            )
            if self.changed is not None:
                self.changed()

    async def probe(self, kube: k8s.Kube, namespace: str) -> bool | None:
        """With `auto`: dry-run the probe JobSet in `namespace` and keep what it says (None: it could not
        tell, `admitted` unchanged)."""
        if self.setting != "auto":
            return None
        try:
            await kube.dry_run_create(k8s.JOBSET, failure.restart_job_probe(namespace))
            error = None
        except k8s.ApiError as exc:
            error = str(exc)
        except Exception as exc:  # the API server unreachable: nothing learned
            logger.warning("the RestartJob probe (a dry-run JobSet) failed: %s", exc)
            return None
        said = failure.restart_job_admitted(error)
        if said is None:
            logger.warning("the RestartJob probe (a dry-run JobSet) could not tell: %s", error)
            return None
        self._set(said, "a dry-run JobSet at start-up" if error is None else error)
        logger.info("JobSet %s the failure action RestartJob", "admits" if said else "refuses")
        return said

    def refused(self, error: str) -> bool:
        """A run's JobSet was refused with `error`; with `auto`, a refusal for the gate turns RestartJob off.
        True when that changed the answer (the caller plans the run again)."""
        if self.setting != "auto" or not self.admitted or failure.restart_job_admitted(error) is not False:
            return False
        self._set(False, error)
        return True
