"""spec.dataset on the trainer side: the math task's JSON Lines parser (table-driven and property tests),
its deterministic, held-out prompt split, the math-verify reward, and `task_of` reading the file from the
GCS emulator or a local path, refusing a missing or malformed one with the field named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fixtures.trainer_run import local_run_config
from hypothesis import given, settings
from hypothesis import strategies as st
from rljob.common.storage import open_store
from rljob.recipes.runconfig import RunConfig
from rljob.trainer.data import DatasetError, MathTask, SuccessorTask
from rljob.trainer.loop import task_of
from rljob.trainer.rewards import math_reward

TESTED_MODULES = ("rljob.trainer.data", "rljob.trainer.rewards")

SRC = "gs://b/train.jsonl"


def _jsonl(rows: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(r) for r in rows) + "\n"


def _problems(n: int) -> list[dict[str, Any]]:
    return [{"question": f"What is {i} + 1?", "answer": f"{i} plus one\n#### {i + 1}"} for i in range(n)]


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("so the answer is\n#### 42", "42", 1.0),
        ("#### 41", "42", 0.0),
        ("The answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0),
        ("first 3, then 7", "7", 1.0),  # no marker: math-verify takes the last number
        ("#### 1,000", "1000", 1.0),
        ("no number here", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_math_reward(completion: str, answer: str, reward: float) -> None:
    assert math_reward(completion, answer) == reward


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"question": "q"}\n',
            f'spec.dataset.path: {SRC}:1: each line needs "question" (text) and "answer"',
        ),
        ('\n\n{"question": 3, "answer": 1}\n', f'spec.dataset.path: {SRC}:3: each line needs "question"'),
        ("not json\n", f"spec.dataset.path: {SRC}:1: not JSON (Expecting value)"),
        ('["question", "answer"]\n', f'spec.dataset.path: {SRC}:1: each line needs "question"'),
        ('{"question": "q", "answer": "work ####  "}\n', f"spec.dataset.path: {SRC}:1: empty answer"),
        (
            _jsonl(_problems(3)),
            f"spec.dataset.path: {SRC}: 3 problems; spec.dataset.evalSize holds out 3, so none would be left",
        ),
    ],
)
def test_malformed_files_are_refused_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(DatasetError) as err:
        MathTask.from_jsonl(text, SRC, eval_size=3)
    assert str(err.value).startswith(message)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.text(min_size=1, max_size=40), st.integers(-(10**6), 10**6)), min_size=3, max_size=30
    ),
    eval_size=st.integers(1, 2),
    step=st.integers(0, 10**6),
)
def test_parser_keeps_every_problem_in_order_and_splits_eval_from_train(
    rows: list[tuple[str, int]], eval_size: int, step: int
) -> None:
    text = _jsonl([{"question": q, "answer": f"work\n#### {a}"} for q, a in rows])
    task = MathTask.from_jsonl(text, SRC, template="Q: {question}\nA:", eval_size=eval_size, seed=5)
    assert task.rows == [(f"Q: {q}\nA:", str(a)) for q, a in rows]
    ev = task.eval_prompts()
    assert [p.id for p in ev] == [str(k) for k in range(eval_size)]
    train = task.train_prompts(step, 7)
    assert len(train) == 7 and all(int(p.id) >= eval_size for p in train)  # never an eval problem
    assert all(p.tokens is None and p.text == task.rows[int(p.id)][0] for p in train)
    again = MathTask.from_jsonl(text, SRC, template="Q: {question}\nA:", eval_size=eval_size, seed=5)
    assert again.train_prompts(step, 7) == train  # a resumed run sees the same prompts


def test_task_of_reads_the_dataset_from_gcs(gcs_bucket: str, tmp_path: Path) -> None:
    open_store(f"{gcs_bucket}/data").write("train.jsonl", _jsonl(_problems(10)).encode())
    rc = _with_dataset(
        local_run_config(gcs_bucket, tmp_path), path=f"{gcs_bucket}/data/train.jsonl", evalSize=4
    )
    task = task_of(rc)
    assert isinstance(task, MathTask) and len(task.rows) == 10 and task.eval_size == 4
    assert task.rows[0] == ("What is 0 + 1?\nPut the final answer after ####.\n", "1")
    assert task.reward(task.eval_prompts()[0], [], "#### 1") == 1.0


def test_task_of_local_file_and_the_toy_task(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text(_jsonl(_problems(5)), encoding="utf-8")
    rc = local_run_config(str(tmp_path), tmp_path)
    assert isinstance(task_of(rc), SuccessorTask)
    task = task_of(_with_dataset(rc, path=str(tmp_path / "p.jsonl"), evalSize=1, promptTemplate="{question}"))
    assert isinstance(task, MathTask) and task.rows[4] == ("What is 4 + 1?", "5")


def test_missing_dataset_is_bad_configuration(gcs_bucket: str, tmp_path: Path) -> None:
    rc = _with_dataset(local_run_config(gcs_bucket, tmp_path), path=f"{gcs_bucket}/data/train.jsonl")
    with pytest.raises(
        DatasetError, match=rf"^spec.dataset.path: {gcs_bucket}/data/train.jsonl does not exist"
    ):
        task_of(rc)


def _with_dataset(rc: RunConfig, **dataset: Any) -> RunConfig:
    doc = rc.model_dump(by_alias=True)
    doc["spec"]["dataset"] = {**doc["spec"]["dataset"], "task": "math", "evalSize": 64, **dataset}
    return RunConfig.model_validate(doc)


def test_math_reward_off_the_main_thread() -> None:
    """math-verify's own timeouts use signal.alarm (main thread only); graders on other threads still work."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_reward, "x" * 10_000 + "#### 7", "7").result(timeout=60) == 1.0
        assert pool.submit(math_reward, "#### 8", "7").result(timeout=60) == 0.0
