"""Tasks by name: the registry over the entry-point group ``rljob.tasks``, and what a task is written with.

A task turns the records of a dataset into prompts (text, chat messages or token ids), each with a reference
to grade against, and grades a completion with a reward (the Task protocol of rljob.trainer.data). A
package installed in the trainer image registers one under a name in its pyproject.toml::

    [project.entry-points."rljob.tasks"]
    my-task = "my_package.task:load"

``spec.dataset.task: my-task`` then selects it: the trainer calls ``load(ctx)`` once at start with a
:class:`TaskContext` (spec.dataset's path and options, the held-out count, the seed) and trains on the Task
it returns. The common case, one example per JSON Lines record graded by ``reward(completion, reference)``,
is :meth:`RecordTask.from_jsonl`. The built-in tasks, math and successor, are registered the same way (this
project's pyproject.toml). docs/tasks.md has a full example.

Refusals are bad configuration (exit 2, contract 3), one line each naming the field: a name the image does
not register (the known names listed), a task that fails to import or to start, an option it does not take,
an unreadable or malformed dataset. A storage error that may pass (a 503, a timeout) is a crash instead,
restarted like any other.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from rljob.recipes.runconfig import RunConfig
from rljob.trainer.data import DatasetError, MathTask, Prompt, SuccessorTask, Task

log = logging.getLogger("rljob.trainer.tasks")

ENTRY_POINT_GROUP = "rljob.tasks"
# The task protocol's members a loaded task must have.
TASK_MEMBERS = ("name", "max_tokens", "train_prompts", "eval_prompts", "reward")
# Problems of a malformed dataset reported at once (one line each).
MAX_RECORD_PROBLEMS = 10


class TaskError(DatasetError):
    """A task the run cannot start with; each line of the message names the field."""


class StorageUnavailable(RuntimeError):
    """spec.dataset.path could not be read for a reason that may pass (a crash: restarted, counted)."""


# ------------------------------------------------------------------------------------------ context


@dataclass(frozen=True)
class TaskContext:
    """What a task's loader gets: spec.dataset and the run's settings a task needs."""

    name: str  # spec.dataset.task
    path: str | None  # spec.dataset.path: a gs:// object or an absolute path (None for successor)
    options: Mapping[str, str]  # spec.dataset.options
    eval_size: int  # spec.dataset.evalSize: examples held out for evaluation
    max_tokens: int  # spec.algorithm.maxTokens: the completion length the sampler is asked for
    prompt_template: str  # spec.dataset.promptTemplate (math's; another task may ignore it)
    seed: int  # the seed of the task's prompt sampling

    def check_options(self, known: Iterable[str]) -> None:
        """Refuse the options the task does not take (TaskError, one line each)."""
        allowed = sorted(known)
        takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
        bad = [
            f"spec.dataset.options.{k}: task {self.name} has no option {k} ({takes})"
            for k in self.options
            if k not in allowed
        ]
        if bad:
            raise TaskError("\n".join(sorted(bad)))

    def read(self) -> bytes:
        """The bytes of spec.dataset.path, from storage (gs://) or the trainer's filesystem. A missing path
        or object, or access the run will never get, is a DatasetError (exit 2); anything else (a 503, a
        timeout) is StorageUnavailable, a crash restarted like any other."""
        if not self.path:
            raise DatasetError(f"spec.dataset.path: task {self.name} reads a file; set the path")
        from rljob.common.storage import StorageDenied, open_store

        parent, _, name = self.path.rpartition("/")
        try:
            data = open_store(parent).read(name)
        except (PermissionError, IsADirectoryError, StorageDenied) as e:
            raise DatasetError(
                f"spec.dataset.path: cannot read {self.path}: {type(e).__name__}: {e}"
            ) from None
        except Exception as e:
            raise StorageUnavailable(
                f"spec.dataset.path: reading {self.path}: {type(e).__name__}: {e}"
            ) from e
        if data is None:
            raise DatasetError(f"spec.dataset.path: {self.path} does not exist (upload the data there)")
        return data

    def read_text(self) -> str:
        """spec.dataset.path as UTF-8 text."""
        try:
            return self.read().decode("utf-8")
        except UnicodeDecodeError:
            raise DatasetError(f"spec.dataset.path: {self.path} is not UTF-8 text") from None

    def jsonl(self) -> list[tuple[int, dict[str, Any]]]:
        """The JSON objects of spec.dataset.path, one a line (blank lines skipped), with their line
        numbers."""
        out: list[tuple[int, dict[str, Any]]] = []
        problems: list[str] = []
        for i, line in enumerate(self.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"spec.dataset.path: {self.path}:{i}: not JSON ({e.msg})")
                continue
            if not isinstance(row, dict):
                problems.append(f"spec.dataset.path: {self.path}:{i}: not a JSON object")
                continue
            out.append((i, row))
        _raise_some(problems)
        return out


def _raise_some(problems: list[str]) -> None:
    if problems:
        more = len(problems) - MAX_RECORD_PROBLEMS
        lines = problems[:MAX_RECORD_PROBLEMS] + ([f"spec.dataset.path: and {more} more"] if more > 0 else [])
        raise DatasetError("\n".join(lines))


# ------------------------------------------------------------------------------------- record tasks

Messages = Sequence[Mapping[str, str]]
Reward = Callable[[str, Any], float]


@dataclass(frozen=True)
class Example:
    """One example of a task: the prompt (text, chat messages [{"role": ..., "content": ...}, ...], or token
    ids) and the reference the reward grades a completion against (any value: a string, a dict, ...)."""

    prompt: str | Messages | Sequence[int]
    reference: Any
    id: str = ""


def prompt_of(example: Example, where: str) -> Prompt:
    """The loop's Prompt of an example; ``where`` names it in an error (ValueError)."""
    p = example.prompt
    if isinstance(p, str):
        return Prompt(None, p, example.reference, id=example.id)
    items: list[Any] = list(p)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return Prompt([int(t) for t in items], None, example.reference, id=example.id)
    if items and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in items
    ):
        msgs = [{"role": str(m["role"]), "content": str(m["content"])} for m in items]
        return Prompt(None, None, example.reference, id=example.id, messages=msgs)
    raise ValueError(
        f"{where}: a prompt is text, a non-empty list of token ids, or a non-empty list of chat messages "
        '({"role": ..., "content": ...}, both text)'
    )


