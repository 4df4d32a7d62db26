"""The Dockerfile (three targets: operator, trainer, sampler), checked without a container engine.

No image is built here (this machine has no container engine). What is checked instead:
- the Dockerfile parses (BuildKit's own parser, through the `dockerfile` package) into the stages and
  targets the images need; the operator runs as a non-root user, the TPU images as root (as Google's
  TPU manifests run them; docs/gke.md, section 5); every ENTRYPOINT is a console script of
  pyproject.toml; base images are pinned; uv in the image is the Makefile's uv;
- each target installs exactly the extras it should, and no version appears in the Dockerfile: every
  pin lives in pyproject.toml (`tpu` holds jax[tpu] at the jax the CPU venv runs); the sampler takes
  torch from the PyTorch CPU index and the Debian packages of vLLM's TPU Dockerfile;
- each target's install command, taken verbatim from the Dockerfile, resolved with `uv pip compile`
  for the base image's Python and platform by hack/rehearse_images.py (marker `slow`): the operator set
  has no JAX, the trainer set has jax[tpu] with libtpu, the sampler set has vllm-tpu; the operator's
  and the trainer's sets installed and their entrypoints' smoke tests run in them (`make
  images-rehearse` does it for all three);
- hadolint passes on the Dockerfile and catches deliberately broken copies.
"""

from __future__ import annotations

import importlib.util
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

_spec = importlib.util.spec_from_file_location(
    "rehearse_images", Path(__file__).resolve().parents[2] / "hack" / "rehearse_images.py"
)
assert _spec and _spec.loader
rehearse_images = importlib.util.module_from_spec(_spec)
sys.modules["rehearse_images"] = rehearse_images
_spec.loader.exec_module(rehearse_images)

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


# The user each image runs as: the operator non-root; the TPU images root, as every Google TPU manifest
# found runs TPU containers (docs/gke.md, section 5).
USERS = {"operator": "1000:1000", "trainer": "0:0", "sampler": "0:0"}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_target_runs_its_console_script_as_its_user(target: str) -> None:
    _, script = TARGETS[target]
    stage = STAGES[target]
    [entry] = stage.of("ENTRYPOINT")
    assert entry.json and list(entry.value) == [script]
    assert script in SCRIPTS
    [user] = stage.of("USER")
    assert user.value[0] == USERS[target]
    assert stage.commands.index(user) < stage.commands.index(entry)
    [home] = [c.value[1] for c in stage.of("ENV") if c.value[0] == "HOME"]
    assert home == ("/root" if USERS[target] == "0:0" else "/home/rljob")


# vLLM's TPU Dockerfile (vllm-project/tpu-inference, docker/Dockerfile.pypi): the PyTorch CPU index next
# to PyPI, and these Debian packages.
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
VLLM_TPU_DEBIAN = {"libopenmpi-dev", "libomp-dev", "build-essential"}


def test_sampler_installs_as_vllms_tpu_dockerfile() -> None:
    [command] = install_commands(copied_venv_stage("sampler"))
    argv = shlex.split(command)
    assert f"--extra-index-url={PYTORCH_CPU_INDEX}" in argv
    # pip's way of picking the best version over both indexes (the default uv strategy would take every
    # package the PyTorch index has from it alone).
    assert "--index-strategy=unsafe-best-match" in argv
    apt = [c.value[0] for c in STAGES["sampler"].of("RUN") if "apt-get install" in c.value[0]]
    assert len(apt) == 1
    assert set(shlex.split(apt[0].split("apt-get install", 1)[1].split("&&")[0])) >= VLLM_TPU_DEBIAN
    for target in ("operator", "trainer"):
        assert not [c for c in STAGES[target].of("RUN") if "apt-get" in c.value[0]], target
        [command] = install_commands(copied_venv_stage(target))
        assert "download.pytorch.org" not in command, target


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
    # ... but the TPU compiler (the compile extra), for rljob drill --compile, at the tpu extra's jax pin.
    assert "compile" in m[1].split(",")


def test_compile_extra_is_the_tpu_extras_jax() -> None:
    """libtpu in the dev venv comes from the same jax[tpu] pin as the trainer image's."""
    assert _req("compile", "jax") == _req("tpu", "jax")
    assert installed_version("libtpu") is not None


# ------------------------------------------------------------------ resolution and install (slow)


