"""Recurring schedules: a job template and when it runs (ADR-0041).

- ``schedules``: one row per schedule, keyed by (tenant, id) where the id is
  the caller's or a generated one; ``uid`` is new for every schedule ever
  created, so a schedule deleted and created again under the same id never
  meets its predecessor's jobs (the runs' request_ids are made from it).
  ``next_tick`` is the nominal time of the next tick, ``next_run_time`` that
  tick with its jitter: what the ticker waits for. ``buffered_tick`` holds the
  one tick BUFFER_ONE keeps while a run is still going; ``recent_runs`` the
  newest runs' job ids, newest first.
- ``schedules_due``: the ticker's search, a few rows however many schedules
  there are; ``schedules_buffered``: the few with a tick held back.

The tenant's rows go with the tenant (erasure deletes it).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

_UP = """
CREATE TABLE IF NOT EXISTS schedules (
    tenant_id        uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    id               text NOT NULL,
    uid              uuid NOT NULL UNIQUE,
    description      text NOT NULL DEFAULT '',
    job_type         text NOT NULL,
    payload          jsonb NOT NULL DEFAULT '{}',
    labels           jsonb NOT NULL DEFAULT '{}',
    max_attempts     integer NOT NULL DEFAULT 0,
    timeout_seconds  double precision,
    cron             text NOT NULL DEFAULT '',
    time_zone        text NOT NULL DEFAULT '',
    interval_seconds double precision NOT NULL DEFAULT 0,
    start_time       timestamptz,
    end_time         timestamptz,
    jitter_seconds   double precision NOT NULL DEFAULT 0,
    overlap          text NOT NULL DEFAULT 'skip',
    catch_up         text NOT NULL DEFAULT 'skip',
    catch_up_limit   integer NOT NULL DEFAULT 0,
    paused           boolean NOT NULL DEFAULT false,
    anchor_time      timestamptz NOT NULL,
    next_tick        timestamptz,
    next_run_time    timestamptz,
    buffered_tick    timestamptz,
    last_run_time    timestamptz,
    recent_runs      uuid[] NOT NULL DEFAULT '{}',
    runs             bigint NOT NULL DEFAULT 0,
    skipped          bigint NOT NULL DEFAULT 0,
    last_error       text NOT NULL DEFAULT '',
    create_time      timestamptz NOT NULL DEFAULT now(),
    update_time      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, id)
);
CREATE INDEX IF NOT EXISTS schedules_due ON schedules (next_run_time)
    WHERE NOT paused AND next_run_time IS NOT NULL;
CREATE INDEX IF NOT EXISTS schedules_buffered ON schedules (tenant_id, id)
    WHERE buffered_tick IS NOT NULL;
CREATE INDEX IF NOT EXISTS schedules_pages ON schedules (tenant_id, create_time DESC, id DESC)
"""

_DOWN = "DROP TABLE IF EXISTS schedules"


def upgrade() -> None:
    for statement in filter(str.strip, _UP.split(";\n")):
        op.execute(statement)


def downgrade() -> None:
    op.execute(_DOWN)
