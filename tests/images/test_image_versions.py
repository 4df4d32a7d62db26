"""Image names and tags follow the package: one version (pyproject.toml) for the chart's appVersion, the
operator image the chart runs, and the trainer/sampler images the renderer writes into JobSets; each
image name is its Dockerfile target."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from rljob.recipes import plan

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
CHART = REPO / "charts" / "rljob"
DOCKERFILE_TARGETS = set(re.findall(r"^FROM \S+ AS (\w+)$", (REPO / "Dockerfile").read_text(), re.M))


def _split(image: str) -> tuple[str, str]:
    repository, _, tag = image.rpartition(":")
    return repository, tag


@pytest.mark.parametrize(
    ("image", "target"),
    [(plan.DEFAULT_TRAINER_IMAGE, "trainer"), (plan.DEFAULT_SAMPLER_IMAGE, "sampler")],
)
def test_rendered_images_follow_the_package_version(image: str, target: str) -> None:
    repository, tag = _split(image)
    assert tag == VERSION
    assert repository.endswith(f"/rljob-{target}") and target in DOCKERFILE_TARGETS


def test_chart_runs_the_operator_image_at_the_package_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == VERSION
    assert values["image"]["tag"] in ("", VERSION)
    assert values["image"]["repository"].endswith("/rljob-operator") and "operator" in DOCKERFILE_TARGETS
    # An empty tag means the appVersion, in the template itself.
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    assert "{{ .Values.image.tag | default .Chart.AppVersion }}" in deployment
    # The three images live side by side in one registry path.
    registry = values["image"]["repository"].rsplit("/", 1)[0]
    assert {
        _split(i)[0].rsplit("/", 1)[0] for i in (plan.DEFAULT_TRAINER_IMAGE, plan.DEFAULT_SAMPLER_IMAGE)
    } == {registry}
