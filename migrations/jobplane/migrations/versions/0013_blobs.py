"""Blobs: content-addressed objects of a tenant, and the jobs that reference them.

- ``blobs``: one row per (tenant, sha256) whose object is in object storage
  (``{prefix}tenants/{tenant}/blobs/{sha256}``). A row is written only after
  its object is complete, so a row always has an object. ``touched_at`` is
  the last upload of the same bytes: collection of unreferenced blobs goes by
  it, so a blob just uploaded again is not collected under its uploader.
- ``job_blobs``: a job's references (role ``payload``, ``input``, ``result``,
  ``output``); deleted with the job, and a blob cannot be deleted while one
  exists (the foreign key).
- ``jobs.payload_blob`` / ``jobs.result_blob`` (and their ``_size``): the
  digest and size of an offloaded payload or result (its column then holds
  ``{}``).
- A trigger records a job's references whoever inserts it: the server's
  submit and ``jobplane.submit_job`` alike. Every string of the payload that
  is a blob name is an ``input``, the offloaded payload a ``payload``, the
  offloaded result a ``result``; a name the tenant has no blob of fails the
  insert (foreign key violation), so a job never references a foreign blob.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_UPGRADE = r"""
CREATE TABLE blobs (
    tenant_id    uuid NOT NULL REFERENCES tenants (id),
    digest       text NOT NULL CHECK (digest ~ '^[0-9a-f]{64}$'),
    size         bigint NOT NULL CHECK (size >= 0),
    content_type text NOT NULL DEFAULT '',
    created_at   timestamptz NOT NULL DEFAULT now(),
    touched_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, digest)
);
CREATE INDEX blobs_tenant_touched ON blobs (tenant_id, touched_at);

CREATE TABLE job_blobs (
    tenant_id uuid NOT NULL,
    job_id    uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    digest    text NOT NULL,
    role      text NOT NULL CHECK (role IN ('payload', 'input', 'result', 'output')),
    PRIMARY KEY (job_id, role, digest),
    FOREIGN KEY (tenant_id, digest) REFERENCES blobs (tenant_id, digest)
);
CREATE INDEX job_blobs_blob ON job_blobs (tenant_id, digest);

-- The checks are added NOT VALID: the new columns are NULL in every existing
-- row, so validating them would only scan the whole jobs table under the
-- ALTER's lock; new and updated rows are checked all the same.
ALTER TABLE jobs ADD COLUMN payload_blob text,
                 ADD COLUMN payload_blob_size bigint,
                 ADD COLUMN result_blob text,
                 ADD COLUMN result_blob_size bigint;
ALTER TABLE jobs ADD CONSTRAINT jobs_payload_blob_check
                 CHECK (payload_blob ~ '^[0-9a-f]{64}$') NOT VALID,
                 ADD CONSTRAINT jobs_result_blob_check
                 CHECK (result_blob ~ '^[0-9a-f]{64}$') NOT VALID;

CREATE FUNCTION jobplane.record_job_blobs() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO job_blobs (tenant_id, job_id, digest, role)
        SELECT DISTINCT NEW.tenant_id, NEW.id, substr(n #>> '{}', 7), 'input'
        FROM jsonb_path_query(
            NEW.payload,
            'strict $.** ? (@.type() == "string" && @ like_regex "^blobs/[0-9a-f]{64}$")'
        ) AS n
        ON CONFLICT DO NOTHING;
        IF NEW.payload_blob IS NOT NULL THEN
            INSERT INTO job_blobs (tenant_id, job_id, digest, role)
            VALUES (NEW.tenant_id, NEW.id, NEW.payload_blob, 'payload')
            ON CONFLICT DO NOTHING;
        END IF;
    END IF;
    IF NEW.result_blob IS NOT NULL
       AND (TG_OP = 'INSERT' OR OLD.result_blob IS DISTINCT FROM NEW.result_blob) THEN
        INSERT INTO job_blobs (tenant_id, job_id, digest, role)
        VALUES (NEW.tenant_id, NEW.id, NEW.result_blob, 'result')
        ON CONFLICT DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;

-- Only when there can be anything to record: a payload without "blobs/" in
-- it (jsonb's text has every string whole) costs no path query.
CREATE TRIGGER jobs_record_blobs_insert AFTER INSERT ON jobs
FOR EACH ROW WHEN (NEW.payload_blob IS NOT NULL OR NEW.result_blob IS NOT NULL
                   OR strpos(NEW.payload::text, 'blobs/') > 0)
EXECUTE FUNCTION jobplane.record_job_blobs();

CREATE TRIGGER jobs_record_blobs_update AFTER UPDATE OF result_blob ON jobs
FOR EACH ROW WHEN (NEW.result_blob IS NOT NULL
                   AND OLD.result_blob IS DISTINCT FROM NEW.result_blob)
EXECUTE FUNCTION jobplane.record_job_blobs();
"""

_DOWNGRADE = """
DROP TRIGGER jobs_record_blobs_update ON jobs;
DROP TRIGGER jobs_record_blobs_insert ON jobs;
DROP FUNCTION jobplane.record_job_blobs();
ALTER TABLE jobs DROP COLUMN result_blob_size;
ALTER TABLE jobs DROP COLUMN result_blob;
ALTER TABLE jobs DROP COLUMN payload_blob_size;
ALTER TABLE jobs DROP COLUMN payload_blob;
DROP TABLE job_blobs;
DROP TABLE blobs;
"""


def _statements(sql: str) -> list[str]:
    """The script's statements: split at a ``;`` ending a line, outside ``$$`` bodies."""
    statements, current, in_body = [], [], False
    for line in sql.splitlines():
        current.append(line)
        in_body ^= line.count("$$") % 2 == 1
        if line.rstrip().endswith(";") and not in_body:
            statements.append("\n".join(current).strip().rstrip(";"))
            current = []
    return [s for s in statements if s]


def upgrade() -> None:
    for statement in _statements(_UPGRADE):
        op.execute(statement)


def downgrade() -> None:
    for statement in _statements(_DOWNGRADE):
        op.execute(statement)
