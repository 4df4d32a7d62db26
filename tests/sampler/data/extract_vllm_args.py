"""Extract the `vllm serve` option names of a vLLM wheel, statically (no import: vLLM needs torch/TPU).

vLLM builds its serve parser in `vllm/entrypoints/launchers/cli_args.py::make_arg_parser` from explicit
`add_argument("--name", ...)` calls (there and in `vllm/engine/arg_utils.py::EngineArgs.add_cli_args`)
and from the fields of the `FrontendArgs` / `BaseFrontendArgs` dataclasses (`--field-name`). This script
reads those two files with `ast` and writes the option set, plus the allowed `--max-lora-rank` values
(`vllm/config/lora.py::MaxLoRARanks`) and whether `VLLM_ALLOW_RUNTIME_LORA_UPDATING` is a known env var.

Regenerate (the committed file was made from vllm-tpu 0.32.0, the wheel the TPU sampler image installs):
    pip download --no-deps vllm-tpu==0.32.0 -d /tmp/v && unzip -q -o /tmp/v/vllm_tpu-*.whl -d /tmp/v/x
    .venv/bin/python tests/sampler/data/extract_vllm_args.py /tmp/v/x vllm-tpu 0.32.0 \
        > tests/sampler/data/vllm-tpu-0.32.0-serve-args.json
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def _options_from_add_argument(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr != "add_argument":
                continue
            for arg in node.args:
                if (
                    isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and arg.value.startswith("--")
                ):
                    out.add(arg.value)
    return out


def _dataclass_fields(tree: ast.AST, classes: set[str]) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    out.add("--" + stmt.target.id.replace("_", "-"))
    return out


def _literal_ints(tree: ast.AST, name: str) -> list[int]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            sub = node.value
            if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Tuple):
                return [
                    e.value
                    for e in sub.slice.elts
                    if isinstance(e, ast.Constant) and isinstance(e.value, int)
                ]
    raise SystemExit(f"{name} not found")


def main(argv: list[str]) -> int:
    root, package, version = Path(argv[0]) / "vllm", argv[1], argv[2]
    arg_utils = ast.parse((root / "engine/arg_utils.py").read_text())
    cli_args = ast.parse((root / "entrypoints/launchers/cli_args.py").read_text())
    options = _options_from_add_argument(arg_utils) | _options_from_add_argument(cli_args)
    options |= _dataclass_fields(cli_args, {"BaseFrontendArgs", "FrontendArgs"})
    ranks = _literal_ints(ast.parse((root / "config/lora.py").read_text()), "MaxLoRARanks")
    envs = (root / "envs.py").read_text()
    doc = {
        "package": package,
        "version": version,
        "source": "vllm/engine/arg_utils.py, vllm/entrypoints/launchers/cli_args.py, vllm/config/lora.py",
        "options": sorted(options),
        "max_lora_ranks": ranks,
        "runtime_lora_env_known": "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in envs,
    }
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
