"""The trainer's start check (rljob.trainer.devices) on a chip's own devices: JAX names this chip as the
generation table does, a plan of this chip's generation passes, a plan of every other generation is
refused naming the field (tests/trainer/test_devices.py: the same check on stand-ins)."""

from __future__ import annotations

from typing import Any


def test_the_chips_devices_pass_their_own_generations_plan_only(chip: Any, record: Any) -> None:
    import jax
    from fixtures.recipes import recipe_manifest, resolve
    from rljob.recipes.generations import BY_DEVICE_KIND, GENERATIONS
    from rljob.trainer import devices

    kind = chip.device_kind
    record("devices", "device_kind", kind, local=jax.local_device_count(), total=jax.device_count())
    assert kind in BY_DEVICE_KIND, f"{kind!r}: add it to its generation's device_kinds"
    mine = BY_DEVICE_KIND[kind]
    base = resolve(recipe_manifest("qwen3-0.6b-v5e")).trainer
    # The example's trainer with this machine's devices, on each generation's node pool in turn.
    local = jax.local_device_count()
    tpu = base.tpu.model_copy(update={"chips_per_container": local, "devices_per_chip": 1})
    for gen in GENERATIONS.values():
        plan = base.model_copy(
            update={"tpu": tpu.model_copy(update={"accelerator": gen.accelerator}), "devices": local}
        )
        got = devices.problems(plan, jax.local_devices(), jax.device_count())
        if gen is mine:
            assert got == [], got
        else:
            assert len(got) == 1 and got[0].startswith("spec.trainer.tpu: ") and kind in got[0], got
