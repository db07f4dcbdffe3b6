"""Core schema: tenants, API keys, jobs, job events and the outbox.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_UP = """
CREATE TABLE tenants (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name        text NOT NULL UNIQUE,
    create_time timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id   uuid NOT NULL REFERENCES tenants (id),
    key_hash    bytea NOT NULL UNIQUE,
    prefix      text NOT NULL,
    create_time timestamptz NOT NULL DEFAULT now(),
    revoke_time timestamptz
);

CREATE TABLE jobs (
    id                  uuid PRIMARY KEY,
    tenant_id           uuid NOT NULL REFERENCES tenants (id),
    type                text NOT NULL,
    queue               text NOT NULL,
    state               text NOT NULL
        CHECK (state IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    payload             jsonb NOT NULL,
    result              jsonb,
    error_code          text,
    error_message       text,
    error_retryable     boolean NOT NULL DEFAULT false,
    progress            double precision NOT NULL DEFAULT 0
        CHECK (progress >= 0 AND progress <= 1),
    progress_message    text NOT NULL DEFAULT '',
    attempt             integer NOT NULL DEFAULT 0,
    max_attempts        integer NOT NULL CHECK (max_attempts >= 1),
    -- attempt at the last RetryJob: attempt - retry_base counts against max_attempts
    retry_base          integer NOT NULL DEFAULT 0,
    request_id          text NOT NULL,
    request_hash        bytea NOT NULL,
    correlation_id      text NOT NULL DEFAULT '',
    labels              jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- the outbox event a worker must present to claim the job
    dispatch_id         uuid,
    lease_token         uuid,
    lease_expires_at    timestamptz,
    cancel_requested_at timestamptz,
    cancel_reason       text,
    next_attempt_time   timestamptz,
    last_seq            bigint NOT NULL DEFAULT 0,
    create_time         timestamptz NOT NULL DEFAULT now(),
    update_time         timestamptz NOT NULL DEFAULT now(),
    start_time          timestamptz,
    end_time            timestamptz,
    CONSTRAINT jobs_tenant_request_id UNIQUE (tenant_id, request_id)
);
CREATE INDEX jobs_tenant_newest ON jobs (tenant_id, create_time DESC, id DESC);
CREATE INDEX jobs_tenant_state_newest ON jobs (tenant_id, state, create_time DESC, id DESC);
CREATE INDEX jobs_tenant_type_newest ON jobs (tenant_id, type, create_time DESC, id DESC);
CREATE INDEX jobs_running_lease ON jobs (lease_expires_at) WHERE state = 'running';

CREATE TABLE job_events (
    job_id     uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    seq        bigint NOT NULL,
    tenant_id  uuid NOT NULL,
    type       text NOT NULL,
    state      text NOT NULL,
    progress   double precision NOT NULL,
    message    text NOT NULL DEFAULT '',
    data       jsonb NOT NULL DEFAULT '{}'::jsonb,
    attempt    integer NOT NULL,
    event_time timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (job_id, seq)
);

CREATE TABLE outbox (
    id               uuid PRIMARY KEY,
    tenant_id        uuid NOT NULL,
    job_id           uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    routing_key      text NOT NULL,
    correlation_id   text NOT NULL DEFAULT '',
    available_at     timestamptz NOT NULL DEFAULT now(),
    create_time      timestamptz NOT NULL DEFAULT now(),
    published_at     timestamptz,
    publish_attempts integer NOT NULL DEFAULT 0,
    last_error       text
);
CREATE INDEX outbox_due ON outbox (available_at) WHERE published_at IS NULL;
CREATE INDEX outbox_job ON outbox (job_id);
"""

_DOWN = """
DROP TABLE outbox;
DROP TABLE job_events;
DROP TABLE jobs;
DROP TABLE api_keys;
DROP TABLE tenants;
"""


def upgrade() -> None:
    for statement in filter(str.strip, _UP.split(";\n")):
        op.execute(statement)


def downgrade() -> None:
    for statement in filter(str.strip, _DOWN.split(";\n")):
        op.execute(statement)
