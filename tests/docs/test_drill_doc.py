"""docs/drill.md's "Figures at full size" has a row for every case `rljob drill --all` runs (each catalog
recipe, each profile, each example), and each row's trainer is the one the plan resolves today: its TPU
type and the `accumulate` call's shape, `micro-batches x [rows, tokens]` (gradient_accumulation_steps, else
the trainer's default, x [microBatchSize, tokenBudget]). A recipe change that moves a row's shape leaves
figures compiled for another program: the row must be compiled again (its command is its first column) or
say it is stale. The figures themselves are the compiler's and are not re-derived here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from rljob.cli.drill.cases import Case, all_cases, resolve_doc
from rljob.trainer.main import optimizer_options

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "drill.md"
HEADER = "| `rljob drill ... --compile` |"


def table(text: str) -> dict[str, str]:
    """The table's rows by case name (`qwen3-8b-v5p/long-context`, `example/qwen3-8b-v5p`): the trainer
    column."""
    out = {}
    lines = text.split(HEADER, 1)[1].splitlines()[2:]
    for line in lines:
        if not line.startswith("|"):
            break
        args, trainer = (c.strip() for c in line.split("|")[1:3])
        m = re.fullmatch(r"`(?:--recipe (\S+)(?: --profile (\S+))?|-f examples/(\S+)\.yaml)`", args)
        assert m, f"a row whose first column is not a drill's arguments: {args}"
        recipe, profile, example = m.groups()
        out[f"example/{example}" if example else recipe + (f"/{profile}" if profile else "")] = trainer
    return out


def expected(case_doc: dict[str, Any]) -> str:
    rc = resolve_doc(case_doc)
    micro_batches = optimizer_options(rc, 1)["micro_batches"]
    rows, budget = rc.trainer.micro_batch_size, rc.spec.packing.token_budget
    return f"{rc.trainer.tpu.type_name} ({micro_batches} x [{rows}, {budget}])"


def _shown(trainer: str) -> str:
    m = re.match(r"(\S+) \(.*?; (\d+) x \[(\d+), (\d+)\]", trainer)
    assert m, f"no type and shape in {trainer!r}"
    return f"{m.group(1)} ({m.group(2)} x [{m.group(3)}, {m.group(4)}])"


CASES = all_cases()


def test_every_drill_case_has_a_row() -> None:
    assert sorted(table(DOC.read_text())) == sorted(c.name for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_row_is_the_trainer_the_plan_resolves(case: Case) -> None:
    assert _shown(table(DOC.read_text())[case.name]) == expected(case.doc)


def test_a_moved_shape_is_caught() -> None:
    rows = table(DOC.read_text())
    assert _shown(rows["qwen3-8b-v5p"]) == "v5p-8 (1 x [4, 5120])"
    assert _shown(rows["qwen3-8b-v5p"].replace("1 x [4, 5120]", "4 x [4, 8192]")) != "v5p-8 (1 x [4, 5120])"
