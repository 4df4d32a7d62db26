"""`make tinker-cookbook`'s venv (hack/cookbook-requirements.txt, installed with --no-deps) and the project:
the Cookbook's client talks to the service with the SDK release the service is built and tested with, the
Cookbook is the release docs/tinker.md names, and nothing in it is the project's own dependency."""

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _pins(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def test_the_cookbook_venv_pins_the_sdk_the_service_is_tested_with() -> None:
    client = _pins((REPO / "hack/cookbook-requirements.txt").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    trainer_deps = project["project"]["optional-dependencies"]["trainer"]
    (sdk,) = [d for d in trainer_deps if d.startswith("tinker==")]
    assert client["tinker"] == sdk.removeprefix("tinker==")
    assert client["tinker-cookbook"] == "0.6.1"
    # --no-deps: the Cookbook's tml-renderers>=0.4.1 is not on PyPI and stays out; torch is the client's.
    assert "tml-renderers" not in client and "torch" in client
    every_project_dep = " ".join(
        d for group in project["project"]["optional-dependencies"].values() for d in group
    ) + " ".join(project["project"].get("dependencies", []))
    assert "torch" not in re.findall(r"[A-Za-z0-9_.-]+", every_project_dep)
    assert "tinker-cookbook" not in every_project_dep


def test_make_tinker_cookbook_installs_from_the_pins_without_dependencies() -> None:
    makefile = (REPO / "Makefile").read_text()
    rule = makefile[makefile.index("$(COOKBOOK_STAMP):") :]
    rule = rule[: rule.index("\n\n")]
    assert "--no-deps -r hack/cookbook-requirements.txt" in rule
    assert "$(COOKBOOK_VENV)/bin/python hack/cookbook.py --service-python $(PY)" in makefile
