# A worker: torch (CUDA 13.0), Triton, NIXL, Ray and the RDMA user-space libraries; non-root,
# `baton` as the entrypoint. Built from the repository root:
#   docker build -f docker/worker.Dockerfile -t baton-worker:0.1.0 .
# The same base as the slim image, on development's Python (3.11). No CUDA base image: torch's
# cu130 wheels bring the CUDA libraries as nvidia-* packages (runtime, cuBLAS, cuDNN, cuFFT,
# cuFile, NCCL, NVRTC, nvJitLink, ...) and find them through their RPATH; the driver's
# libcuda.so.1 and libnvidia-ml.so.1 come from the host through the NVIDIA container runtime.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

# torch==2.13.0 on PyPI is this same build (2.13.0+cu130) for Linux x86_64:
# --build-arg TORCH_INDEX=https://pypi.org/simple builds without PyTorch's index
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
# NVIDIA_*: what the NVIDIA container runtime reads, as NVIDIA's images set it (the device
# plugin narrows the devices to those allocated). compute: libcuda.so.1; utility:
# libnvidia-ml.so.1 and nvidia-smi (UCX's CUDA transports need both).
# No LD_LIBRARY_PATH: NIXL's GDS plugin and UCX's CUDA module need libcudart.so.13 and
# libcufile.so.0 with no path to torch's copies, but a worker imports torch, which loads them,
# before it makes a NIXL agent, and the loader takes a library already loaded by its soname.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/baton \
    PATH=/opt/baton/bin:$PATH \
    HOME=/tmp \
    TRITON_CACHE_DIR=/tmp/triton \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# gcc, libc6-dev: Triton compiles its kernel launcher at first use (Python.h is in the image).
# RDMA (Debian's rdma-core 44 libraries, not its daemons): NIXL's UCX brings its own libibverbs
# and mlx5 provider (InfiniBand, RoCE on ConnectX); its EFA transport (srd) loads libefa.so.1
# from ibverbs-providers; librdmacm1 is RDMA's connection manager; ibverbs-utils has
# ibv_devinfo, for `baton transports` and by hand. No libfabric1: Baton's NIXL agents use the
# UCX backend only (NIXL's LIBFABRIC plugin would need libhwloc15 too).
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends gcc libc6-dev \
       libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/baton
RUN pip install --index-url ${TORCH_INDEX} torch==2.13.0

COPY pyproject.toml README.md /src/
COPY baton /src/baton
COPY shared /src/shared
COPY services /src/services
# Baton with its pinned dependencies (torch is there already) and Ray (a tensor-parallel engine
# over several pods runs Ray across them); NIXL with --no-deps, as `make install` does (its
# metadata would pull another torch)
RUN pip install "/src[ray]" && pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 && rm -rf /src

RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin baton
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["baton"]
CMD ["--help"]
