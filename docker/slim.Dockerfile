# The gateway and the global scheduler: no torch (neither imports it), non-root, `baton` as
# the entrypoint. Built from the repository root:
#   docker build -f docker/slim.Dockerfile -t baton:0.1.0 .
# BASE: any Debian-like image with python3 (>= 3.11) and its venv module.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/baton \
    PATH=/opt/baton/bin:$PATH

RUN python3 -m venv /opt/baton
COPY docker/requirements-slim.txt /tmp/requirements-slim.txt
RUN pip install -r /tmp/requirements-slim.txt && rm /tmp/requirements-slim.txt

# Baton itself, without its dependencies (they would pull torch)
COPY pyproject.toml README.md /src/
COPY baton /src/baton
COPY shared /src/shared
COPY services /src/services
RUN pip install --no-deps /src && rm -rf /src

RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin baton
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["baton"]
CMD ["--help"]
