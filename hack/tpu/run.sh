#!/usr/bin/env bash
# The chip tier on a TPU machine, from the repo root, once the bundle's parts are in /tmp/tpu-parts
# (hack/tpu/README.md). Figures go to $OUT/figures.jsonl (JSON lines), pytest's log to $OUT/pytest.log.
#   hack/tpu/run.sh [pytest -k expression]
# The GRPO steps run one family per process: the chip's peak-memory counter only grows within a process.
set -uo pipefail
if [[ -f .tpu-bundle/setup.sh ]]; then
  source .tpu-bundle/setup.sh  # a machine without network: the bundle's packages (make tpu-bundle)
else
  export PYTHONSAFEPATH=1 JAX_PLATFORMS=tpu,cpu PY312=.venv/bin/python  # a TPU VM with make venv done
fi
out=${OUT:-/tmp/rljob-tpu}; mkdir -p "$out"
export RLJOB_TPU_FIGURES=$out/figures.jsonl
k=${1:-}
rc=0
run() { "$PY312" -m pytest -q -p no:cacheprovider -o addopts="" --import-mode=importlib -rA "$@" 2>&1 | tee -a "$out/pytest.log" | tail -25; return "${PIPESTATUS[0]}"; }
# JAX's persistent cache off, except for the test of it: MaxText turns on its own (~/jax_cache) whenever it
# builds a config, and on a v5e a Splash program read back from it aborted the process (docs/drill.md,
# "Starting without compiling"; the trainer guards its loads, rljob.common.caches.LoadGuard).
export JAX_ENABLE_COMPILATION_CACHE=false
run tests/tpu --deselect tests/tpu/test_grpo_chip.py --deselect tests/tpu/test_vllm_chip.py \
  --deselect tests/tpu/test_example_chip.py ${k:+-k "$k"} || rc=1
if [[ -z $k || $k == example ]]; then JAX_ENABLE_COMPILATION_CACHE=true run tests/tpu/test_example_chip.py || rc=1; fi
for family in $("$PY312" -c 'import sys; sys.path.insert(0, "tests"); from fixtures.chip_models import FAMILIES; print(" ".join(sorted(FAMILIES)))'); do
  if [[ -z $k || $family == *$k* || $k == grpo ]]; then run tests/tpu/test_grpo_chip.py -k "$family" || rc=1; fi
done
# vLLM's engine against the trainer: its own pytest process, which never opens the chip (its three
# subprocesses do, in turn); with the vLLM bundle unpacked (make tpu-vllm-bundle, .tpu-vllm-bundle/setup.sh).
if [[ -f .tpu-vllm-bundle/setup.sh && ( -z $k || $k == vllm ) ]]; then
  source .tpu-vllm-bundle/setup.sh
  run tests/tpu/test_vllm_chip.py || rc=1
fi
exit $rc
