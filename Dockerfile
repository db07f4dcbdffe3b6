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
# Each folder above holds one part of the jobplane package; pyproject.toml
# maps them into one package tree (ADR-0038).
# The server install (ADR-0026), with the ingest extra (qdrant-client, pypdf)
# for the ingestion workers.
RUN pip install --no-cache-dir '.[server,ingest]' && useradd --system jobplane
USER jobplane
ENTRYPOINT ["jobplane"]
CMD ["serve"]
