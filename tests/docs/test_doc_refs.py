"""What README.md, docs/*.md and the hack READMEs name exists in the repo, and their code fences close:

- every code fence closes with ``` alone on its line;

- every repo path (`recipes/fit.py`, `tests/docs/`, a relative Markdown link);
- every `make TARGET` in backticks, as a target of the Makefile;
- every `rljob SUBCOMMAND` and the `--flags` written after it, in that subcommand's `--help`; the flags
  after `rljob-trainer` and `rljob-sampler` in theirs, and after a script of the repo in its source;
- every `RLJOB_*` environment variable, in the code, the chart or the Makefile;
- every `rljob.<package>.<module>[.<name>]`, as a module (and a name defined or imported in it).

Each check is a function from a doc's text to its problems; the broken lines at the end prove each
catches what it is for.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "hack" / "README.md")
DOCS += (REPO / "hack" / "tpu" / "README.md",)
BIN = Path(sys.executable).parent
CODE = ("recipes", "common", "cli", "operator", "trainer", "sampler", "local", "tests", "hack", "bench")
TOPS = (*CODE, "docs", "examples", "charts", "crds")
# Paths the docs name that are not files of this repo, each with why.
NOT_OURS = {
    "hack/bin": "built by `make cluster-build` (hack/build.sh), not committed",
    "docs/migration/xpk_to_clustertoolkit.md": "Cluster Toolkit's file (docs/gke.md links its pull request)",
    "recipes/rl_loop.py": "the Tinker Cookbook's recipe (docs/tinker.md)",
    "trainer/sampler": "prose: the trainer or sampler pod (hack/README.md)",
}
# Not a template (`recipes/data/maxtext-<version>-keys.json`, `adapters/v{N}`, `tests/*`).
_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOPS)})/[\w./-]*[\w/])(?![\w<>{{}}*-]|\.\w)")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def path_problems(text: str, doc: Path) -> list[str]:
    out = []
    for m in _PATH.finditer(text):
        p = m.group(1)
        if not (REPO / p).exists() and not any(p == k or p.startswith(k + "/") for k in NOT_OURS):
            out.append(f"no file {p}")
    for m in _LINK.finditer(re.sub(r"`[^`\n]*`", "", text)):  # not inside a code span
        target = m.group(1)
        if not target.startswith(("http://", "https://")) and not (doc.parent / target).exists():
            out.append(f"link to no file {target}")
    return out


@cache
def make_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text()
    return frozenset(re.findall(r"^([a-z][\w-]*)\s*:(?!=)", text, re.M))


def make_problems(text: str, doc: Path) -> list[str]:
    return [
        f"no make target {t}" for t in re.findall(r"`make ([a-z][\w-]*)", text) if t not in make_targets()
    ]


@cache
def help_text(*argv: str) -> str:
    r = subprocess.run([str(BIN / argv[0]), *argv[1:], "--help"], capture_output=True, text=True, check=False)
    return r.stdout if r.returncode == 0 else ""


@cache
def subcommands() -> frozenset[str]:
    m = re.search(r"\{([a-z,]+)\}", help_text("rljob"))
    assert m, "rljob --help lists no subcommands"
    return frozenset(m.group(1).split(","))


_FLAGS = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# A command and what follows it up to the end of the code span, table cell or comment.
_RLJOB = re.compile(r"(?<![\w./-])rljob ([a-z]+)((?: [^`|;#\n]*)?)")
_ENTRY = re.compile(r"(?<![\w./-])(rljob-trainer|rljob-sampler)((?: [^`|;#\n]*)?)")
_SCRIPT = re.compile(r"(?<![\w./-])((?:hack|bench|trainer)/[\w/]+\.py)((?: [^`|;#\n]*)?)")
_MODULE_RUN = re.compile(r"python -m (rljob(?:\.\w+)+)((?: [^`|;#\n]*)?)")


def command_problems(text: str, doc: Path) -> list[str]:
    out = []
    for m in _RLJOB.finditer(text):
        sub, rest = m.groups()
        if sub not in subcommands():
            continue  # prose: "rljob keeps", "rljob does"
        argv = ("rljob", sub, *(["list"] if sub == "recipes" and " list" in rest else []))
        out += [f"rljob {sub} has no {f}" for f in _FLAGS.findall(rest) if f not in help_text(*argv)]
    for m in _ENTRY.finditer(text):
        out += [
            f"{m.group(1)} has no {f}" for f in _FLAGS.findall(m.group(2)) if f not in help_text(m.group(1))
        ]
    for script, rest in [*_SCRIPT.findall(text), *_MODULE_RUN.findall(text)]:
        path = REPO / script if script.endswith(".py") else _module_file(script)
        if path is None or not path.exists():
            continue  # path_problems names it
        source = path.read_text()
        out += [f"{script} has no {f}" for f in _FLAGS.findall(rest) if f'"{f}"' not in source]
    return out


@cache
def code_text() -> str:
    # The repo's own files, not what builds leave in it (hack/bin holds the control plane's binaries).
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--", *CODE, "charts"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    files = [REPO / n for n in tracked.split("\0") if n]
    here = Path(__file__).resolve()  # not this file's broken lines
    files = [p for p in files if p.is_file() and p.resolve() != here]
    files += [REPO / "Makefile", REPO / "Dockerfile"]
    return "\n".join(
        p.read_text(errors="replace") for p in files if p.suffix in {".py", ".sh", ".yaml", ".j2", ".tpl", ""}
    )


def env_problems(text: str, doc: Path) -> list[str]:
    names = sorted(set(re.findall(r"\bRLJOB_[A-Z0-9_]*[A-Z0-9]\b", text)))
    return [
        f"no environment variable {n} in the code" for n in names if not re.search(rf"\b{n}\b", code_text())
    ]


def _module_file(dotted: str) -> Path | None:
    parts = dotted.split(".")[1:]
    path = REPO
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
            continue
        if (path / f"{part}.py").exists():
            return path / f"{part}.py"
        return path / "__init__.py" if i else None
    return path / "__init__.py"


def module_problems(text: str, doc: Path) -> list[str]:
    out = []
    for dotted in sorted(set(re.findall(r"(?<![\w./-])rljob(?:\.[A-Za-z_]\w*)+", text))):
        if dotted == "rljob.tasks" or dotted.startswith("rljob.dev"):
            continue  # the tasks' entry-point group (pyproject.toml), the API group
        file = _module_file(dotted)
        if file is None or not file.exists():
            out.append(f"no module {dotted}")
            continue
        module = ".".join(file.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        rest = dotted.removeprefix("rljob.").removeprefix(module).lstrip(".").split(".")
        name = rest[0]
        defined = rf"^(?:def|class|async def) {name}\b|^{name}\s*[:=]|^from \S+ import .*\b{name}\b"
        if name and file.name == "__init__.py" and not re.search(defined, file.read_text(), re.M):
            out.append(f"no module {dotted}")
        elif name and not re.search(defined, file.read_text(), re.M):
            out.append(f"{dotted}: no {name} in {file.relative_to(REPO)}")
    return out


def fence_problems(text: str, doc: Path) -> list[str]:
    """A code fence opens with ``` and a language or nothing and closes with ``` alone on its line: text
    after a closing fence (docs/gke.md once had "``` Untested") opens a block that swallows the prose."""
    out, open_at = [], 0
    for i, line in enumerate(text.splitlines(), 1):
        if not line.lstrip().startswith("```"):
            continue
        rest = line.lstrip()[3:]
        if open_at:
            out += [f"line {i}: text after a closing fence: {line.strip()}"] if rest.strip() else []
            open_at = 0
        else:
            out += (
                [f"line {i}: not a fence's language: {line.strip()}"]
                if not re.fullmatch(r"\w*", rest)
                else []
            )
            open_at = i
    return out + ([f"line {open_at}: a fence that never closes"] if open_at else [])


CHECKS: dict[str, Callable[[str, Path], list[str]]] = {
    "fences": fence_problems,
    "paths": path_problems,
    "make": make_problems,
    "commands": command_problems,
    "env": env_problems,
    "modules": module_problems,
}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_what_the_docs_name_exists(doc: Path, check: str) -> None:
    assert CHECKS[check](doc.read_text(), doc) == []


def test_the_checks_see_what_they_check() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(_PATH.findall(readme)) > 20 and len(re.findall(r"`make ([a-z][\w-]*)", readme)) > 10
    assert {"render", "drill", "doctor"} <= subcommands()


@pytest.mark.parametrize(
    ("check", "line", "problem"),
    [
        (
            "fences",
            "```sh\nkubectl label ns rl x=y\n``` Untested\non a TPU\n",
            "line 3: text after a closing fence: ``` Untested",
        ),
        ("fences", "```sh\nmake demo\n", "line 1: a fence that never closes"),
        ("paths", "the fit check, recipes/fitting.py", "no file recipes/fitting.py"),
        ("paths", "[the fit check](fitting.md)", "link to no file fitting.md"),
        ("make", "`make demo-up` brings it up", "no make target demo-up"),
        ("commands", "`rljob drill -f FILE --compiled`", "rljob drill has no --compiled"),
        ("commands", "`rljob-trainer --model tiny --stepz 3`", "rljob-trainer has no --stepz"),
        ("commands", "`.venv/bin/python hack/sweep.py --n 400 --count 3`", "hack/sweep.py has no --count"),
        ("commands", "`python -m rljob.trainer.meshcheck --mesh`", "rljob.trainer.meshcheck has no --mesh"),
        ("env", "restored to (`$RLJOB_CACHE_DIRS`)", "no environment variable RLJOB_CACHE_DIRS in the code"),
        ("modules", "`rljob.recipes.fitting`", "no module rljob.recipes.fitting"),
        (
            "modules",
            "`rljob.recipes.plan.resolved`",
            "rljob.recipes.plan.resolved: no resolved in recipes/plan.py",
        ),
    ],
)
def test_a_broken_line_is_caught(check: str, line: str, problem: str) -> None:
    assert CHECKS[check](line, REPO / "README.md") == [problem]


@pytest.mark.parametrize(
    ("check", "line"),
    [
        ("paths", "built into hack/bin/helm"),
        ("commands", "rljob keeps the rest; rljob does not set it"),
        ("commands", "`rljob recipes list`"),
        ("modules", "`rljob.recipes.plan.resolve` and `rljob.trainer.model.Policy`"),
        ("modules", "the entry-point group `rljob.tasks`"),
    ],
)
def test_what_is_not_a_problem(check: str, line: str) -> None:
    assert CHECKS[check](line, REPO / "README.md") == []
