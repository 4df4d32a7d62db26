"""The compile preflight's own command for the chip tier's run, on this CPU machine (no TPU): the zero-compile
start that tests/tpu/test_example_chip.py checks on the chip.

Resolves ``examples/qwen3-0.6b-v5e-1.yaml`` (a trainer on one v5e chip), points its cache storage at
``.tpu-cache/store`` (a local directory that travels to the TPU machine) and runs
``python -m rljob.trainer.compilecheck --config ... --cache-dir ...``, what the preflight Job runs: libtpu
compiles the trainer's programs for a v5e 1x1 topology and JAX's persistent cache files them under
``{storage}/cache/jax-trainer/``, where the trainer restores its cache from before it compiles. Writes
``.tpu-cache/run.json`` (the run config both sides use) and ``.tpu-cache/compile.json`` (the compile stage's
report: its predicted peak HBM and roofline, which the chip test compares with what it measures).
  .venv/bin/python hack/tpu/precompile.py [--example PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from rljob.recipes.plan import parse_manifest, resolve

OUT = Path(".tpu-cache")
EXAMPLE = "examples/qwen3-0.6b-v5e-1.yaml"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", default=EXAMPLE)
    args = ap.parse_args(argv)
    rc = resolve(parse_manifest(Path(args.example).read_text()))
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    store = OUT / "store"
    rc = rc.model_copy(update={"storage": rc.storage.model_copy(update={"cache": str(store / "cache")})})
    (OUT / "run.json").write_text(rc.model_dump_json())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rljob.trainer.compilecheck",
            "--config",
            str(OUT / "run.json"),
            "--cache-dir",
            str(OUT / "local"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    (OUT / "compilecheck.log").write_text(proc.stderr)  # with JAX_DEBUG_LOG_MODULES: the cache key's parts
    sys.stderr.write(proc.stderr[-3000:])
    if proc.returncode != 0:
        return proc.returncode
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    (OUT / "compile.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(OUT / "local", ignore_errors=True)
    files = sorted(p.name for p in (store / "cache").rglob("*") if p.is_file())
    print(json.dumps({"cache_files": len(files), "programs": sorted(report["compile"]["programs"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
