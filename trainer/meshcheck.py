"""``python -m rljob.trainer.meshcheck --config run.json``: build the run's MaxText mesh without the model.

Run with ``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (N = the run's
trainer devices): MaxText's own mesh construction (``maxtext_utils.get_mesh_from_config``, the call the
trainer makes) over N host devices standing in for the slice's TPU devices. Prints one JSON line:
``{"mesh": {axis: size}, "devices": N}``. A multi-slice run's host devices cannot carry slice ids, so
with ``--per-slice`` (N = one slice's devices) it builds one slice's mesh, the dcn axes set to 1. Exit 2
with ``field: message`` when MaxText refuses the keys.
``rljob drill`` runs it for the full-size layout (the real process count is checked by
rljob.recipes.topology; the devices here are one process's, which is all a mesh needs)."""

from __future__ import annotations

import argparse
import json
import re
import sys

from rljob.recipes.failure import EXIT_BAD_CONFIG, EXIT_OK
from rljob.recipes.runconfig import RunConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rljob.trainer.meshcheck", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument(
        "--per-slice",
        action="store_true",
        help="build one slice's mesh (dcn_* = 1): host devices cannot stand in for several slices",
    )
    args = p.parse_args(argv)
    rc = RunConfig.load(args.config)
    keys = dict(rc.trainer.maxtext)
    if args.per_slice:
        keys.update({k: 1 for k in keys if k.startswith("dcn_") and k.endswith("_parallelism")})
    import jax
    from maxtext.utils import maxtext_utils
    from rljob.trainer.model import maxtext_config

    try:
        cfg = maxtext_config(keys)
        mesh = maxtext_utils.get_mesh_from_config(cfg)
    except (ValueError, AssertionError) as e:
        # A pydantic ValidationError's first line only counts the errors; its next line says what.
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        why = next(
            (x for x in lines if not re.match(r"^\d+ validation errors? for ", x)), lines[0] if lines else ""
        )
        print(f"spec.trainer.mesh: MaxText refuses the mesh: {why}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    shape = {str(k): int(v) for k, v in mesh.shape.items()}
    print(json.dumps({"mesh": shape, "devices": jax.device_count()}))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