def _resolve(target: str, tmp_path: Path) -> dict[str, str]:
    """The target's install command from the Dockerfile, verbatim, resolved for the image's platform."""
    report = rehearse_images.compile_target(target, tmp_path / target)
    assert report.error is None, report.error
    assert (report.python, report.platform) == ("3.12.12", "x86_64-manylinux_2_40")
    return dict(report.resolved) | {"(cuda_only)": ",".join(report.cuda_only)}


@pytest.mark.slow
def test_operator_image_resolves_without_jax(tmp_path: Path) -> None:
    got = _resolve("operator", tmp_path)
    assert not JAX_FAMILY & set(got), sorted(JAX_FAMILY & set(got))
    assert not {"torch", "vllm", "vllm-tpu"} & set(got)
    [kopf] = [s.version for s in _req("operator", "kopf").specifier]
    assert got["kopf"] == kopf
    assert "kubernetes" in got


@pytest.mark.slow
def test_trainer_image_resolves_jax_tpu_at_the_pin(tmp_path: Path) -> None:
    got = _resolve("trainer", tmp_path)
    [pinned] = [s.version for s in _req("tpu", "jax").specifier]
    assert got["jax"] == pinned and got["jaxlib"] == pinned
    assert "libtpu" in got
    for name in ("maxtext", "google-tunix", "qwix", "orbax-checkpoint", "google-cloud-storage"):
        assert name in got, name
    assert not {"vllm", "vllm-tpu", "kopf", "torch"} & set(got)


@pytest.mark.slow
def test_sampler_image_resolves_vllm_tpu_at_the_pin(tmp_path: Path) -> None:
    got = _resolve("sampler", tmp_path)
    [pinned] = [s.version for s in _req("sampler-tpu", "vllm-tpu").specifier]
    assert got["vllm-tpu"] == pinned and got["tpu-inference"] == pinned
    assert "libtpu" in got and "google-cloud-storage" in got and "torch" in got
    assert not {"maxtext", "google-tunix", "kopf"} & set(got)
    # What the PyTorch CPU index keeps out: the CUDA libraries PyPI's torch pulls in (where that index is
    # out of reach, the rehearsal resolves against PyPI and names them).
    cuda = [n for n in got["(cuda_only)"].split(",") if n]
    if cuda:
        assert all(n.startswith(("nvidia-", "cuda-")) for n in cuda) and "nvidia-cublas-cu12" in cuda
        doc = " ".join((REPO / "docs" / "gke.md").read_text().split())
        assert f"from PyPI alone torch brings {len(cuda)} CUDA packages" in doc
    else:
        assert got["torch"].endswith("+cpu")


def test_cuda_only_is_what_only_torch_needs() -> None:
    via = {
        "torch": ["vllm"],
        "nvidia-cublas-cu12": ["torch"],
        "nvidia-cudnn-cu12": ["torch"],
        "nvidia-nccl-cu12": ["torch", "jax-cuda-plugin"],
        "cuda-pathfinder": ["cuda-bindings"],
        "cuda-bindings": ["torch"],
        "triton": ["torch", "xgrammar"],
        "numpy": ["torch"],
    }
    assert rehearse_images.cuda_only(via) == [
        "cuda-bindings", "cuda-pathfinder", "nvidia-cublas-cu12", "nvidia-cudnn-cu12"
    ]  # fmt: skip


# What each image's smoke test must load, and must not: the trainer none of MaxText's post-training
# rollout stack (docs/gke.md, section 5), the operator no JAX. The sampler's install (~5 GB with PyPI's
# CUDA torch) is rehearsed by `make images-rehearse` only.
SMOKE_LOADS = {
    "operator": ({"kopf", "kubernetes"}, {"jax", "torch", "maxtext"}),
    "trainer": ({"maxtext", "qwix", "jax", "orbax"}, {"torch", "vllm", "tpu_inference", "tunix", "ray"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(SMOKE_LOADS))
def test_image_installs_and_its_entrypoint_passes_the_smoke_test(target: str) -> None:
    """The resolved set installed in a fresh environment, the smoke test run in it: every module of the
    entrypoint's package (for the trainer: every module its code imports) imports, `--help` answers."""
    report = rehearse_images.rehearse(target, install=True)
    assert report.error is None, report.error
    assert report.smoke is not None and report.smoke["ok"], report.smoke
    must, must_not = SMOKE_LOADS[target]
    loaded = set(report.smoke["modules"])
    assert must <= loaded and not must_not & loaded, (must - loaded, must_not & loaded)


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
