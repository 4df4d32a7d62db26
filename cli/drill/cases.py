"""The drill's cases and their manifests: a catalog recipe (and profile), every recipe, profile and
example (``--all``), or a manifest file; each resolved by the same plan ``rljob render`` uses, a problem of
the manifest a DrillBadInput (exit 2, the field named), before any process starts."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rljob.recipes.api import API_VERSION, KIND
from rljob.recipes.failure import EXIT_BAD_CONFIG
from rljob.recipes.failure import EXIT_OK as EXIT_OK  # re-exported: the drill's exit codes

# The drill's exit codes: 0 and 2 (a manifest or flag it refuses) are contract 3's (rljob.recipes.failure).
EXIT_FAIL = 1
EXIT_BAD = EXIT_BAD_CONFIG
REPO = Path(__file__).resolve().parents[2]
STORAGE = "gs://rljob-drill"


class DrillBadInput(Exception):
    def __init__(self, problems: list[str], report: dict[str, Any] | None = None) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems
        self.report = report or {}


class DrillFailed(Exception):
    """Something of the rehearsal did not hold; the message says what (and the failing process's lines)."""


@dataclass
class Case:
    name: str
    doc: dict[str, Any]


@dataclass
class Outcome:
    name: str
    ok: bool
    report: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    bad_input: list[str] = field(default_factory=list)


def recipe_doc(recipe: str, profile: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"recipe": recipe, "storage": {"root": STORAGE}}
    if profile:
        spec["trainer"] = {"profile": profile}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "drill"}, "spec": spec}


def all_cases() -> list[Case]:
    """Every catalog recipe, each of its profiles, and every example."""
    import yaml
    from rljob.recipes import recipe_catalog

    out = []
    for name in recipe_catalog.names():
        out.append(Case(name, recipe_doc(name)))
        for profile in recipe_catalog.load(name).profiles:
            out.append(Case(f"{name}/{profile}", recipe_doc(name, profile)))
    for path in sorted((REPO / "examples").glob("*.yaml")):
        out.append(Case(f"example/{path.stem}", yaml.safe_load(path.read_text(encoding="utf-8"))))
    return out


def resolve_doc(doc: dict[str, Any], *, fit_check: bool = True) -> Any:
    """The run config of a manifest; ``fit_check`` False for the drill's scaled manifests (the model's name
    on a shrunken slice, run as a miniature: the HBM fit check is the full-size plan's)."""
    import yaml
    from rljob.recipes.plan import PlanError, parse_manifest, resolve

    try:
        return resolve(parse_manifest(yaml.safe_dump(doc, sort_keys=False)), fit_check=fit_check)
    except PlanError as e:
        raise DrillBadInput(e.problems) from None


def jobset_of(rc: Any) -> dict[str, Any]:
    from rljob.recipes import render

    return render.jobset(rc)


def cases_from_args(args: argparse.Namespace) -> list[Case]:
    import yaml

    if args.all:
        return all_cases()
    if args.recipe:
        from rljob.recipes import recipe_catalog

        if args.recipe not in recipe_catalog.names():
            raise DrillBadInput(
                [f"--recipe: unknown recipe {args.recipe!r}; known: {', '.join(recipe_catalog.names())}"]
            )
        if args.profile and args.profile not in recipe_catalog.load(args.recipe).profiles:
            raise DrillBadInput([f"--profile: {args.recipe} has no profile {args.profile!r}"])
        name = args.recipe + (f"/{args.profile}" if args.profile else "")
        return [Case(name, recipe_doc(args.recipe, args.profile))]
    try:
        text = Path(args.file).read_text(encoding="utf-8") if args.file != "-" else sys.stdin.read()
    except OSError as e:
        raise DrillBadInput([f"{args.file}: {e.strerror or e}"]) from None
    from rljob.recipes.plan import PlanError, parse_manifest

    try:
        parse_manifest(text)  # every problem of the manifest, field named, before any process starts
    except PlanError as e:
        raise DrillBadInput(e.problems) from None
    return [Case(Path(args.file).stem, yaml.safe_load(text))]
