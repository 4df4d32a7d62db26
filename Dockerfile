# syntax=docker/dockerfile:1.7
#
# rljob images, one Dockerfile, three targets:
#
#   docker build --target operator -t IMAGE/rljob-operator:VERSION .   # kopf operator, no JAX
#   docker build --target trainer  -t IMAGE/rljob-trainer:VERSION  .   # MaxText + tunix + qwix, jax[tpu]
#   docker build --target sampler  -t IMAGE/rljob-sampler:VERSION  .   # vLLM's TPU build (vllm-tpu)
#
# VERSION is `version` in pyproject.toml (the Helm chart's appVersion and image tag follow it).
# Every Python version pin lives in pyproject.toml (extras operator / trainer + tpu / sampler + sampler-tpu):
# this file names extras only, never a package version. tests/images/ runs each target's install command
# below with `--dry-run` and checks what it resolves (e.g. no jax in the operator image).

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

FROM build AS build-operator
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install ".[operator]"

FROM build AS build-trainer
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install ".[trainer,tpu]"

FROM build AS build-sampler
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install ".[sampler,sampler-tpu]"

# ---------------------------------------------------------------------------------------------------------
# Runtime base: the same Python image, the venv copied in, a non-root user. The venv is owned by root and
# world-readable, so the image also works when a pod runs it as root.
FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 1000 rljob \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/rljob --shell /usr/sbin/nologin rljob
ENV PATH=/opt/rljob/bin:${PATH} \
    VIRTUAL_ENV=/opt/rljob \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1 \
    HOME=/home/rljob
WORKDIR /home/rljob

# The operator talks only to the API server: non-root, no capabilities (the chart's securityContext adds
# runAsNonRoot, readOnlyRootFilesystem and drops ALL capabilities).
FROM runtime AS operator
COPY --from=build-operator /opt/rljob /opt/rljob
USER 1000:1000
ENTRYPOINT ["rljob-operator"]

# TPU images. They run as uid 1000 by default. TPU access on GKE: the TPU device plugin hands the pod the
# TPU device nodes when it requests `google.com/tpu`; GKE's TPU docs keep `securityContext.privileged: true`
# only for GKE versions before 1.28, so on current GKE (TPU7x needs >= 1.34) neither privileged mode nor
# root is required by GKE itself. Whether uid 1000 can open the device nodes (/dev/vfio/*, /dev/accel*)
# depends on their ownership on the node (Kubernetes only maps them with the container's uid when the
# runtime sets device_ownership_from_security_context). If libtpu reports a permission error opening the
# TPU, run the pod with `securityContext.runAsUser: 0` (the image works as root unchanged); xpk's
# workloads run privileged, which also works. docs/gke.md says the same.
FROM runtime AS trainer
COPY --from=build-trainer /opt/rljob /opt/rljob
USER 1000:1000
ENTRYPOINT ["rljob-trainer"]

FROM runtime AS sampler
COPY --from=build-sampler /opt/rljob /opt/rljob
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["rljob-sampler"]
