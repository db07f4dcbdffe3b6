# jobplane: one image for every process (serve, relay, worker, migrate).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY proto ./proto
COPY core ./core
COPY contrib ./contrib
COPY server ./server
COPY workers ./workers
COPY client ./client
COPY migrations ./migrations
# core/jobplane/{server,workers,client,migrations} are symlinks into the
# top-level folders copied above, so the build sees one package tree.
# The server install (ADR-0026), with the ingest extra (qdrant-client, pypdf)
# for the ingestion workers.
RUN pip install --no-cache-dir '.[server,ingest]' && useradd --system jobplane
USER jobplane
ENTRYPOINT ["jobplane"]
CMD ["serve"]
