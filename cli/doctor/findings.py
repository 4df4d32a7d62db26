"""A finding is one line of doctor's report; the report's text and exit code."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from rljob.cli.doctor import EXIT_OK, EXIT_PROBLEMS


class Status(StrEnum):
    OK = "ok"
    WARNING = "warning"
    PROBLEM = "problem"


@dataclass(frozen=True)
class Finding:
    """One line of the report: what was checked, what was found, how to fix it."""

    check: str
    status: Status
    message: str
    fix: str = ""


def ok(check: str, message: str) -> Finding:
    return Finding(check, Status.OK, message)


def warning(check: str, message: str, fix: str = "") -> Finding:
    return Finding(check, Status.WARNING, message, fix)


def problem(check: str, message: str, fix: str = "") -> Finding:
    return Finding(check, Status.PROBLEM, message, fix)


_MARK = {Status.OK: "ok", Status.WARNING: "WARN", Status.PROBLEM: "PROBLEM"}


def render_text(findings: Sequence[Finding]) -> str:
    lines = []
    for f in findings:
        lines.append(f"{_MARK[f.status]:<8} {f.check:<20} {f.message}")
        for i, fix in enumerate(f.fix.splitlines()):
            lines.append(f"{'':<8} {'':<20} {'fix: ' if i == 0 else '     '}{fix}")
    problems = sum(f.status is Status.PROBLEM for f in findings)
    warnings = sum(f.status is Status.WARNING for f in findings)
    lines.append(
        f"{problems} problem{'s' if problems != 1 else ''}, {warnings} warning{'s' if warnings != 1 else ''}"
    )
    return "\n".join(lines)


def exit_code(findings: Sequence[Finding]) -> int:
    return EXIT_PROBLEMS if any(f.status is Status.PROBLEM for f in findings) else EXIT_OK
