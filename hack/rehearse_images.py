#!/usr/bin/env python3
"""`make images-rehearse`: each image's Python install, rehearsed without a container engine.

For each Dockerfile target (operator, trainer, sampler):
1. resolve: the `uv pip install ...` command of the target's build stage, taken verbatim from the
   Dockerfile, becomes `uv pip compile` with the same requirements and options, for the base image's
   Python (the PYTHON_IMAGE tag) and platform (x86_64, the glibc of its Debian release), with the uv the
   image copies (the Makefile's UV_VERSION, checked by tests/images/);
2. with --install: the resolved set goes into a fresh virtual environment (`--no-deps`, as resolved)
   and the project itself as a built, non-editable package, as in the image;
3. with --install: hack/image_smoke.py runs in that environment (imports, `--help`, the sampler's
   preflight) on JAX's CPU backend.
What cannot be rehearsed here is said in `not_rehearsed`: where the PyTorch CPU index
(download.pytorch.org) is out of reach, the sampler's set is resolved against PyPI alone, so the
environment has PyPI's torch with the CUDA libraries only it pulls in (`cuda_only`, which the image does
not have) where the image has torch's CPU build. Nothing here runs on a TPU.

Writes .cache/images/<target>/{requirements.txt,report.json} and prints one JSON line per target.
Exit 0 when every target resolved (and, with --install, passed its smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import dockerfile

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
CACHE = REPO / ".cache" / "images"
UV = Path(sys.executable).parent / "uv"
TARGETS = ("operator", "trainer", "sampler")
# glibc of each Debian release a python:*-slim-<release> image is built on, and the newest manylinux
# tag uv knows that it satisfies (x86_64-manylinux_2_40 is uv 0.9.7's highest).
GLIBC = {"bookworm": (2, 36), "trixie": (2, 41)}
UV_MAX_MANYLINUX = (2, 40)
PYTORCH_INDEX_HOST = "download.pytorch.org"
# What PyPI's torch wheel pulls in and the CPU build from the PyTorch index does not.
CUDA_ONLY = re.compile(r"^(nvidia-.*|triton|cuda-.*)$")
SMOKE_SUMMARY = ("ok", "failures", "preflight", "vllm_flags_unknown")


@dataclass
class Install:
    """One target's install command, as the Dockerfile writes it."""

    target: str
    command: str
    requirements: list[str]
    options: list[str]


@dataclass
class Report:
    target: str
    command: str
    python: str
    platform: str
    resolved: dict[str, str] = field(default_factory=dict)
    via: dict[str, list[str]] = field(default_factory=dict)
    cuda_only: list[str] = field(default_factory=list)
    not_rehearsed: list[str] = field(default_factory=list)
    error: str | None = None
    smoke: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and (self.smoke is None or bool(self.smoke.get("ok")))


def _stages() -> tuple[dict[str, str], dict[str, list[Any]]]:
    args: dict[str, str] = {}
    stages: dict[str, list[Any]] = {}
    current: list[Any] | None = None
    for cmd in dockerfile.parse_string(DOCKERFILE.read_text()):
        if cmd.cmd == "FROM":
            name = cmd.value[2] if len(cmd.value) == 3 else f"#{len(stages)}"
            current = stages[name] = []
        elif current is None and cmd.cmd == "ARG":
            key, _, default = cmd.value[0].partition("=")
            args[key] = default
        elif current is not None:
            current.append(cmd)
    return args, stages


def install_command(target: str) -> Install:
    """The `uv pip install` of the stage whose /opt/rljob the target copies."""
    _, stages = _stages()
    [copy] = [c for c in stages[target] if c.cmd == "COPY" and any(f.startswith("--from=") for f in c.flags)]
    source = next(f for f in copy.flags if f.startswith("--from=")).split("=", 1)[1]
    [command] = [c.value[0] for c in stages[source] if c.cmd == "RUN" and "uv pip install" in c.value[0]]
    argv = shlex.split(command)
    assert argv[:3] == ["uv", "pip", "install"], command
    reqs = [a for a in argv[3:] if not a.startswith("-")]
    opts = [a for a in argv[3:] if a.startswith("-")]
    return Install(target, command, reqs, opts)


def image_platform() -> tuple[str, str]:
    """(python version, uv platform) of the PYTHON_IMAGE base, e.g. ("3.12.12", "x86_64-manylinux_2_40")."""
    args, _ = _stages()
    m = re.fullmatch(r"python:(\d+\.\d+\.\d+)-slim-(\w+)", args["PYTHON_IMAGE"])
    assert m, args["PYTHON_IMAGE"]
    glibc = min(GLIBC[m[2]], UV_MAX_MANYLINUX)
    return m[1], f"x86_64-manylinux_{glibc[0]}_{glibc[1]}"


