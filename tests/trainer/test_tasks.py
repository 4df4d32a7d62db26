"""Tasks by name (rljob.trainer.tasks, docs/tasks.md): the registry over the entry-point group rljob.tasks,
its refusals (one line naming the field, exit 2, no traceback), a task defined outside rljob (a package on
the path with its own entry_points.txt) trained by the CPU loop, the manifest's task fields, and chat
prompts rendered with a tokenizer's chat template."""

from __future__ import annotations

import json
import os
import subprocess
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
from fixtures.recipes import manifest, problems, resolve
from rljob.common.credentials import token_env
from rljob.trainer.data import DatasetError, MathTask, Prompt, SuccessorTask
from rljob.trainer.tasks import (
    ChatPrompts,
    Example,
    RecordTask,
    TaskContext,
    TaskError,
    hf_tokenizer,
    load_task,
    registered,
    render_messages,
)

TESTED_MODULES = ("rljob.local.localrun",)

# A task package outside rljob: one example per JSON Lines record, the prompt a chat message; a completion
# earns 1 when its first character's code has the parity of the reference's (a reward a random policy gets
# about half the time, so a group's rewards differ and GRPO has a signal); every load and grade is logged to
# the file named by option `log`.
ECHO_TASK = """
import json
from rljob.trainer.tasks import Example, RecordTask


def load(ctx):
    ctx.check_options(["promptField", "log"])
    field, log = ctx.options.get("promptField", "prompt"), ctx.options["log"]

    def note(**rec):
        with open(log, "a") as f:
            f.write(json.dumps(rec) + "\\n")

    note(event="load", path=ctx.path, eval_size=ctx.eval_size, max_tokens=ctx.max_tokens,
         options=dict(ctx.options))

    def grade(completion, reference):
        reward = 1.0 if completion and ord(completion[0]) % 2 == ord(reference[0]) % 2 else 0.0
        note(event="grade", completion=completion, reference=reference, reward=reward)
        return reward

    def example(rec):
        return Example([{"role": "user", "content": rec[field]}], rec["answer"])

    return RecordTask.from_jsonl(ctx, example, grade)


def broken(ctx):
    raise RuntimeError("the grader's sandbox is not installed")


def not_a_task(ctx):
    return {"prompts": []}
"""

ENTRY_POINTS = """\
[rljob.tasks]
echo = echo_task:load
broken = echo_task:broken
not-a-task = echo_task:not_a_task
unimportable = echo_task_missing:load
"""


def task_package(root: Path) -> Path:
    """A directory to put on sys.path: module echo_task and the dist-info that registers its tasks."""
    site = root / "site"
    (site / "echo_task-0.1.dist-info").mkdir(parents=True)
    (site / "echo_task.py").write_text(ECHO_TASK)
    (site / "echo_task-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: echo-task\nVersion: 0.1\n"
    )
    (site / "echo_task-0.1.dist-info" / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


def ctx_of(name: str, tmp_path: Path, **kw: Any) -> TaskContext:
    base: dict[str, Any] = {
        "path": None,
        "options": {},
        "eval_size": 1,
        "max_tokens": 4,
        "prompt_template": "{question}",
        "seed": 0,
    }
    return TaskContext(name=name, **{**base, **kw})


# ---------------------------------------------------------------------------------------- the registry


def test_builtins_are_registered_through_the_entry_point_group() -> None:
    tasks = registered()
    assert [ep.value for ep in tasks["math"]] == ["rljob.trainer.tasks:math_task"]
    assert [ep.value for ep in tasks["successor"]] == ["rljob.trainer.tasks:successor_task"]


def test_a_package_on_the_path_registers_its_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(task_package(tmp_path)))
    tasks = registered()
    assert {"math", "successor", "echo", "broken", "not-a-task", "unimportable"} <= set(tasks)
    assert [ep.value for ep in tasks["echo"]] == ["echo_task:load"]


