# A worker: CUDA, torch, Triton and NIXL; non-root, `baton` as the entrypoint. Built from the
# repository root:
#   docker build -f docker/worker.Dockerfile -t baton-worker:0.1.0 .
# The CUDA 13 runtime matches nixl-cu13; torch is the CUDA 13.0 build of the version pyproject
# pins (the CPU build lies on disk for development machines).
ARG BASE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/baton \
    PATH=/opt/baton/bin:$PATH \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton

RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/baton
RUN pip install --index-url ${TORCH_INDEX} torch==2.13.0

COPY pyproject.toml README.md /src/
COPY baton /src/baton
COPY shared /src/shared
COPY services /src/services
# Baton and its pinned dependencies (torch is there already); NIXL with --no-deps, as
# `make install` does (its metadata would pull another torch)
RUN pip install /src && pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 && rm -rf /src

RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin baton
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["baton"]
CMD ["--help"]
