"""rljob.trainer.devices: a trainer process on other TPUs than its plan's is refused at start, one line per
difference naming the field; the planned TPUs, the CPU and a TPU the table does not know pass.

The devices are stand-ins with JAX's two attributes the check reads (``platform``, ``device_kind``); the
kinds are JAX's own names (rljob.recipes.generations, ``device_kinds``; "TPU v5 lite" read on a v5e chip).
tests/tpu/test_devices_chip.py runs the check on a chip's own devices."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import recipe_manifest, resolve
from rljob.recipes import libtpu
from rljob.recipes.failure import EXIT_BAD_CONFIG
from rljob.recipes.generations import BY_DEVICE_KIND, GENERATIONS
from rljob.recipes.runconfig import TrainerPlan
from rljob.trainer import devices


@dataclass(frozen=True)
class Device:
    device_kind: str
    platform: str = "tpu"


@cache
def plan(recipe: str) -> TrainerPlan:
    return resolve(recipe_manifest(recipe)).trainer


def on(kind: str, n: int, platform: str = "tpu") -> list[Any]:
    return [Device(kind, platform)] * n


# recipe (its trainer: type, devices per process, devices in all), this process's devices, devices in all,
# the lines expected (substrings, one per line; [] accepts).
CASES = [
    ("qwen3-0.6b-v5e", on("TPU v5 lite", 4), 4, []),  # v5litepod-4, one host
    ("qwen3-0.6b-v5e", on("TPU v5e", 4), 4, []),  # JAX's other name of the same chip
    ("qwen3-8b-v6e", on("TPU v6 lite", 8), 8, []),  # v6e-8
    ("qwen3-8b-v5p", on("TPU v5", 4), 4, []),  # v5p-8: 4 megacore devices
    ("qwen3-30b-a3b-tpu7x", on("TPU7x", 4), 128, []),  # tpu7x-128: 2 chips a container, 2 devices a chip
    ("qwen3-0.6b-v5e", on("cpu", 1, "cpu"), 1, []),  # the drills' and the tests' CPU: not checked
    ("qwen3-0.6b-v5e", on("TPU v9 ultra", 4), 4, []),  # a kind the table does not know: not refused
    (
        "qwen3-0.6b-v5e",
        on("TPU v6 lite", 4),
        4,
        [
            "spec.trainer.tpu: the run is planned for v5litepod-4 (v5litepod, node label "
            "tpu-v5-lite-podslice), but this process runs on TPU v6 lite (v6e)"
        ],
    ),
    (
        "qwen3-8b-v6e",
        on("TPU v6 lite", 4),
        4,
        [
            "spec.trainer.tpu: each trainer process of v6e-8 should see 8 TPU device(s) (8 chip(s) of "
            "google.com/tpu x 1), this one sees 4"
        ],
    ),
    (
        "qwen3-30b-a3b-tpu7x",
        on("TPU7x", 4),
        64,
        ["the trainer is planned for 128 TPU devices over 1 slice(s) of tpu7x-128, its processes see 64"],
    ),
    (  # every difference at once
        "qwen3-8b-v5p",
        on("TPU v5 lite", 1),
        1,
        [
            "runs on TPU v5 lite (v5litepod)",
            "should see 4 TPU device(s) (4 chip(s) of google.com/tpu x 1), this one sees 1",
        ],
    ),
]


@pytest.mark.parametrize(("recipe", "local", "total", "want"), CASES)
def test_the_devices_are_checked_against_the_plan(
    recipe: str, local: list[Any], total: int, want: list[str]
) -> None:
    got = devices.problems(plan(recipe), local, total)
    assert len(got) == len(want), got
    for line, part in zip(got, want, strict=True):
        assert part in line and line.startswith("spec.trainer.tpu: "), (line, part)


def test_every_generation_names_its_devices_and_no_kind_names_two() -> None:
    assert all(g.device_kinds for g in GENERATIONS.values())
    assert sum(len(g.device_kinds) for g in GENERATIONS.values()) == len(BY_DEVICE_KIND)


def test_each_generations_own_devices_pass_its_plan() -> None:
    """A generation's every kind passes a plan of that generation, every other generation's kind is refused:
    the table's rows, not the cases above, decide."""
    recipes = {plan(r).tpu.accelerator: r for r in ("qwen3-0.6b-v5e", "qwen3-8b-v6e", "qwen3-8b-v5p")}
    recipes["tpu7x"] = "qwen3-30b-a3b-tpu7x"
    for accelerator, recipe in recipes.items():
        p = plan(recipe)
        n = p.tpu.chips_per_container * p.tpu.devices_per_chip
        for kind, gen in BY_DEVICE_KIND.items():
            got = devices.problems(p, on(kind, n), p.devices)
            assert (got == []) == (gen.accelerator == accelerator), (recipe, kind, got)


@pytest.mark.jax
def test_the_trainer_exits_2_naming_the_field(
    monkeypatch: pytest.MonkeyPatch, capsys: Any, tmp_path: Path
) -> None:
    """rljob-trainer refuses at start what the check finds, before it builds a model: exit 2 and a line on
    stderr (JAX's devices patched to one v6e chip's, as this machine has a CPU only; on a v5e chip the
    same refusal came from its own devices, hack/tpu/README.md)."""
    import jax
    from rljob.trainer import main

    monkeypatch.setattr(jax, "local_devices", lambda: on("TPU v6 lite", 1))
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    # The trainer settles XLA_FLAGS before JAX starts; kept as it is for this process's other tests.
    monkeypatch.setenv(libtpu.XLA_FLAGS_ENV, os.environ.get(libtpu.XLA_FLAGS_ENV) or libtpu.INERT_XLA_FLAGS)
    config = tmp_path / "run.json"
    config.write_text(resolve(recipe_manifest("qwen3-0.6b-v5e")).model_dump_json())
    assert main.main(["--config", str(config), "--model", "tiny"]) == EXIT_BAD_CONFIG
    # One line, its last (what the operator shows of a failed container): both differences.
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("rljob-trainer: spec.trainer.tpu: the run is planned for v5litepod-4"), last
    assert "; spec.trainer.tpu: each trainer process of v5litepod-4 should see 4 TPU device(s)" in last, last
