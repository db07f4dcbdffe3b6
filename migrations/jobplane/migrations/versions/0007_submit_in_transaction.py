"""Submit a job inside the caller's own transaction: ``jobplane.submit_job``.

- ``job_routes``: the topology's routes (queue, binding pattern, the queue's
  default max_attempts and attempt timeout), in the topology's order, so SQL
  can route a job type as ``Topology.route`` does. ``jobplane migrate``,
  ``jobplane topology apply`` and every server start keep it in step with the
  topology file (``jobplane.store.routes``).
- ``submit_settings``: one row, the payload limit the servers enforce.
- Schema ``jobplane``: the SQL API other services call, functions only (the
  tables stay where they are). ``jobplane.submit_job(...)`` writes the job,
  its first event and its outbox row in the caller's transaction, with the
  validation, idempotency and tenant rules of the SubmitJob RPC, and wakes
  the relays with the NOTIFY the RPC sends (delivered at commit only).
  It runs as its owner (SECURITY DEFINER): a caller needs EXECUTE on it and
  USAGE on the schema, and no right on any table. Nobody has EXECUTE until
  granted.

Errors carry SQLSTATEs of class ``JP`` and a message that starts with the
reason the RPC gives (docs/adr/0012-enqueue-in-the-callers-transaction.md).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import text

from jobplane.migrations.frozen import frozen_sql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_TABLES = """
CREATE TABLE IF NOT EXISTS job_routes (
    rank            integer PRIMARY KEY,
    queue           text NOT NULL,
    pattern         text NOT NULL,
    -- the pattern as a regular expression over '.' || job type
    regex           text NOT NULL,
    max_attempts    integer NOT NULL CHECK (max_attempts >= 1),
    timeout_seconds double precision NOT NULL CHECK (timeout_seconds > 0)
);
CREATE TABLE IF NOT EXISTS submit_settings (
    singleton         boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    max_payload_bytes integer NOT NULL CHECK (max_payload_bytes > 0),
    update_time       timestamptz NOT NULL DEFAULT now()
);
INSERT INTO submit_settings (max_payload_bytes) VALUES (262144) ON CONFLICT DO NOTHING;
CREATE SCHEMA IF NOT EXISTS jobplane
"""

_SIGNATURE = "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision)"

# The payload's size as the RPC measures it: its compact JSON, as Python
# writes it after the trip through a protobuf Struct. Strings, keys and
# literals are written as jsonb writes them. Numbers are doubles on the wire,
# which Python writes as an integer when whole and within 2^53, otherwise in
# the shortest form that reads back, with an exponent below 1e-4 and from
# 1e16 on. The shortest digits are those of the number as stored when it came
# from such a form (or float8's shortest output, whichever is shorter: that
# output is not always the shortest). A number outside a double's range
# counts as stored. (../sql/0007_number_length.sql, 0007_payload_size.sql)
_NUMBER_LENGTH = "0007_number_length.sql"
_PAYLOAD_SIZE = "0007_payload_size.sql"
_SUBMIT_JOB = "0007_submit_job.sql"


def upgrade() -> None:
    for statement in filter(str.strip, _TABLES.split(";\n")):
        op.execute(statement)
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(frozen_sql(_NUMBER_LENGTH))
    op.execute(frozen_sql(_PAYLOAD_SIZE))
    op.execute(frozen_sql(_SUBMIT_JOB, schema))
    # Functions are executable by PUBLIC by default; this one writes jobs
    # for any tenant, so only roles granted it may call it.
    op.execute(f"REVOKE ALL ON FUNCTION {_SIGNATURE} FROM PUBLIC")


def downgrade() -> None:
    op.execute(f"DROP FUNCTION IF EXISTS {_SIGNATURE}")
    op.execute("DROP FUNCTION IF EXISTS jobplane.payload_size(jsonb)")
    op.execute("DROP FUNCTION IF EXISTS jobplane.number_length(text)")
    op.execute("DROP SCHEMA IF EXISTS jobplane")
    op.execute("DROP TABLE IF EXISTS submit_settings")
    op.execute("DROP TABLE IF EXISTS job_routes")
