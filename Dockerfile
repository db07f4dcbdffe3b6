# syntax=docker/dockerfile:1
# jobplane: one image for every process (serve, relay, worker, sweep, migrate).
# deploy/kubernetes runs it with a read-only root filesystem as UID 10001;
# tests/unit/test_dockerfile.py holds this file to that (ADR-0050).

# -- Build: jobplane's wheel, and a wheel of every dependency at the versions
# CI ran (requirements/dev-constraints.txt pins the dev extra, a superset of
# server and ingest). Anything a build needs stays in this stage.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY requirements ./requirements
COPY proto ./proto
COPY core ./core
COPY contrib ./contrib
COPY server ./server
COPY workers ./workers
COPY client ./client
COPY migrations ./migrations
# Each folder above holds one part of the jobplane package; pyproject.toml
# maps them into one package tree (ADR-0038). The server install (ADR-0026),
# with the ingest extra (qdrant-client, pypdf) for the ingestion workers.
RUN pip wheel --no-cache-dir --wheel-dir /wheels \
      --constraint requirements/dev-constraints.txt '.[server,ingest]'

# -- Run: the wheels installed offline, no compiler, no source tree.
FROM python:3.11-slim-bookworm
# tini as PID 1 passes SIGTERM on to jobplane and reaps what handlers spawn:
# a process that is PID 1 ignores a signal it has no handler for.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
# A numeric user, so Kubernetes' runAsNonRoot can check it without a passwd lookup.
RUN groupadd --system --gid 10001 jobplane \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin jobplane
# Bound from the build stage, not copied: no layer keeps the wheels.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels 'jobplane[server,ingest]'
# The one directory a process may write besides /tmp: local-mode Qdrant's
# collections (JOBPLANE_DATA_DIR, docs/ingestion.md). Kubernetes mounts an
# emptyDir on each. Nothing writes bytecode next to the read-only
# site-packages (pip compiled it at install); logs leave at once.
RUN mkdir -p /var/lib/jobplane && chown 10001:10001 /var/lib/jobplane
ENV JOBPLANE_DATA_DIR=/var/lib/jobplane \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /var/lib/jobplane
USER 10001:10001
ENTRYPOINT ["tini", "--", "jobplane"]
CMD ["serve"]
