"""The TPUs a trainer process sees, against the slice its run config was planned, fitted and compiled for.

A run's plan, its fit check and its compile stage are for one TPU generation and one number of devices
(rljob.recipes.runconfig.TrainerPlan). A process started on other TPUs (a node pool of another generation
behind the same selector, a container given fewer chips than the plan, a run config copied to a TPU VM of
another type) would otherwise get as far as MaxText's mesh, a compile on the chip or an out-of-memory error
before saying so, if it says so at all. :func:`problems` names each difference at start (``field:
message``); rljob-trainer exits 2 with all of them on one line, "; " apart (rljob.trainer.main: the operator
shows a failed container's last line). Devices other than TPUs (the CPU of the drills, the local runs and
the tests) are not checked, nor is a TPU whose kind the generation table does not know (a generation newer
than rljob's table may still be the one planned).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rljob.recipes.generations import BY_ACCELERATOR, BY_DEVICE_KIND
from rljob.recipes.runconfig import TrainerPlan

__all__ = ["problems"]


def problems(plan: TrainerPlan, local: Sequence[Any], total: int) -> list[str]:
    """How the TPU devices of this process (``local``: ``jax.local_devices()``) and of the whole trainer
    (``total``: ``jax.device_count()``) differ from ``plan``'s; empty when they agree or are not TPUs."""
    tpus = [d for d in local if d.platform == "tpu"]
    if not tpus:
        return []
    tpu = plan.tpu
    gen = BY_ACCELERATOR[tpu.accelerator]
    out = []
    kinds = sorted({str(d.device_kind) for d in tpus})
    others = sorted({BY_DEVICE_KIND[k].prefix for k in kinds if k in BY_DEVICE_KIND} - {gen.prefix})
    if others:
        out.append(
            f"spec.trainer.tpu: the run is planned for {tpu.type_name} ({gen.prefix}, node label "
            f"{tpu.accelerator}), but this process runs on {' and '.join(kinds)} ({', '.join(others)}): "
            "its fit and compiled programs are another chip's; schedule it on the planned node pool or "
            "plan it for these TPUs"
        )
    per_process = tpu.chips_per_container * tpu.devices_per_chip
    if len(tpus) != per_process:
        out.append(
            f"spec.trainer.tpu: each trainer process of {tpu.type_name} should see {per_process} TPU "
            f"device(s) ({tpu.chips_per_container} chip(s) of google.com/tpu x {tpu.devices_per_chip}), "
            f"this one sees {len(tpus)}"
        )
    elif total != plan.devices:
        out.append(
            f"spec.trainer.tpu: the trainer is planned for {plan.devices} TPU devices over {plan.slices} "
            f"slice(s) of {tpu.type_name}, its processes see {total} in all"
        )
    return out
