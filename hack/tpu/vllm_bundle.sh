#!/usr/bin/env bash
# Packs vLLM's TPU engine (vllm-tpu and tpu-inference, the sampler image's pins: hack/tpu/vllm-requirements.txt)
# for a TPU machine with Python 3.12 and no network (`make tpu-vllm-bundle`), beside the trainer's bundle
# (hack/tpu/bundle.sh): another JAX (tpu-inference pins jax 0.11.2, libtpu 0.0.48), so another process.
# PyPI's torch is the CUDA build; NVIDIA's libraries (4.4 GB) stay out and hack/tpu/cuda_stubs.py stands in for
# them. Distributions of 16 MB or more that the engine's import (hack/tpu/vllm_imports.py) does not load stay
# out too (pyarrow, duckdb, cmake, ...).
#   hack/tpu/vllm_bundle.sh [OUTDIR]      (default .tpu-vllm-bundle; the install is cached in .tpu-vllm/)
#   hack/tpu/vllm_bundle.sh --lock        (re-compile hack/tpu/vllm-requirements.txt from the .in file)
# Writes OUTDIR/part.NN and OUTDIR/setup.sh (sourced on the TPU machine once the parts are in
# /tmp/vllm-parts: unpacks into /tmp/vllm-site and sets VLLM_PYTHONPATH).
set -euo pipefail
uv=.venv/bin/uv
[[ -x $uv ]] || { echo "no $uv: run make venv first" >&2; exit 2; }
export PYTHONSAFEPATH=1
py312=${PYTHON312:-$(.venv/bin/python -c 'import sys; print(sys._base_executable)')}
target=(--python-version 3.12 --python-platform x86_64-manylinux_2_31)
if [[ ${1:-} == --lock ]]; then
  exec "$uv" pip compile hack/tpu/vllm-requirements.in --prerelease=allow "${target[@]}" -o hack/tpu/vllm-requirements.txt
fi
out=${1:-.tpu-vllm-bundle}
for d in "$out" .tpu-vllm; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
site=.tpu-vllm/site
stamp=.tpu-vllm/installed-$(sha1sum hack/tpu/vllm-requirements.txt hack/tpu/cuda_stubs.py | sha1sum | cut -c1-12)
if [[ ! -f $stamp ]]; then
  rm -rf .tpu-vllm; mkdir -p "$site"
  grep -vE '^(nvidia-|triton==|nixl==|cuda-)' hack/tpu/vllm-requirements.txt > .tpu-vllm/requirements.txt
  "$uv" pip install -q --target "$site" "${target[@]}" --no-deps -r .tpu-vllm/requirements.txt
  "$py312" hack/tpu/cuda_stubs.py "$site"
  touch "$stamp"
fi
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/proj/rljob"
for d in $("$py312" -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml","rb"))["tool"]["setuptools"]["package-dir"].values()))'); do
  cp -r "$d" "$work/proj/rljob/$d"
done
find "$work/proj" -name __pycache__ -prune -exec rm -rf {} +
PYTHONPATH="$work/proj:$site" PYTHONSAFEPATH=1 JAX_PLATFORMS=cpu "$py312" -X importtime hack/tpu/vllm_imports.py \
  >/dev/null 2>"$work/importtime" || { grep -v "import time" "$work/importtime" | tail -20 >&2; exit 1; }
PYTHONSAFEPATH=1 "$py312" - "$work" "$site" <<'PY'
import importlib.metadata as md, os, re, sys
work, site = sys.argv[1], os.path.abspath(sys.argv[2])
top = {m.group(1).split(".")[0] for m in re.finditer(r"import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", open(f"{work}/importtime").read())}
dists = list(md.distributions(path=[site]))
owners = {}
for d in dists:
    for f in d.files or []:
        owners.setdefault(str(f).split("/")[0].removesuffix(".py"), set()).add(d.metadata["Name"])
def size(d):
    return sum(os.path.getsize(p) for f in d.files or [] if os.path.isfile(p := os.path.join(site, str(f))))
imported = {n for m in top for n in owners.get(m, ())}
keep, left = [], []
for d in dists:
    name = d.metadata["Name"]
    (keep if name in imported or size(d) < 16_000_000 else left).append(d)
files = set()
for d in keep:
    for f in d.files or []:
        p = os.path.normpath(os.path.join(site, str(f)))
        if p.startswith(site + os.sep) and "__pycache__" not in p and os.path.isfile(p):
            files.add(os.path.relpath(p, site))
# The stubs cuda_stubs.py wrote belong to no distribution's RECORD.
for root, _, names in os.walk(site):
    for n in names:
        if re.match(r"lib(cu|nccl|nv).*\.so", n):
            files.add(os.path.relpath(os.path.join(root, n), site))
open(f"{work}/files", "w").write("\n".join(sorted(files)) + "\n")
print(f"{len(keep)} distributions packed, left out: {sorted(d.metadata['Name'] for d in left)}", file=sys.stderr)
PY
mkdir -p "$work/vllm-site"
(cd "$site" && tar cf - -T "$work/files") | (cd "$work/vllm-site" && tar xf -)
rm -rf "$out"; mkdir -p "$out"
(cd "$work" && tar cf - vllm-site | zstd -q -T2 -6 --long=27) | split -b 58720256 -d - "$out/part."
cat > "$out/setup.sh" <<'SH'
# Sourced on the TPU machine once every part is in /tmp/vllm-parts: unpacks once, then sets the environment.
if [[ ! -d /tmp/vllm-site ]]; then cat /tmp/vllm-parts/part.* | zstd -q -d --long=27 | tar xf - -C /tmp; fi
# rljob's packages from the working tree sourcing this (rljob.<folder> -> ./<folder>), after the engine's.
# The bundle carries no copy of rljob (it traced the imports with one): a bundle packed before did, and
# that copy shadowed these links (a regular package on any path entry wins over a namespace portion; seen on
# the chip, an import of a newer name failed), hence the removal.
rm -rf /tmp/vllm-site/rljob
mkdir -p /tmp/rljob-tree/rljob
for f in */__init__.py; do ln -sfn "$PWD/${f%/__init__.py}" "/tmp/rljob-tree/rljob/${f%/__init__.py}"; done
export VLLM_PYTHONPATH=/tmp/vllm-site:/tmp/rljob-tree
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}
SH
ls -la "$out"
