#!/usr/bin/env python3
"""The import smoke test of one image's entrypoint, run by the interpreter of that image's rehearsed
environment (hack/rehearse_images.py): `python image_smoke.py operator|trainer|sampler` prints one JSON
object and exits 0 when every check passed.

- every target: the entrypoint's module and every rljob module of its package import, and the console
  script answers `--help` with exit 0;
- trainer: every module any trainer source file imports (lazy imports included: MaxText is imported
  inside functions) imports too, with JAX on its CPU backend;
- sampler: `preflight()` finds a vLLM that can hot-swap LoRA adapters on TPU (it reads vLLM's and
  tpu-inference's sources, it does not import them), and `vllm serve --help=all` knows every flag the
  sampler passes it for every recipe and profile of the catalog;
- operator: neither JAX nor any trainer library is loaded.
`modules` lists the top-level modules loaded, which tests/images/ checks against what an image must not
need (the trainer: no torch, vLLM, tpu-inference or tunix).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

ENTRYPOINTS = {
    "operator": ("rljob.operator.main", "rljob-operator", ["rljob.operator", "rljob.cli"]),
    "trainer": ("rljob.trainer.main", "rljob-trainer", ["rljob.trainer"]),
    "sampler": ("rljob.sampler.main", "rljob-sampler", ["rljob.sampler"]),
}
# Modules of a package that run only outside the image (the CPU backend's test helpers).
NOT_IN_IMAGE = {"rljob.sampler.cpu_server"}


def _submodules(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__, package + "."))


def _imports_of(package: str) -> list[str]:
    """Every absolute import statement of the package's source files, wherever it stands."""
    pkg = importlib.import_module(package)
    names: set[str] = set()
    for path in Path(pkg.__path__[0]).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return sorted(names)


def _try_import(name: str, failures: dict[str, str]) -> None:
    try:
        importlib.import_module(name)
    except BaseException as e:  # a module that exits on import is a failure too
        failures[name] = "".join(traceback.format_exception_only(type(e), e)).strip()[-600:]


def vllm_flags_unknown() -> list[str]:
    """The flags `build_command` gives `vllm serve`, over the catalog, that the installed vLLM lacks."""
    import yaml
    from rljob.recipes import recipe_catalog
    from rljob.recipes.api import API_VERSION, KIND
    from rljob.recipes.plan import parse_manifest, resolve
    from rljob.sampler.vllm import build_command

    flags: set[str] = set()
    for name in recipe_catalog.names():
        for profile in [None, *recipe_catalog.load(name).profiles]:
            spec: dict[str, Any] = {"recipe": name, "storage": {"root": "gs://bucket"}}
            if profile:
                spec["trainer"] = {"profile": profile}
            doc = {"apiVersion": API_VERSION, "kind": KIND,
                   "metadata": {"name": "smoke", "namespace": "smoke"}, "spec": spec}  # fmt: skip
            argv = build_command(resolve(parse_manifest(yaml.safe_dump(doc)))).argv
            flags |= {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    vllm = Path(sys.executable).parent / "vllm"
    run = subprocess.run([str(vllm), "serve", "--help=all"], capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        return [f"vllm serve --help=all: exit {run.returncode}: {run.stderr[-400:]}"]
    known = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", run.stdout))
    return sorted(flags - known)


def main(target: str) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    module, script, packages = ENTRYPOINTS[target]
    failures: dict[str, str] = {}
    extra: dict[str, Any] = {}
    _try_import(module, failures)
    for package in packages:
        for name in _submodules(package):
            if name not in NOT_IN_IMAGE:
                _try_import(name, failures)
    if target == "trainer":
        for name in _imports_of("rljob.trainer"):
            _try_import(name, failures)
    if target == "sampler" and "rljob.sampler.vllm" not in failures:
        from rljob.sampler.vllm import preflight

        extra["preflight"] = preflight()
        if extra["preflight"] is not None:
            failures["preflight"] = extra["preflight"]
        extra["vllm_flags_unknown"] = vllm_flags_unknown()
        if extra["vllm_flags_unknown"]:
            failures["vllm serve flags"] = ", ".join(extra["vllm_flags_unknown"])
    help_run = subprocess.run(
        [str(Path(sys.executable).parent / script), "--help"], capture_output=True, text=True, timeout=600
    )
    if help_run.returncode != 0:
        failures[f"{script} --help"] = (help_run.stderr or help_run.stdout)[-600:]
    loaded = sorted({m.split(".")[0] for m in sys.modules if not m.startswith("_")})
    if target == "operator":
        heavy = sorted({"jax", "jaxlib", "flax", "maxtext", "qwix", "orbax", "torch"} & set(loaded))
        if heavy:
            failures["operator loads"] = ", ".join(heavy)
    result = {"target": target, "ok": not failures, "failures": failures, "modules": loaded, **extra}
    print(json.dumps(result))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
