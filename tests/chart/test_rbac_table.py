"""The operator's RBAC has one table (rljob.cli.doctor.operator_rules): the chart's rules and the table of
docs/operator.md are generated from it (hack/gen_rbac.py), and `rljob doctor` checks its verbs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rljob.cli.doctor.operator_rules import OPERATOR_PERMISSIONS, OPERATOR_RULES

REPO = Path(__file__).resolve().parents[2]


def test_generated_rules_and_doc_table_are_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "hack" / "gen_rbac.py"), "--check"],
        capture_output=True,
        text=True,
        env={"PYTHONSAFEPATH": "1", "PATH": ""},
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_rule_says_why_and_what_breaks() -> None:
    seen = set()
    for rule in OPERATOR_RULES:
        assert rule.why and rule.without, rule
        assert (rule.group, rule.resource) not in seen, f"{rule.resource}: one row per resource"
        seen.add((rule.group, rule.resource))
        assert "*" not in rule.verbs and "delete" not in rule.verbs and "deletecollection" not in rule.verbs


def test_doctor_asks_for_every_verb_of_the_table() -> None:
    asked = {(p.verb, p.group, f"{p.resource}/{p.subresource}" if p.subresource else p.resource)
             for p in OPERATOR_PERMISSIONS}  # fmt: skip
    table = {(v, r.group, r.resource) for r in OPERATOR_RULES for v in r.verbs}
    assert asked == table
    assert ("patch", "", "events") not in asked and ("get", "", "secrets") in asked