@dataclass
class RecordTask:
    """A task from a list of examples and a reward ``(completion text, reference) -> float``.

    The first ``eval_size`` examples are held out for evaluation; training prompts are drawn from the rest
    as a function of (seed, step), so a resumed run sees exactly the prompts it would have seen."""

    name: str
    examples: list[Example]
    grade: Reward
    eval_size: int = 64
    max_tokens: int = 1024
    seed: int = 0
    _prompts: list[Prompt] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        problems = []
        for k, ex in enumerate(self.examples):
            try:
                self._prompts.append(
                    prompt_of(ex, f"spec.dataset.task: task {self.name}: example {ex.id or k}")
                )
            except ValueError as e:
                problems.append(str(e))
        _raise_some(problems)
        if len(self._prompts) <= self.eval_size:
            raise DatasetError(
                f"spec.dataset.evalSize: task {self.name} has {len(self._prompts)} examples; evalSize holds "
                f"out {self.eval_size}, so none would be left to train on"
            )

    @classmethod
    def from_jsonl(
        cls, ctx: TaskContext, to_example: Callable[[dict[str, Any]], Example], grade: Reward
    ) -> RecordTask:
        """One example per JSON Lines record of spec.dataset.path (``to_example(record)``), graded by
        ``grade``. A record ``to_example`` cannot use (it raises KeyError, ValueError or TypeError) is a
        DatasetError naming the file and line; the examples' ids are their line numbers."""
        examples: list[Example] = []
        problems: list[str] = []
        for line, record in ctx.jsonl():
            try:
                ex = to_example(record)
                prompt_of(ex, f"spec.dataset.path: {ctx.path}:{line}: task {ctx.name}")
            except (KeyError, ValueError, TypeError) as e:
                if isinstance(e, ValueError) and str(e).startswith("spec.dataset.path: "):
                    problems.append(str(e))
                    continue
                problems.append(
                    f"spec.dataset.path: {ctx.path}:{line}: task {ctx.name}: {type(e).__name__}: {e}"
                )
                continue
            examples.append(ex if ex.id else dataclasses.replace(ex, id=str(line)))
        _raise_some(problems)
        return cls(
            ctx.name, examples, grade, eval_size=ctx.eval_size, max_tokens=ctx.max_tokens, seed=ctx.seed
        )

    def train_prompts(self, step: int, count: int) -> list[Prompt]:
        rng = random.Random(f"{self.seed}:{step}")
        pool = self._prompts[self.eval_size :]
        return [pool[rng.randrange(len(pool))] for _ in range(count)]

    def eval_prompts(self) -> list[Prompt]:
        return list(self._prompts[: self.eval_size])

    def reward(self, prompt: Prompt, completion_tokens: list[int], completion_text: str) -> float:
        return float(self.grade(completion_text, prompt.answer))