REFUSALS = [
    (
        "unknown name",
        "nope",
        r"^spec\.dataset\.task: 'nope' is not a task of this trainer image \(it has: broken, echo, math, "
        r"not-a-task, successor, unimportable\); a package installed in the image registers one in the "
        r"entry-point group rljob\.tasks \(docs/tasks\.md\)$",
    ),
    (
        "fails to import",
        "unimportable",
        r"^spec\.dataset\.task: task unimportable \(echo_task_missing:load\) cannot be imported: "
        r"ModuleNotFoundError: No module named 'echo_task_missing'$",
    ),
    (
        "raises on start",
        "broken",
        r"^spec\.dataset\.task: task broken \(echo_task:broken\) failed to start: RuntimeError: the grader's "
        r"sandbox is not installed$",
    ),
    (
        "not a task",
        "not-a-task",
        r"^spec\.dataset\.task: task not-a-task \(echo_task:not_a_task\) returned a dict, which lacks name, "
        r"max_tokens, train_prompts, eval_prompts, reward",
    ),
    (
        "an option the task does not take",
        "successor",
        r"^spec\.dataset\.options\.x: task successor has no option x \(it takes none\)$",
    ),
]


@pytest.mark.parametrize(("case", "name", "message"), REFUSALS, ids=[c[0] for c in REFUSALS])
def test_registry_refusals(
    case: str, name: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(task_package(tmp_path)))
    options = {"x": "1"} if case.startswith("an option") else {}
    with pytest.raises(TaskError, match=message):
        load_task(ctx_of(name, tmp_path, options=options))


def test_a_name_registered_twice_is_refused(tmp_path: Path) -> None:
    eps = [EntryPoint("dup", "a:load", "rljob.tasks"), EntryPoint("dup", "b:load", "rljob.tasks")]
    with pytest.raises(
        TaskError, match=r"^spec\.dataset\.task: 'dup' is registered more than once .*a:load, b:load"
    ):
        load_task(ctx_of("dup", tmp_path), {"dup": eps})


