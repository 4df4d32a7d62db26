# syntax=docker/dockerfile:1.7
#
# rljob images, one Dockerfile, three targets:
#
#   docker build --target operator -t IMAGE/rljob-operator:VERSION .   # kopf operator, no JAX
#   docker build --target trainer  -t IMAGE/rljob-trainer:VERSION  .   # MaxText + qwix on jax[tpu]
#   docker build --target sampler  -t IMAGE/rljob-sampler:VERSION  .   # vLLM's TPU build (vllm-tpu)
#
# VERSION is `version` in pyproject.toml (the Helm chart's appVersion and image tag follow it).
# Every Python version pin lives in pyproject.toml (extras operator / trainer + tpu / sampler + sampler-tpu):
# this file names extras only, never a package version. `make images-rehearse` (hack/rehearse_images.py)
# resolves each target's install command below, verbatim, with `uv pip compile` for this base image's
# platform, installs the result into a virtual environment and runs the entrypoint's smoke test in it;
# tests/images/ checks what the commands resolve (e.g. no jax in the operator image).

# Base images pinned by full version. uv matches UV_VERSION in the Makefile (tests/images/ checks it).
ARG PYTHON_IMAGE=python:3.12.12-slim-trixie
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.9.7

FROM ${UV_IMAGE} AS uv

# ---------------------------------------------------------------------------------------------------------
# Build stages: one virtual environment per image at /opt/rljob, built from the source tree.
FROM ${PYTHON_IMAGE} AS build
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    VIRTUAL_ENV=/opt/rljob
RUN uv venv --python /usr/local/bin/python3 /opt/rljob
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cli/ cli/
COPY recipes/ recipes/
COPY operator/ operator/
COPY trainer/ trainer/
COPY sampler/ sampler/
COPY common/ common/
COPY local/ local/

FROM build AS build-operator
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install ".[operator]"

# The trainer: MaxText as a model library (models, config, checkpointing, sharding) with qwix LoRA, on
# jax[tpu] at the jax the CPU tests run. Not MaxText's post-training install (maxtext[tpu-post-train]
# --resolution=lowest, then install_tpu_post_train_extra_deps): that set exists for MaxText's own
# trainers, which roll out with vLLM inside the training process (it adds torch from the PyTorch CPU
# index, ray, the vLLM runtime and Jupyter to maxtext[tpu], and the extra-deps step builds vLLM from a
# git commit). rljob's rollouts run in the sampler image; the trainer imports none of that (its smoke
# test in `make images-rehearse` lists what it imports). docs/gke.md, section 5.
FROM build AS build-trainer
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install ".[trainer,tpu]"

# The sampler: vllm-tpu with the CPU build of torch, installed as vLLM's TPU Dockerfile installs it
# (pip install --extra-index-url https://download.pytorch.org/whl/cpu: the best version of each package
# over PyPI and the PyTorch CPU index, which is what uv's unsafe-best-match does). From PyPI alone, torch
# comes with the CUDA libraries (nvidia-*), which a TPU host never loads.
FROM build AS build-sampler
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install --extra-index-url=https://download.pytorch.org/whl/cpu --index-strategy=unsafe-best-match \
    ".[sampler,sampler-tpu]"

# ---------------------------------------------------------------------------------------------------------
# Runtime base: the same Python image with the venv on PATH. The venv is owned by root, world-readable.
FROM ${PYTHON_IMAGE} AS runtime
ENV PATH=/opt/rljob/bin:${PATH} \
    VIRTUAL_ENV=/opt/rljob \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1

# The operator talks only to the API server: non-root, no capabilities (the chart's securityContext adds
# runAsNonRoot, readOnlyRootFilesystem and drops ALL capabilities).
FROM runtime AS operator
RUN groupadd --gid 1000 rljob \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/rljob --shell /usr/sbin/nologin rljob
ENV HOME=/home/rljob
WORKDIR /home/rljob
COPY --from=build-operator /opt/rljob /opt/rljob
USER 1000:1000
ENTRYPOINT ["rljob-operator"]

# TPU images run as root (uid 0), not privileged, as Google's TPU manifests run them: every one found
# runs as root (the images of AI-Hypercomputer/tpu-recipes' Ironwood vLLM servers and microbenchmarks have
# no USER and no securityContext, or privileged: false; xpk and the Ironwood MaxText training recipes add
# privileged: true), none as another user; the unprivileged ones show the TPU needs no privileged mode.
# GKE's TPU device plugin gives the container the TPU device nodes; they keep the node's ownership, so a
# non-root uid depends on their mode, which nothing documents. docs/gke.md, section 5.
FROM runtime AS trainer
COPY --from=build-trainer /opt/rljob /opt/rljob
ENV HOME=/root
WORKDIR /root
# hadolint ignore=DL3002
USER 0:0
ENTRYPOINT ["rljob-trainer"]

# The sampler adds what vLLM's TPU Dockerfile installs from Debian for vLLM (docker/Dockerfile.pypi of
# vllm-project/tpu-inference: libopenmpi-dev, libomp-dev, build-essential). Debian versions are not
# pinned: the base image's tag fixes the release, and a stable release keeps one version of a package,
# so a pinned version fails the build at the next point release.
FROM runtime AS sampler
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential libomp-dev libopenmpi-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build-sampler /opt/rljob /opt/rljob
ENV HOME=/root
WORKDIR /root
# hadolint ignore=DL3002
USER 0:0
EXPOSE 8000
ENTRYPOINT ["rljob-sampler"]
