"""A refusal: PlanError, every problem of a manifest as one `path: message` line, and pydantic's errors in
that form. Below both the manifest parser (rljob.recipes.manifest) and the plan (rljob.recipes.plan),
which raise it; the plan re-exports it for its callers."""

from __future__ import annotations

import json

from pydantic import ValidationError
from rljob.recipes import syntax
from rljob.recipes.syntax import key_path

__all__ = ["MAX_PROBLEMS", "MAX_PROBLEM_CHARS", "PlanError", "pydantic_problems"]

# Location parts pydantic adds for the members of a union (not keys of the manifest).
_UNION_STR = frozenset({"str", "constrained-str"})
_UNION_PARTS = _UNION_STR | {"TpuSlice"}
# A refusal lists at most this many problems, each at most this long (a webhook answer, a terminal screen).
MAX_PROBLEMS = 50
MAX_PROBLEM_CHARS = 1000


class PlanError(ValueError):
    """The manifest cannot run; `problems` holds every reason as `spec.path: message`."""

    def __init__(self, problems: list[str]) -> None:
        lines = [p if len(p) <= MAX_PROBLEM_CHARS else p[: MAX_PROBLEM_CHARS - 3] + "..." for p in problems]
        if len(lines) > MAX_PROBLEMS:
            more = len(lines) - MAX_PROBLEMS + 1
            lines = [*lines[: MAX_PROBLEMS - 1], f"spec: and {more} more problems (fix the ones above first)"]
        super().__init__("\n".join(lines))
        self.problems = lines


def pydantic_problems(err: ValidationError, prefix: str = "") -> list[str]:
    """A pydantic ValidationError as `path: message` lines (camelCase paths, as in the manifest)."""
    out = []
    errors = err.errors(include_url=False)
    for e in errors:
        loc = list(e["loc"])
        if e["type"] == "string_type" and isinstance(e.get("input"), dict) and _UNION_STR.intersection(loc):
            continue  # the shorthand branch of a `str | object` union, given an object
        path = prefix
        for i, p in enumerate(loc):
            odd_key = e["type"] == "invalid_key" and i == len(loc) - 1
            if type(p) is int and not odd_key:
                path = f"{path or '(root)'}[{p}]"
            elif p == "[key]" or p in _UNION_PARTS or str(p).startswith("function-"):
                continue
            else:  # odd keys are quoted so that the line stays `path: message`, as is an unknown root field
                unknown_root = e["type"] == "extra_forbidden" and not path and len(loc) == 1
                path = key_path(path, str(p), quote=odd_key or unknown_root)
        path = path or "(root)"
        msg = " ".join(e["msg"].removeprefix("Value error, ").split())
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "string_pattern_mismatch":
            shown = json.dumps(e["input"])
            shown = shown if len(shown) <= 80 else shown[:77] + '..."'
            msg = f"{shown} {syntax.DESCRIPTIONS.get(str((e.get('ctx') or {}).get('pattern')), msg)}"
        out.append(f"{path}: {msg}")
    return list(dict.fromkeys(out))
