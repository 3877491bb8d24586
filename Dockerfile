# syntax=docker/dockerfile:1
# Multi-stage: dependencies are installed from the pinned requirements.lock into a virtualenv in
# the build stage; the final stage is slim Python with only that virtualenv, no compilers or pip
# caches, running as a fixed non-root UID.
#
# BASE: any Debian-like image with Python 3.11 and its venv module. The default is pulled from a
# registry; without one, `otel-dra testbed image` builds a local base from Debian packages
# (debootstrap, python3 + python3-venv: Python 3.11 at /usr/bin) and passes it here. Nothing below
# names the interpreter's path (python:3.11-slim has it in /usr/local/bin): `python3 -m venv` finds
# it on PATH and the virtualenv links to it, the same in both stages.
ARG BASE=python:3.11-slim-bookworm

FROM ${BASE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python3 -m venv /opt/otel-dra
# A name for UID 65532 (copied into the final stage): the kubelet hands the runtime only the UID of
# the image's USER (its group part is dropped unless the pod sets runAsGroup), and the runtime takes
# the group from /etc/passwd; without an entry the process would run as 65532 with GID 0 (seen on a
# real kubelet 1.37 with containerd 2.4).
RUN groupadd --system --gid 65532 nonroot \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin nonroot
COPY requirements.lock pyproject.toml README.md ./
COPY otel_dra ./otel_dra
# Only runtime dependencies (no [dev] extras); the lock file pins every version.
RUN /opt/otel-dra/bin/pip install -c requirements.lock . \
    && /opt/otel-dra/bin/pip check

FROM ${BASE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="otel-dra" \
      org.opencontainers.image.description="OpenTelemetry-native observability for Kubernetes Dynamic Resource Allocation" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/otel-dra/otel-dra"
COPY --from=build /opt/otel-dra /opt/otel-dra
COPY --from=build /etc/passwd /etc/group /etc/
ENV PATH=/opt/otel-dra/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# 65532: the conventional "nonroot" UID; no home, no shell login.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["otel-dra"]
CMD ["exporter"]