# ------------------------------------------------------------------------------------ chat templates


def render_messages(tokenizer: Any, messages: Messages) -> tuple[list[int] | None, str]:
    """A chat prompt as the sampler gets it: with a tokenizer that has a chat template (Hugging Face's
    ``tokenizer.chat_template``), the template's rendering with the assistant's turn opened
    (``apply_chat_template(..., add_generation_prompt=True)``) and its token ids (the template writes the
    special tokens itself, so none are added); without one, the messages' contents one after another
    (blank-line separated) as text, which the sampler tokenizes."""
    msgs = [dict(m) for m in messages]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return [int(t) for t in ids], str(text)
    return None, "\n\n".join(m["content"] for m in msgs)


class ChatPrompts:
    """A task whose chat-message prompts reach the sampler rendered (render_messages); text and token
    prompts pass unchanged. The tokenizer is loaded once, when the first chat prompt is rendered."""

    def __init__(self, task: Task, tokenizer: Callable[[], Any] | None) -> None:
        self.task = task
        self.name, self.max_tokens = task.name, task.max_tokens
        self._load = tokenizer
        self._tokenizer: Any = None
        self._loaded = False
        self._lock = threading.Lock()

    def tokenizer(self) -> Any:
        with self._lock:
            if not self._loaded:
                self._tokenizer = self._load() if self._load is not None else None
                self._loaded = True
                if self._tokenizer is None or not getattr(self._tokenizer, "chat_template", None):
                    log.warning(
                        "task %s: chat prompts without a chat template: each is its messages' contents",
                        self.task.name,
                    )
            return self._tokenizer

    def render(self, prompts: list[Prompt]) -> list[Prompt]:
        out = []
        for p in prompts:
            if p.messages is not None and p.tokens is None and p.text is None:
                tokens, text = render_messages(self.tokenizer(), p.messages)
                p = dataclasses.replace(p, tokens=tokens, text=text)
            out.append(p)
        return out

    def train_prompts(self, step: int, count: int) -> list[Prompt]:
        return self.render(self.task.train_prompts(step, count))

    def eval_prompts(self) -> list[Prompt]:
        return self.render(self.task.eval_prompts())

    def reward(self, prompt: Prompt, completion_tokens: list[int], completion_text: str) -> float:
        return self.task.reward(prompt, completion_tokens, completion_text)


