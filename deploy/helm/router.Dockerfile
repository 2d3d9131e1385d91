# vllm-router (the vLLM project's Rust router, from its PyPI wheel) for the chart's router.enabled:
#   docker build -f deploy/helm/router.Dockerfile -t servelm-router:0.1.17 deploy/helm
# The project publishes no image of its own; the version matches the one the router tests use.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
FROM ${PYTHON_IMAGE}
ARG VLLM_ROUTER_VERSION=0.1.17
# The package index pip uses (unset: PyPI), as in the repository's Dockerfile: build arguments only.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CERT
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir "vllm-router==${VLLM_ROUTER_VERSION}" \
    && groupadd --gid 10001 router \
    && useradd --no-create-home --uid 10001 --gid 10001 router
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080 29000
ENTRYPOINT ["vllm-router"]
