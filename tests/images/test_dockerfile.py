"""The Dockerfile (three targets: operator, trainer, sampler), checked without a container engine.

No image is built here (this machine has no container engine). What is checked instead:
- the Dockerfile parses (BuildKit's own parser, through the `dockerfile` package) into the stages and
  targets the images need; every target runs as a non-root user; every ENTRYPOINT is a console script
  of pyproject.toml; base images are pinned; uv in the image is the Makefile's uv;
- each target installs exactly the extras it should, and no version appears in the Dockerfile: every
  pin lives in pyproject.toml (`tpu` holds jax[tpu] at the jax the CPU venv runs);
- each target's install command, taken verbatim from the Dockerfile, resolved against PyPI with
  `uv pip install --dry-run` (marker `slow`): the operator set has no JAX, the trainer set has
  jax[tpu] with libtpu, the sampler set has vllm-tpu;
- hadolint passes on the Dockerfile and catches deliberately broken copies.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib.metadata import version as installed_version
from pathlib import Path

import dockerfile
import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
VENV_BIN = Path(sys.executable).parent
UV = VENV_BIN / "uv"
HADOLINT = VENV_BIN / "hadolint"

# What each image target installs, and the console script it runs.
TARGETS = {
    "operator": ({"operator"}, "rljob-operator"),
    "trainer": ({"trainer", "tpu"}, "rljob-trainer"),
    "sampler": ({"sampler", "sampler-tpu"}, "rljob-sampler"),
}
JAX_FAMILY = {"jax", "jaxlib", "libtpu", "flax", "maxtext", "google-tunix", "qwix", "orbax-checkpoint"}


@dataclass
class Stage:
    name: str
    base: str
    commands: list[dockerfile.Command] = field(default_factory=list)

    def of(self, cmd: str) -> list[dockerfile.Command]:
        return [c for c in self.commands if c.cmd == cmd.upper()]


def parse(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name."""
    args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for cmd in dockerfile.parse_string(text):
        if cmd.cmd == "FROM":
            value = [v for v in cmd.value]
            name = value[2] if len(value) == 3 and value[1].upper() == "AS" else f"#{len(stages)}"
            current = stages[name] = Stage(name, value[0])
        elif current is None and cmd.cmd == "ARG":
            key, _, default = cmd.value[0].partition("=")
            args[key] = default
        elif current is not None:
            current.commands.append(cmd)
    return args, stages


ARGS, STAGES = parse(DOCKERFILE.read_text())


def resolve(base: str) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: ARGS[m[1]], base)


def copied_venv_stage(target: str) -> Stage:
    """The build stage whose /opt/rljob a target copies."""
    copies = [c for c in STAGES[target].of("COPY") if any(f.startswith("--from=") for f in c.flags)]
    assert len(copies) == 1, f"{target}: expected one COPY --from (the venv), got {copies}"
    src = next(f for f in copies[0].flags if f.startswith("--from=")).split("=", 1)[1]
    assert copies[0].value == ("/opt/rljob", "/opt/rljob")
    return STAGES[src]


def install_commands(stage: Stage) -> list[str]:
    return [c.value[0] for c in stage.of("RUN") if "pip install" in c.value[0]]


def extras_of(command: str) -> set[str]:
    [target] = [w for w in shlex.split(command) if w.startswith(".[")]
    return set(target[2:-1].split(","))


# ---------------------------------------------------------------------------------------- structure


def test_three_targets_and_their_build_stages() -> None:
    assert set(TARGETS) <= set(STAGES)
    for target in TARGETS:
        assert copied_venv_stage(target).name == f"build-{target}"
        assert STAGES[target].base == "runtime"
    assert resolve(STAGES["runtime"].base) == resolve(STAGES["build"].base)  # same Python in both


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_target_installs_exactly_its_extras(target: str) -> None:
    extras, _ = TARGETS[target]
    [command] = install_commands(copied_venv_stage(target))
    assert command.split()[:3] == ["uv", "pip", "install"]
    assert extras_of(command) == extras
    assert extras <= set(EXTRAS), f"unknown extras {extras - set(EXTRAS)}"


def test_no_python_package_version_in_the_dockerfile() -> None:
    """Pins live in pyproject.toml only: the Dockerfile names extras, never a package version."""
    for stage in STAGES.values():
        for run in stage.of("RUN"):
            assert not re.search(r"[=<>~!]=|@\s*https?://", run.value[0].replace("--mount=", "")), (
                run.original
            )


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_target_runs_its_console_script_as_non_root(target: str) -> None:
    _, script = TARGETS[target]
    stage = STAGES[target]
    [entry] = stage.of("ENTRYPOINT")
    assert entry.json and list(entry.value) == [script]
    if script not in SCRIPTS:
        pytest.skip(
            f"console script {script} not declared in pyproject.toml yet (owned by the {target} work)"
        )
    [user] = stage.of("USER")
    assert user.value[0].split(":")[0] not in ("0", "root")
    assert stage.commands.index(user) < stage.commands.index(entry)