def _parse(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    resolved: dict[str, str] = {}
    via: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)\s*(?:#\s*via\s*(.*))?$", line)
        if m:
            name = m[1].lower()
            resolved[name] = m[2]
            via[name] = sorted(v.strip().lower() for v in (m[3] or "").split(",") if v.strip())
    return resolved, via


def cuda_only(via: dict[str, list[str]]) -> list[str]:
    """Packages every path to which goes through torch and CUDA-only packages."""
    out: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, parents in via.items():
            if name in out or not CUDA_ONLY.match(name) or not parents:
                continue
            if all(p == "torch" or p in out for p in parents):
                out.add(name)
                changed = True
    return sorted(out)


def compile_target(target: str, out_dir: Path) -> Report:
    inst = install_command(target)
    python, platform = image_platform()
    report = Report(target, inst.command, python, platform)
    out_dir.mkdir(parents=True, exist_ok=True)
    opts = list(inst.options)

    def run(options: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(UV), "pip", "compile", "-", *options, "--python", sys.executable,
             "--python-version", python, "--python-platform", platform,
             "--annotation-style", "line", "--no-header", "-o", str(out_dir / "requirements.txt")],
            input="\n".join(inst.requirements) + "\n", cwd=REPO, capture_output=True, text=True,
            timeout=900, env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"},
        )  # fmt: skip

    proc = run(opts)
    pytorch = [o for o in opts if PYTORCH_INDEX_HOST in o]
    if proc.returncode != 0 and pytorch and PYTORCH_INDEX_HOST in proc.stderr:
        report.not_rehearsed.append(
            f"{' '.join(pytorch)}: {PYTORCH_INDEX_HOST} is out of reach here; resolved against PyPI alone, "
            "with PyPI's torch and the CUDA libraries only it pulls in (cuda_only) for torch's CPU build"
        )
        proc = run([o for o in opts if o not in pytorch])
        if proc.returncode == 0:
            _, via = _parse((out_dir / "requirements.txt").read_text())
            report.cuda_only = cuda_only(via)
    if proc.returncode != 0:
        report.error = proc.stderr[-3000:]
        return report
    report.resolved, report.via = _parse((out_dir / "requirements.txt").read_text())
    return report


def install_and_smoke(report: Report, out_dir: Path) -> None:
    venv = out_dir / "venv"
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    subprocess.run([str(UV), "venv", "-q", "--clear", "--python", sys.executable, str(venv)], check=True)
    pins = [f"{n}=={v}" for n, v in report.resolved.items()]
    (out_dir / "install.txt").write_text("\n".join(pins) + "\n")
    steps = [
        [str(UV), "pip", "install", "-q", "--no-deps", "-r", str(out_dir / "install.txt")],
        [str(UV), "pip", "install", "-q", "--no-deps", "--reinstall-package", "rljob", str(REPO)],
    ]
    for argv in steps:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            report.error = f"{' '.join(argv)}: {proc.stderr[-3000:]}"
            return
    smoke_env = {**env, "PYTHONSAFEPATH": "1", "JAX_PLATFORMS": "cpu"}
    smoke_env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    proc = subprocess.run(
        [str(venv / "bin" / "python"), str(REPO / "hack" / "image_smoke.py"), report.target],
        cwd=out_dir, env=smoke_env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    try:
        report.smoke = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        report.smoke = {"ok": False, "failures": {"image_smoke.py": (proc.stderr or proc.stdout)[-3000:]}}


def rehearse(target: str, install: bool) -> Report:
    out_dir = CACHE / target
    report = compile_target(target, out_dir)
    if install and report.error is None:
        install_and_smoke(report, out_dir)
    (out_dir / "report.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("targets", nargs="*", metavar="TARGET", help=f"of {', '.join(TARGETS)} (default: all)")
    p.add_argument("--install", action="store_true", help="install each resolved set and run its smoke test")
    args = p.parse_args(argv)
    if unknown := set(args.targets) - set(TARGETS):
        p.error(f"unknown targets {sorted(unknown)}; known: {', '.join(TARGETS)}")
    ok = True
    for target in args.targets or TARGETS:
        r = rehearse(target, args.install)
        ok &= r.ok
        summary = {
            "target": target, "ok": r.ok, "packages": len(r.resolved), "platform": r.platform,
            "python": r.python, "not_rehearsed": r.not_rehearsed, "cuda_only": r.cuda_only,
            "error": (r.error or "")[-400:] or None,
            "smoke": r.smoke and {k: r.smoke.get(k) for k in SMOKE_SUMMARY},
        }  # fmt: skip
        print(json.dumps(summary), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