def hf_tokenizer(name: str, task: str, revision: str | None = None) -> Callable[[], Any]:
    """A loader of the Hugging Face tokenizer ``name`` at ``revision`` (spec.model.name at the run's pinned
    commit: the model and tokenizer the samplers serve, from the same hub and with the same credentials);
    failing to load it is a TaskError naming the field."""

    def load() -> Any:
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(name, revision=revision)
        except Exception as e:
            raise TaskError(
                f"spec.model.name: cannot load the tokenizer of {name} to render task {task}'s chat prompts: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from None

    return load


# ------------------------------------------------------------------------------------------ registry


def registered() -> dict[str, list[EntryPoint]]:
    """The tasks the installed packages register (entry-point group rljob.tasks), by name."""
    out: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if all(ep.value != seen.value for seen in out.get(ep.name, [])):
            out.setdefault(ep.name, []).append(ep)
    return out


def context_of(rc: RunConfig, seed: int = 0) -> TaskContext:
    d, alg = rc.spec.dataset, rc.spec.algorithm
    return TaskContext(
        name=d.task,
        path=d.path,
        options=dict(d.options),
        eval_size=d.eval_size,
        max_tokens=alg.max_tokens,
        prompt_template=d.prompt_template,
        seed=seed,
    )


def load_task(ctx: TaskContext, tasks: Mapping[str, Sequence[EntryPoint]] | None = None) -> Task:
    """The task ``ctx.name`` names, loaded from its entry point and started with ``ctx``. Raises TaskError
    (an unknown name, one registered twice, one that fails to import or to start, an object that is not a
    task), DatasetError (its data) or StorageUnavailable (storage that may come back)."""
    tasks = registered() if tasks is None else tasks
    eps = tasks.get(ctx.name, [])
    if not eps:
        known = ", ".join(sorted(tasks)) or "none"
        raise TaskError(
            f"spec.dataset.task: {ctx.name!r} is not a task of this trainer image (it has: {known}); a "
            f"package installed in the image registers one in the entry-point group {ENTRY_POINT_GROUP} "
            "(docs/tasks.md)"
        )
    if len(eps) > 1:
        raise TaskError(
            f"spec.dataset.task: {ctx.name!r} is registered more than once in {ENTRY_POINT_GROUP} "
            f"({', '.join(ep.value for ep in eps)}); uninstall one"
        )
    ep = eps[0]
    try:
        factory = ep.load()
    except Exception as e:
        raise TaskError(
            f"spec.dataset.task: task {ctx.name} ({ep.value}) cannot be imported: "
            f"{type(e).__name__}: {_line(e)}"
        ) from None
    try:
        task = factory(ctx)
    except (DatasetError, StorageUnavailable):
        raise
    except Exception as e:
        raise TaskError(
            f"spec.dataset.task: task {ctx.name} ({ep.value}) failed to start: {type(e).__name__}: {_line(e)}"
        ) from None
    missing = [m for m in TASK_MEMBERS if not hasattr(task, m)]
    if missing:
        raise TaskError(
            f"spec.dataset.task: task {ctx.name} ({ep.value}) returned a {type(task).__name__}, which lacks "
            f"{', '.join(missing)} (a task has the members of rljob.trainer.data.Task)"
        )
    return task  # type: ignore[no-any-return]


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:500] if text else ""


# ------------------------------------------------------------------------------------- the built-ins


MATH_OPTIONS = ("questionField", "answerField")


def math_task(ctx: TaskContext) -> MathTask:
    """The built-in math task: GSM8K-style problems from spec.dataset.path graded by math-verify; options
    questionField and answerField name the JSON keys of the question and the answer."""
    ctx.check_options(MATH_OPTIONS)
    text = ctx.read_text()
    return MathTask.from_jsonl(
        text,
        str(ctx.path),
        template=ctx.prompt_template,
        question_field=ctx.options.get("questionField", "question"),
        answer_field=ctx.options.get("answerField", "answer"),
        eval_size=ctx.eval_size,
        max_tokens=ctx.max_tokens,
        seed=ctx.seed,
    )


def successor_task(ctx: TaskContext) -> SuccessorTask:
    """The CPU loop's toy task (token prompts); it takes no options. Its train/eval split is fixed; the
    seed varies only the sampling."""
    ctx.check_options(())
    return SuccessorTask()


__all__ = [
    "ENTRY_POINT_GROUP",
    "ChatPrompts",
    "Example",
    "RecordTask",
    "StorageUnavailable",
    "TaskContext",
    "TaskError",
    "context_of",
    "hf_tokenizer",
    "load_task",
    "math_task",
    "prompt_of",
    "registered",
    "render_messages",
    "successor_task",
]