def test_base_images_are_pinned_and_match_the_project() -> None:
    python_image = ARGS["PYTHON_IMAGE"]
    m = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-\w+", python_image)
    assert m, f"PYTHON_IMAGE must pin a full Python version: {python_image}"
    assert f"{m[1]}.{m[2]}" == (REPO / ".python-version").read_text().strip()
    uv_tag = ARGS["UV_IMAGE"].rsplit(":", 1)[1]
    makefile_uv = re.search(r"^UV_VERSION := (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert makefile_uv and uv_tag == makefile_uv[1]
    for stage in STAGES.values():
        base = resolve(stage.base)
        assert base in STAGES or re.search(r":\d[\w.-]*$|@sha256:[0-9a-f]{64}$", base), base


def test_dockerignore_allows_exactly_what_is_copied() -> None:
    lines = [ln for ln in (REPO / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*", "start from nothing: the build context is an allow-list"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = {
        src.rstrip("/")
        for stage in STAGES.values()
        for c in stage.of("COPY")
        if not any(f.startswith("--from=") for f in c.flags)
        for src in c.value[:-1]
    }
    assert copied == allowed
    # Every package folder the distribution maps is copied, so the wheel built in the image is whole.
    assert set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()) <= copied


# -------------------------------------------------------------------------------- pins in pyproject


def _req(extra: str, name: str) -> Requirement:
    [req] = [r for r in map(Requirement, EXTRAS[extra]) if r.name == name]
    return req


def test_tpu_jax_is_the_jax_the_cpu_venv_runs() -> None:
    tpu = _req("tpu", "jax")
    assert tpu.extras == {"tpu"}
    [pinned] = [s.version for s in tpu.specifier if s.operator == "=="]
    assert _req("trainer", "jax").specifier.contains(pinned)
    assert installed_version("jax") == pinned, (
        f"the dev venv runs jax {installed_version('jax')} but the `tpu` extra pins {pinned}: "
        "update the pin in pyproject.toml so CPU tests and TPU images run the same jax"
    )


def test_sampler_tpu_pins_vllm_tpu_exactly() -> None:
    vllm = _req("sampler-tpu", "vllm-tpu")
    assert [s.operator for s in vllm.specifier] == ["=="]


def test_dev_venv_never_installs_the_tpu_extras() -> None:
    makefile = (REPO / "Makefile").read_text()
    m = re.search(r"^EXTRAS \?= (\S+)$", makefile, re.M)
    assert m and not {"tpu", "sampler-tpu"} & set(m[1].split(","))


# ---------------------------------------------------------------------------- resolution (PyPI, slow)


def _dry_run(target: str, tmp_path: Path) -> dict[str, str]:
    """Run the target's install command from the Dockerfile, verbatim, with --dry-run in a fresh venv."""
    [command] = install_commands(copied_venv_stage(target))
    venv = tmp_path / "venv"
    subprocess.run([str(UV), "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    argv = shlex.split(command)
    argv[0] = str(UV)
    env = {**os.environ, "VIRTUAL_ENV": str(venv), "UV_PYTHON_DOWNLOADS": "never"}
    proc = subprocess.run(
        [*argv, "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # " + name==version", or " + rljob @ file:///..." for the project itself
    out = dict(re.findall(r"^ \+ ([A-Za-z0-9_.-]+)(?:==| @ )(\S+)", proc.stderr + proc.stdout, re.M))
    assert out, proc.stderr[-3000:]
    return {k.lower(): v for k, v in out.items()}


@pytest.mark.slow
def test_operator_image_resolves_without_jax(tmp_path: Path) -> None:
    got = _dry_run("operator", tmp_path)
    assert not JAX_FAMILY & set(got), sorted(JAX_FAMILY & set(got))
    assert not {"torch", "vllm", "vllm-tpu"} & set(got)
    [kopf] = [s.version for s in _req("operator", "kopf").specifier]
    assert got["kopf"] == kopf
    assert "kubernetes" in got and got["rljob"].startswith("file://")


@pytest.mark.slow
def test_trainer_image_resolves_jax_tpu_at_the_pin(tmp_path: Path) -> None:
    got = _dry_run("trainer", tmp_path)
    [pinned] = [s.version for s in _req("tpu", "jax").specifier]
    assert got["jax"] == pinned and got["jaxlib"] == pinned
    assert "libtpu" in got
    for name in ("maxtext", "google-tunix", "qwix", "orbax-checkpoint", "google-cloud-storage"):
        assert name in got, name
    assert not {"vllm", "vllm-tpu", "kopf"} & set(got)


@pytest.mark.slow
def test_sampler_image_resolves_vllm_tpu_at_the_pin(tmp_path: Path) -> None:
    got = _dry_run("sampler", tmp_path)
    [pinned] = [s.version for s in _req("sampler-tpu", "vllm-tpu").specifier]
    assert got["vllm-tpu"] == pinned
    assert "tpu-inference" in got and "libtpu" in got and "google-cloud-storage" in got
    assert not {"maxtext", "google-tunix", "kopf"} & set(got)


# -------------------------------------------------------------------------------------------- hadolint


def _hadolint(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    return subprocess.run([str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True)


def test_hadolint_clean() -> None:
    proc = subprocess.run([str(HADOLINT), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("old", "new", "rule"),
    [
        ("FROM ${UV_IMAGE} AS uv", "FROM ghcr.io/astral-sh/uv AS uv", "DL3006"),
        ('ENTRYPOINT ["rljob-trainer"]', "ENTRYPOINT rljob-trainer", "DL3025"),
        ("WORKDIR /src", "RUN cd /src", "DL3003"),
        ('USER 1000:1000\nENTRYPOINT ["rljob-operator"]',
         'ENTRYPOINT ["rljob-operator"]\nRUN apt-get install -y curl', "DL3008"),
    ],
)  # fmt: skip
def test_hadolint_catches_broken_copies(old: str, new: str, rule: str, tmp_path: Path) -> None:
    text = DOCKERFILE.read_text()
    assert old in text
    proc = _hadolint(text.replace(old, new, 1), tmp_path)
    assert proc.returncode != 0 and rule in proc.stdout, proc.stdout
