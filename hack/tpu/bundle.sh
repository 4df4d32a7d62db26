#!/usr/bin/env bash
# Packs what tests/tpu and bench/*_chip.py import from the dev venv into parts of at most 56 MiB (a call carries 64 MiB with the working tree), for a TPU
# machine that has Python 3.12 but no network (`make tpu-bundle`; hack/tpu/README.md says how to run the
# tests there). The distributions are those a Python run of hack/tpu/imports.py imports here (the trainer,
# MaxText, qwix, tokamax, JAX with libtpu, orbax), plus pytest and hypothesis; the project's own packages go
# in as `rljob.<folder>` (pyproject's package-dir), as the editable install maps them.
#   hack/tpu/bundle.sh [OUTDIR]        (default .tpu-bundle; ignored through .git/info/exclude)
# Writes OUTDIR/part.NN, OUTDIR/setup.sh (sourced on the TPU machine: unpacks once into /tmp/rljob-site and
# sets PYTHONPATH, PY312) and OUTDIR/dists.txt (name==version of each distribution packed).
set -euo pipefail
out=${1:-.tpu-bundle}
py=.venv/bin/python
[[ -x $py ]] || { echo "no $py: run make venv first" >&2; exit 2; }
export PYTHONSAFEPATH=1 JAX_PLATFORMS=cpu
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
"$py" -X importtime hack/tpu/imports.py >/dev/null 2>"$work/importtime" || { tail -20 "$work/importtime" >&2; exit 1; }
"$py" - "$work" <<'PY'
import importlib.metadata as md, os, re, sys, sysconfig
work = sys.argv[1]
site = sysconfig.get_paths()["purelib"]
top = {m.group(1).split(".")[0] for m in re.finditer(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", open(f"{work}/importtime").read())}
owners = md.packages_distributions()
from packaging.requirements import Requirement
dists = {d for m in top for d in owners.get(m, []) if d != "rljob"} | {"pytest", "hypothesis"}
# With what each one requires (installed, extras left out): some check their requirements' metadata at import
# (transformers reads safetensors' version), which an import trace alone does not show. A requirement nothing
# imported that weighs more than 16 MB (pyarrow, llvmlite, duckdb: what the data loaders of MaxText's and
# tunix's requirements bring) stays out: a check of its metadata would fail, and the tier's import says so.
def size(name):
    dist = md.distribution(name)
    return sum(os.path.getsize(p) for f in dist.files or [] if os.path.isfile(p := os.path.join(site, str(f))))

todo = list(dists)
while todo:
    for line in md.distribution(todo.pop()).requires or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            name = md.distribution(req.name).metadata["Name"]
        except md.PackageNotFoundError:
            continue
        if name not in dists and size(name) <= 16_000_000:
            dists.add(name)
            todo.append(name)
files = set()
with open(f"{work}/dists", "w") as listing:
    for name in sorted(dists, key=str.lower):
        dist = md.distribution(name)
        listing.write(f"{dist.metadata['Name']}=={dist.version}\n")
        for f in dist.files or []:
            p = os.path.normpath(os.path.join(site, str(f)))
            if p.startswith(site + os.sep) and "__pycache__" not in p and os.path.isfile(p):
                files.add(os.path.relpath(p, site))
open(f"{work}/files", "w").write("\n".join(sorted(files)) + "\n")
print(f"{len(dists)} distributions, {len(files)} files", file=sys.stderr)
PY
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$work/rljob-site/rljob"
(cd "$site" && tar cf - -T "$work/files") | (cd "$work/rljob-site" && tar xf -)
for d in $("$py" -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml","rb"))["tool"]["setuptools"]["package-dir"].values()))'); do
  cp -r "$d" "$work/rljob-site/rljob/$d"
done
find "$work/rljob-site" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$out"; mkdir -p "$out"
cp "$work/dists" "$out/dists.txt"
(cd "$work" && tar cf - rljob-site | zstd -q -T2 -9 --long=27) | split -b 58720256 -d - "$out/part."
cat > "$out/setup.sh" <<'SH'
# Sourced on the TPU machine once every part is in /tmp/tpu-parts: unpacks once, then sets the environment.
if [[ ! -d /tmp/rljob-site ]]; then cat /tmp/tpu-parts/part.* | zstd -q -d --long=27 | tar xf - -C /tmp; fi
# The project's own packages from the working tree sourcing this (the bundle's copy is as old as the
# bundle): each rljob.<folder> links to ./<folder> (the top-level folders with an __init__.py).
mkdir -p /tmp/rljob-site/rljob
for f in */__init__.py; do
  f=${f%/__init__.py}; p=/tmp/rljob-site/rljob/$f
  if [[ ! -L $p ]]; then rm -rf "$p"; ln -s "$PWD/$f" "$p"; fi
done
export PYTHONPATH=/tmp/rljob-site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 JAX_PLATFORMS=tpu,cpu
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
SH
ls -la "$out"
