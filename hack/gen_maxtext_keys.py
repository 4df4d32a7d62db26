#!/usr/bin/env python3
"""Regenerate recipes/data/maxtext-<version>-keys.json from the installed maxtext's own config.

The key set is MaxText's pydantic config model (maxtext.configs.types.MaxTextConfig.model_fields),
which pyconfig checks every raw key against; the default of each key is its value in that version's
configs/base.yml, else the model field's default when it is plain JSON. `models` lists the model
names (types.ModelName) with the keys each model's configs/models/<name>.yml sets, which MaxText
refuses to see overridden with another value unless override_model_config=true.

`model_reads` maps each key that the model rljob's trainer builds reads to where MaxText reads it: a
static scan (ast) of the installed maxtext's model code, every `<...config|cfg>.<key>` or
`getattr(config, "<key>")` in layers/, models/, kernels/ and common/common_types.py, and in the functions
of the utility modules the trainer calls (maxtext_utils.get_mesh_from_config, get_abstract_param,
sharding.get_input_data_sharding, checkpointing.load_params_from_path; and what the model code calls
there) with the functions of the same module they call; plus the keys MaxText's config turns into a field
the model reads (CONFIG_INPUTS). rljob.recipes.maxtext_policy classifies every key from it.

    .venv/bin/python hack/gen_maxtext_keys.py            # writes the file
    .venv/bin/python hack/gen_maxtext_keys.py --check    # exits 1 if the committed file differs
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

DATA = Path(__file__).resolve().parents[1] / "recipes" / "data"


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return _plain(value.value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return None


# The model code, scanned whole (paths under the maxtext package).
MODEL_CODE = ("layers/", "models/", "kernels/", "common/common_types.py")
# Utility modules the trainer (and the model code) calls: the functions followed from these entries.
MODEL_UTILS = {
    "utils/maxtext_utils.py": ("maxtext_utils", ("get_mesh_from_config", "get_abstract_param")),
    "utils/sharding.py": ("sharding", ("get_input_data_sharding", "nnx_construct_named_sharding")),
    "common/checkpointing.py": ("checkpointing", ("load_params_from_path",)),
}
# Keys MaxText's config (configs/types.py) turns into fields the model code reads.
CONFIG_INPUTS = {
    **{
        k: "configs/types.py: emb_dim, mlp_dim, moe_mlp_dim, num_decoder_layers (scaled)"
        for k in ("base_mlp_dim", "base_moe_mlp_dim", "base_num_decoder_layers", "global_parameter_scale")
    },
    **{
        k: "configs/types.py: tensors_on_device / tensors_to_offload of remat_policy custom"
        for k in (
            "decoder_layer_input",
            "context",
            "mlpwi",
            "mlpwi_0",
            "mlpwi_1",
            "mlpwo",
            "moe_mlpwi",
            "moe_mlpwi_0",
            "moe_mlpwi_1",
            "moe_mlpwo",
            "moe_x_sorted",
            "query_proj",
            "key_proj",
            "value_proj",
            "kv_proj",
            "query_wa_proj",
            "kv_wa_proj",
            "mla_kv",
            "mla_q",
            "qkv_proj",
            "attention_out",
            "out_proj",
            "engram",
        )
    },
    **{
        f"{kind}_{axis}_parallelism": "configs/types.py: ici_parallelism / dcn_parallelism (the mesh)"
        for kind in ("ici", "dcn")
        for axis in (
            "data",
            "fsdp",
            "fsdp_transpose",
            "sequence",
            "context",
            "context_autoregressive",
            "context_usp_ulysses",
            "tensor",
            "tensor_sequence",
            "autoregressive",
            "expert",
            "pipeline",
            "diloco",
        )
    },
    "override_model_config": "configs/pyconfig.py: the model config's keys may be overridden",
    "override_logical_axis_rules": "configs/pyconfig.py: logical_axis_rules",
}


def _config_reads(tree: ast.AST, keys: set[str]) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in keys:
            if ast.unparse(node.value).split(".")[-1].lower().endswith(("config", "cfg")):
                out.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in keys
        ):
            out.add(str(node.args[1].value))
    return out


def model_reads(root: Path, keys: set[str]) -> dict[str, str]:
    """Key -> where the model code of the maxtext package at ``root`` reads it (see the docstring)."""
    found: dict[str, str] = {}
    called: dict[str, set[str]] = {alias: set() for alias, _ in MODEL_UTILS.values()}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if not rel.startswith(MODEL_CODE):
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        for k in sorted(_config_reads(tree, keys)):
            found.setdefault(k, rel)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in called
            ):
                called[node.value.id].add(node.attr)
    for rel, (alias, entries) in MODEL_UTILS.items():
        tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        funcs = {n.name: n for n in getattr(tree, "body", []) if isinstance(n, ast.FunctionDef)}
        todo, seen = sorted({*entries, *called[alias]}), set()
        while todo:
            name = todo.pop()
            if name in seen or name not in funcs:
                continue
            seen.add(name)
            for k in sorted(_config_reads(funcs[name], keys)):
                found.setdefault(k, f"{rel}:{name}")
            todo += [n.id for n in ast.walk(funcs[name]) if isinstance(n, ast.Name) and n.id in funcs]
    for k, where in CONFIG_INPUTS.items():
        if k in keys:
            found.setdefault(k, where)
    return dict(sorted(found.items()))


def build() -> tuple[str, dict[str, Any]]:
    from maxtext.configs import types  # the installed maxtext; heavy import (jax)

    version = importlib.metadata.version("maxtext")
    base_yml = Path(types.__file__).with_name("base.yml")
    base = yaml.safe_load(base_yml.read_text(encoding="utf-8")) or {}
    keys: dict[str, Any] = {}
    for name, field in sorted(types.MaxTextConfig.model_fields.items()):
        if name in base:
            keys[name] = _plain(base[name])
        else:
            default = field.get_default(call_default_factory=True)
            keys[name] = _plain(default)
    import typing

    models: dict[str, Any] = {}
    models_dir = base_yml.parent / "models"
    for name in typing.get_args(types.ModelName):
        yml = models_dir / f"{name}.yml"
        if yml.is_file():
            models[name] = {
                k: _plain(v) for k, v in (yaml.safe_load(yml.read_text(encoding="utf-8")) or {}).items()
            }
        else:
            models[name] = {}
    doc = {
        "maxtext": version,
        "source": "maxtext.configs.types.MaxTextConfig.model_fields; defaults from configs/base.yml; "
        "models: types.ModelName with the keys of configs/models/<name>.yml; model_reads: where the model "
        "code rljob's trainer builds reads each key (hack/gen_maxtext_keys.py model_reads)",
        "keys": keys,
        "models": models,
        "model_reads": model_reads(base_yml.parents[1], set(keys)),
    }
    return version, doc


def render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead")
    args = parser.parse_args()
    version, doc = build()
    path = DATA / f"maxtext-{version}-keys.json"
    text = render(doc)
    if args.check:
        ok = path.exists() and path.read_text(encoding="utf-8") == text
        print(f"{path}: {'up to date' if ok else 'DIFFERS from the installed maxtext ' + version}")
        return 0 if ok else 1
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path} ({len(doc['keys'])} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