def test_math_options_and_unknown_ones(tmp_path: Path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+1?", "a": f"#### {i + 1}"}) + "\n" for i in range(4)))
    ctx = ctx_of("math", tmp_path, path=str(data), options={"questionField": "q", "answerField": "a"})
    task = load_task(ctx)
    assert isinstance(task, MathTask) and task.rows[2] == ("2+1?", "3") and task.eval_size == 1
    bad = ctx_of("math", tmp_path, path=str(data), options={"questionFeild": "q", "b": "1"})
    with pytest.raises(TaskError) as err:
        load_task(bad)
    assert str(err.value).splitlines() == [
        "spec.dataset.options.b: task math has no option b (it takes answerField, questionField)",
        "spec.dataset.options.questionFeild: task math has no option questionFeild (it takes answerField, "
        "questionField)",
    ]
    assert isinstance(load_task(ctx_of("successor", tmp_path)), SuccessorTask)


def test_record_task_reports_every_bad_record(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "answer": "b"}\n[1]\n{"answer": "c"}\nnot json\n')
    ctx = ctx_of("t", tmp_path, path=str(data))
    with pytest.raises(DatasetError) as err:
        RecordTask.from_jsonl(ctx, lambda r: Example(r["prompt"], r["answer"]), lambda c, r: 0.0)
    assert str(err.value).splitlines() == [
        f"spec.dataset.path: {data}:2: not a JSON object",
        f"spec.dataset.path: {data}:4: not JSON (Expecting value)",
    ]
    data.write_text('{"prompt": "a", "answer": "b"}\n{"answer": "c"}\n{"prompt": [], "answer": "d"}\n')
    with pytest.raises(DatasetError) as err:
        RecordTask.from_jsonl(ctx, lambda r: Example(r["prompt"], r["answer"]), lambda c, r: 0.0)
    assert str(err.value).splitlines() == [
        f"spec.dataset.path: {data}:2: task t: KeyError: 'prompt'",
        f"spec.dataset.path: {data}:3: task t: a prompt is text, a non-empty list of token ids, or a "
        'non-empty list of chat messages ({"role": ..., "content": ...}, both text)',
    ]


def test_record_task_split_is_deterministic_and_grades_references(tmp_path: Path) -> None:
    examples = [Example(f"p{i}", {"want": str(i)}) for i in range(6)]
    task = RecordTask("t", examples, lambda c, ref: float(c == ref["want"]), eval_size=2, seed=3)
    assert [p.text for p in task.eval_prompts()] == ["p0", "p1"]
    train = task.train_prompts(5, 8)
    assert [p.text for p in train] == [p.text for p in task.train_prompts(5, 8)]
    assert {p.text for p in train} <= {"p2", "p3", "p4", "p5"}
    assert task.reward(train[0], [], train[0].answer["want"]) == 1.0
    assert task.reward(train[0], [], "x") == 0.0
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.task: task t: example 1: a prompt is text"):
        RecordTask("t", [*examples, Example([True], "x", id="1")], lambda c, r: 0.0, eval_size=2)
    with pytest.raises(DatasetError, match=r"^spec\.dataset\.evalSize: task t has 6 examples"):
        RecordTask("t", examples, lambda c, r: 0.0, eval_size=6)


# ------------------------------------------------------------------------------------ the manifest


def test_the_manifest_names_any_task_and_bounds_it() -> None:
    rc = resolve(manifest({"dataset": {"task": "code-exec.v2", "options": {"language": "python"}}}))
    assert rc.spec.dataset and rc.spec.dataset.task == "code-exec.v2"
    assert rc.spec.dataset.options == {"language": "python"}
    assert rc.spec.dataset.path == "gs://bucket/runs/data/train.jsonl"  # the default, as for math
    found = problems(
        manifest(
            {"dataset": {"task": "Bad Name!", "options": {"9x": "a", **{f"k{i}": "v" for i in range(32)}}}}
        )
    )
    assert any(p.startswith("spec.dataset.task: ") and "pattern" in p for p in found), found
    assert any(p.startswith("spec.dataset.options: ") for p in found), found
    assert problems(manifest({"dataset": {"task": "a" * 64}}))[0].startswith("spec.dataset.task: ")
    found = problems(manifest({"dataset": {"options": {"9x": "a", "ok": "b"}}}))
    assert found == [
        "spec.dataset.options: option names are a letter or _, then letters, digits, _ . - "
        "(at most 63 characters): '9x'"
    ], found


# ---------------------------------------------------------------------------------- chat templates

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def chat_tokenizer(template: str | None) -> Any:
    """A word-level Hugging Face tokenizer built here (no download), ``template`` its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<user>", "<system>", "<assistant>", "be", "brief", "say", "hi"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = template
    return fast


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi"}]


def test_chat_prompts_are_rendered_with_the_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = chat_tokenizer(TEMPLATE)
    tokens, text = render_messages(tok, MESSAGES)
    assert text == "<system> be brief <user> say hi <assistant>"
    assert tokens == [2, 4, 5, 1, 6, 7, 3]
    # Through a task: chat prompts become token ids (what the sampler gets), text prompts are unchanged.
    task = RecordTask(
        "t",
        [Example(MESSAGES, "hi"), Example("plain text", "x"), Example([9, 8], "y"), Example("train", "z")],
        _zero,
        eval_size=3,
    )
    loads: list[int] = []
    wrapped = ChatPrompts(task, lambda: loads.append(1) or tok)
    chat, plain, ids = wrapped.eval_prompts()
    assert (chat.tokens, chat.text, chat.answer) == ([2, 4, 5, 1, 6, 7, 3], text, "hi")
    assert plain == Prompt(None, "plain text", "x", id="")
    assert (ids.tokens, ids.text) == ([9, 8], None)
    wrapped.eval_prompts()
    assert loads == [1]  # loaded once
    # The loader the trainer uses for spec.model.name, here from a local directory (no network).
    tok.save_pretrained(tmp_path / "tok")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert render_messages(hf_tokenizer(str(tmp_path / "tok"), "t")(), MESSAGES) == (tokens, text)
    with pytest.raises(
        TaskError,
        match=r"^spec\.model\.name: cannot load the tokenizer of /nonexistent/tok to render task t's chat",
    ):
        hf_tokenizer("/nonexistent/tok", "t")()


def test_without_a_template_chat_prompts_are_their_contents() -> None:
    assert render_messages(chat_tokenizer(None), MESSAGES) == (None, "be brief\n\nsay hi")
    assert render_messages(None, MESSAGES) == (None, "be brief\n\nsay hi")


def _zero(completion: str, reference: Any) -> float:
    return 0.0


# ------------------------------------------------------------------------- the trainer, end to end


RUN_TOKEN = token_env()  # the run's token, which the sampler requires and the trainer sends


def _env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": str(site), **RUN_TOKEN}


def _config(root: str, tmp_path: Path, port: int, dataset: dict[str, Any]) -> Path:
    from rljob.local.localrun import local_run_config

    rc = local_run_config(
        root,
        port,
        tmp_path / "progress.json",
        {"steps": 2, "groupSize": 4, "groupsPerBatch": 2, "maxPromptTokens": 24, "maxTokens": 4},
        dataset=dataset,
    )
    cfg = tmp_path / "run.json"
    cfg.write_text(rc.model_dump_json())
    return cfg


def _trainer(cfg: Path, site: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    from rljob.local.localrun import trainer_command

    return subprocess.run(
        trainer_command(cfg, cfg.parent / "metrics.jsonl", *extra),
        env=_env(site),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.jax
@pytest.mark.parametrize(
    ("task", "first_line"),
    [
        (
            "nope",
            "spec.dataset.task: 'nope' is not a task of this trainer image (it has: broken, echo, math, ",
        ),
        ("broken", "spec.dataset.task: task broken (echo_task:broken) failed to start: RuntimeError: "),
    ],
)
def test_trainer_refuses_a_task_at_start(
    task: str, first_line: str, gcs_emulator: Any, tmp_path: Path
) -> None:
    site = task_package(tmp_path)
    cfg = _config(
        f"gs://{gcs_emulator.new_bucket()}", tmp_path, 1, {"task": task, "path": str(tmp_path / "none.jsonl")}
    )
    proc = _trainer(cfg, site)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(first_line), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.jax
def test_a_task_from_outside_rljob_trains_in_the_cpu_loop(gcs_emulator: Any, tmp_path: Path) -> None:
    from rljob.common.storage import open_store
    from rljob.local.localrun import free_port, sampler_command

    site = task_package(tmp_path)
    data = tmp_path / "echo.jsonl"
    words = ["ab", "cd", "ef", "gh", "ij", "kl"]
    data.write_text("".join(json.dumps({"text": f"say {w}", "answer": w}) + "\n" for w in words))
    log = tmp_path / "task.log"
    bucket = gcs_emulator.new_bucket()
    port = free_port()
    dataset = {
        "task": "echo",
        "path": str(data),
        "evalSize": 2,
        "options": {"promptField": "text", "log": str(log)},
    }
    cfg = _config(f"gs://{bucket}", tmp_path, port, dataset)
    sampler = subprocess.Popen(
        sampler_command(cfg),
        env=_env(site),
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "sampler.log").open("ab"),
    )
    try:
        proc = _trainer(cfg, site, "--eval-every", "2")
    finally:
        sampler.terminate()
        sampler.wait(30)
    assert proc.returncode == 0, proc.stderr[-3000:] + (tmp_path / "sampler.log").read_text()[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == [1, 2]
    notes = [json.loads(x) for x in log.read_text().splitlines()]
    assert notes[0] == {
        "event": "load",
        "path": str(data),
        "eval_size": 2,
        "max_tokens": 4,
        "options": {"promptField": "text", "log": str(log)},
    }
    grades = [n for n in notes if n["event"] == "grade"]
    # step 1: 2 groups x 4 completions, then the 2 held-out examples (evaluated at the first step); step 2
    assert [g["reference"] for g in grades[8:10]] == words[:2]
    train = grades[:8] + grades[10:]
    assert len(train) == 2 * 2 * 4
    assert {g["reference"] for g in train} <= set(words[2:])  # never a held-out one
    for r, k in zip(steps, (0, 8), strict=True):  # each step's reward_mean is the mean of its grades
        assert r["reward_mean"] == pytest.approx(sum(g["reward"] for g in train[k : k + 8]) / 8)
    assert steps[0]["eval_reward"] == pytest.approx(sum(g["reward"] for g in grades[8:10]) / 2)
    assert 0.0 < sum(g["reward"] for g in train) < len(train)
    assert sum(2 - r["groups_skipped"] for r in steps) >= 1  # a group with a signal was trained on
    adapters = open_store(f"gs://{bucket}/local/rl-cpu/adapters")
    assert adapters.exists("v2/adapter_model.safetensors")


# ------------------------------------------------------------------------- docs/tasks.md's example


def test_the_documented_example_task_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (Path(__file__).parents[2] / "docs" / "tasks.md").read_text()
    module = doc.split("## A complete example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    site = tmp_path / "site"
    site.mkdir()
    (site / "short_answer.py").write_text(module)
    toml = doc.split('[project.entry-points."rljob.tasks"]\n', 1)[1].split("```", 1)[0].strip()
    assert toml == 'short-answer = "short_answer:load"'
    (site / "short_answer-0.1.0.dist-info").mkdir()
    (site / "short_answer-0.1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: rljob-short-answer\nVersion: 0.1.0\n"
    )
    (site / "short_answer-0.1.0.dist-info" / "entry_points.txt").write_text(
        "[rljob.tasks]\n" + toml.replace('"', "") + "\n"  # entry_points.txt: INI, no quotes
    )
    monkeypatch.syspath_prepend(str(site))
    data = tmp_path / "qa.jsonl"
    rows = [("capital of France?", ["Paris"]), ("2 + 2?", ["4", "four"]), ("red + blue?", ["purple"])]
    data.write_text("".join(json.dumps({"q": q, "answers": a}) + "\n" for q, a in rows))
    task = load_task(ctx_of("short-answer", tmp_path, path=str(data), options={"questionField": "q"}))
    held_out = task.eval_prompts()
    assert [p.messages for p in held_out] == [
        [
            {"role": "system", "content": "Answer with the answer only, on one line."},
            {"role": "user", "content": "capital of France?"},
        ]
    ]
    assert task.reward(held_out[0], [], " paris.\nbecause ...") == 1.0
    assert task.reward(held_out[0], [], "Lyon") == 0.0
    assert {p.answer[0] for p in task.train_prompts(0, 6)} <= {"4", "purple"}
    data.write_text(json.dumps({"q": "x", "answers": []}) + "\n" + json.dumps({"question": "y"}) + "\n")
    with pytest.raises(DatasetError) as err:
        load_task(ctx_of("short-answer", tmp_path, path=str(data), options={"questionField": "q"}))
    assert str(err.value).splitlines() == [
        f"spec.dataset.path: {data}:1: task short-answer: ValueError: answers must be a non-empty list of "
        "accepted answers",
        f"spec.dataset.path: {data}:2: task short-answer: KeyError: 'answers'",
    ]
    with pytest.raises(TaskError, match=r"^spec\.dataset\.options\.questionFeild: task short-answer has no"):
        load_task(ctx_of("short-answer", tmp_path, path=str(data), options={"questionFeild": "q"}))


def test_rljob_plan_says_which_task_and_reward() -> None:
    from rljob.cli.main import _dataset

    options = {"b": "2", "a": "1"}
    rc = resolve(manifest({"dataset": {"task": "short-answer", "evalSize": 8, "options": options}}))
    assert _dataset(rc) == (
        "task short-answer of the trainer image (entry-point group rljob.tasks), data "
        "gs://bucket/runs/data/train.jsonl (8 held out for evaluation), options a=1, b=2"
    )
    rc = resolve(manifest({"dataset": {"rewardUrl": "http://grader:8080/"}}))
    assert _dataset(rc) == (
        "math problems from gs://bucket/runs/data/train.jsonl (64 held out for evaluation), rewards from "
        "http://grader:8080/"
    )
    rc = resolve(manifest({"dataset": {"task": "successor"}}))
    assert _dataset(rc) == "successor (the CPU toy task: token prompts, exact-match reward)"
