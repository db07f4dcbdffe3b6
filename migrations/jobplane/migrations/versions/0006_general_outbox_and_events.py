"""A general outbox, and the events table with a commit-ordered cursor.

- ``outbox.kind``: what a row stands for. ``job.dispatch`` (every row so
  far, and the default, so every writer of dispatches works unchanged) or
  ``event`` (a domain event, published to the events exchange).
- ``outbox.exchange``: where to publish; NULL means the kind's exchange in
  the topology file (the jobs exchange, the events exchange).
- ``outbox.body``: the message body as it is published; NULL for job
  dispatches, whose envelope the relay builds from the row.
- ``outbox.headers``: correlation id, causation id and W3C trace context of
  the message (``{}`` for job dispatches).
- ``outbox.job_id`` is NULL for rows that are not job dispatches; the CHECK
  ``outbox_kind_shape`` holds each kind to the columns it needs.
- ``events``: one row per domain event, unique per (tenant, event_id).
  ``txid`` (the writing transaction's id) and ``seq`` (in insert order) make
  the subscription cursor: a reader returns only rows of transactions older
  than every transaction still running, in (txid, seq) order, so an event
  committed late is never behind a cursor that already passed it (ADR-0011).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Constant defaults: Postgres adds these columns without rewriting the table,
# so the outbox (a row per dispatch ever made) takes only a short lock.
_COLUMNS = """
ALTER TABLE outbox
    ADD COLUMN IF NOT EXISTS kind text NOT NULL DEFAULT 'job.dispatch',
    ADD COLUMN IF NOT EXISTS exchange text,
    ADD COLUMN IF NOT EXISTS body bytea,
    ADD COLUMN IF NOT EXISTS headers jsonb NOT NULL DEFAULT '{}'::jsonb,
    ALTER COLUMN job_id DROP NOT NULL
"""
# NOT VALID first: adding it checks no existing row under the table's lock;
# VALIDATE then reads the table holding a lock that lets writes go on.
# Guarded, so a migration interrupted after this step can be run again.
_SHAPE = """
DO $$
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_constraint
        WHERE conname = 'outbox_kind_shape' AND conrelid = 'outbox'::regclass
    ) THEN
        ALTER TABLE outbox ADD CONSTRAINT outbox_kind_shape CHECK (
            (kind = 'job.dispatch' AND job_id IS NOT NULL AND body IS NULL)
            OR (kind = 'event' AND job_id IS NULL AND body IS NOT NULL)
        ) NOT VALID;
    END IF;
END
$$
"""
_VALIDATE = "ALTER TABLE outbox VALIDATE CONSTRAINT outbox_kind_shape"

_EVENTS = """
CREATE TABLE IF NOT EXISTS events (
    tenant_id      uuid NOT NULL REFERENCES tenants (id),
    event_id       uuid NOT NULL,
    event_type     text NOT NULL,
    event_time     timestamptz NOT NULL,
    project_id     text,
    correlation_id text NOT NULL,
    causation_id   text,
    payload        jsonb NOT NULL,
    -- what makes a second publish of this event_id "the same event"
    request_hash   bytea NOT NULL,
    -- the job the event is about, when it is one (lifecycle and handler events)
    job_id         uuid,
    create_time    timestamptz NOT NULL DEFAULT now(),
    -- the cursor: commit order, see the module docstring
    txid           xid8 NOT NULL DEFAULT pg_current_xact_id(),
    -- an identity column: a role with INSERT on the table may draw from it
    seq            bigint GENERATED ALWAYS AS IDENTITY,
    PRIMARY KEY (tenant_id, event_id)
)
"""
_EVENTS_CURSOR = "CREATE INDEX IF NOT EXISTS events_tenant_cursor ON events (tenant_id, txid, seq)"


def upgrade() -> None:
    op.execute(_COLUMNS)
    op.execute(_SHAPE)
    op.execute(_EVENTS)
    op.execute(_EVENTS_CURSOR)
    # VALIDATE reads the whole outbox: outside the migration's transaction,
    # so the short locks above are not held for as long as that takes.
    with op.get_context().autocommit_block():
        op.execute(_VALIDATE)


def downgrade() -> None:
    # Rows that are not job dispatches cannot exist without these columns.
    op.execute("DELETE FROM outbox WHERE kind <> 'job.dispatch'")
    op.execute("DROP TABLE IF EXISTS events")
    op.execute("ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_kind_shape")
    op.execute(
        """
        ALTER TABLE outbox
            ALTER COLUMN job_id SET NOT NULL,
            DROP COLUMN IF EXISTS headers,
            DROP COLUMN IF EXISTS body,
            DROP COLUMN IF EXISTS exchange,
            DROP COLUMN IF EXISTS kind
        """
    )
