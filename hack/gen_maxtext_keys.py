#!/usr/bin/env python3
"""Regenerate recipes/data/maxtext-<version>-keys.json from the installed maxtext's own config.

The key set is MaxText's pydantic config model (maxtext.configs.types.MaxTextConfig.model_fields),
which pyconfig checks every raw key against; the default of each key is its value in that version's
configs/base.yml, else the model field's default when it is plain JSON. `models` lists the model
names (types.ModelName) with the keys each model's configs/models/<name>.yml sets, which MaxText
refuses to see overridden with another value unless override_model_config=true.

    .venv/bin/python hack/gen_maxtext_keys.py            # writes the file
    .venv/bin/python hack/gen_maxtext_keys.py --check    # exits 1 if the committed file differs
"""

from __future__ import annotations

import argparse
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
        "models: types.ModelName with the keys of configs/models/<name>.yml",
        "keys": keys,
        "models": models,
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
