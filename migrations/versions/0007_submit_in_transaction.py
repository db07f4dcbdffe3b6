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
# counts as stored.
_NUMBER_LENGTH = r"""
CREATE OR REPLACE FUNCTION jobplane.number_length(stored text) RETURNS integer
LANGUAGE plpgsql
IMMUTABLE
STRICT
SET extra_float_digits = 1
AS $fn$
DECLARE
    v_value    numeric := stored::numeric;
    v_float    double precision;
    v_negative integer;
    v_digits   integer;
    v_exponent integer;
    v_text     text;
    v_mantissa text;
    v_int      text;
    v_frac     text;
    v_shift    integer;
    v_candidate text;
    v_pass     integer;
BEGIN
    IF v_value = 0 THEN
        RETURN 1;
    END IF;
    IF NOT (abs(v_value) > 2.4703282292062328e-324
            AND abs(v_value) < 1.797693134862315807e308) THEN
        RETURN length(stored);
    END IF;
    v_float := v_value::double precision;
    IF v_float = trunc(v_float) AND abs(v_float) <= 9007199254740992 THEN
        RETURN length(v_float::bigint::text);
    END IF;
    v_negative := (v_float < 0)::integer;
    -- The significant digits and decimal exponent of the stored text, then of
    -- float8's output; the shorter is Python's (its repr is the shortest).
    FOR v_pass IN 1..2 LOOP
        v_text := ltrim(CASE v_pass WHEN 1 THEN stored ELSE v_float::text END, '-');
        v_mantissa := split_part(v_text, 'e', 1);
        v_shift := coalesce(nullif(split_part(v_text, 'e', 2), '')::integer, 0);
        v_int := ltrim(split_part(v_mantissa, '.', 1), '0');
        v_frac := split_part(v_mantissa, '.', 2);
        IF v_int <> '' THEN
            v_candidate := rtrim(v_int || v_frac, '0');
            v_shift := v_shift + length(v_int) - 1;
        ELSE
            v_candidate := rtrim(ltrim(v_frac, '0'), '0');
            v_shift := v_shift - (length(v_frac) - length(ltrim(v_frac, '0')) + 1);
        END IF;
        IF v_pass = 1 OR length(v_candidate) < v_digits THEN
            v_digits := length(v_candidate);
            v_exponent := v_shift;
        END IF;
        -- Up to 15 digits read back as themselves: none shorter does.
        EXIT WHEN v_digits <= 15;
    END LOOP;
    IF v_exponent >= -4 AND v_exponent < 16 THEN
        IF v_exponent >= v_digits - 1 THEN
            RETURN v_negative + v_exponent + 3;  -- digits, zeros, ".0"
        ELSIF v_exponent >= 0 THEN
            RETURN v_negative + v_digits + 1;
        END IF;
        RETURN v_negative + v_digits + 1 - v_exponent;
    END IF;
    RETURN v_negative + v_digits + (v_digits > 1)::integer + 2
        + greatest(2, length(abs(v_exponent)::text));
END
$fn$
"""
_PAYLOAD_SIZE = r"""
CREATE OR REPLACE FUNCTION jobplane.payload_size(payload jsonb) RETURNS bigint
LANGUAGE plpgsql
IMMUTABLE
STRICT
AS $fn$
DECLARE
    v_text     text := payload::text;
    v_stripped text;
    v_numbers  bigint;
BEGIN
    -- jsonb's text puts a space after every ',' and ':' between tokens and
    -- nowhere else outside strings.
    v_stripped := regexp_replace(v_text, '"([^"\\]|\\.)*"', '', 'g');
    SELECT coalesce(sum(jobplane.number_length(v #>> '{}') - length(v #>> '{}')), 0)
    INTO v_numbers
    FROM jsonb_path_query(payload, 'strict $.** ? (@.type() == "number")') AS v;
    RETURN octet_length(v_text)
        - (octet_length(v_stripped) - octet_length(replace(v_stripped, ' ', '')))
        + v_numbers;
END
$fn$
"""

# {schema}: where jobplane's tables are, fixed when the function is created
# so that no caller's search_path can point it at tables of its own.
_SUBMIT_JOB = r"""
CREATE OR REPLACE FUNCTION jobplane.submit_job(
    tenant          text,
    type            text,
    payload         jsonb DEFAULT '{{}}',
    request_id      text DEFAULT '',
    correlation_id  text DEFAULT '',
    max_attempts    integer DEFAULT 0,
    labels          jsonb DEFAULT '{{}}',
    timeout_seconds double precision DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, {schema}, pg_temp
SET extra_float_digits = 1
AS $fn$
#variable_conflict use_column
DECLARE
    v_tenant         uuid;
    v_type           text := coalesce(submit_job.type, '');
    v_payload        jsonb := coalesce(submit_job.payload, '{{}}');
    v_request_id     text := coalesce(submit_job.request_id, '');
    v_correlation_id text := coalesce(submit_job.correlation_id, '');
    v_max_attempts   integer := coalesce(submit_job.max_attempts, 0);
    v_labels         jsonb := coalesce(submit_job.labels, '{{}}');
    v_timeout        double precision := submit_job.timeout_seconds;
    v_route          record;
    v_limit          integer;
    v_size           bigint;
    v_label          record;
    v_id             uuid;
    v_dispatch       uuid;
    v_existing       record;
    v_control        constant text := '[' || chr(1) || '-' || chr(31) || ']';
BEGIN
    SELECT id INTO v_tenant FROM tenants WHERE name = submit_job.tenant;
    IF v_tenant IS NULL THEN
        RAISE EXCEPTION 'TENANT_NOT_FOUND: no tenant is named %',
            coalesce(quote_literal(left(submit_job.tenant, 64)), 'NULL')
            USING ERRCODE = 'JP005', COLUMN = 'tenant';
    END IF;

    -- The order of the checks is the RPC's, so both name the same field first.
    IF v_type = '' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: type is required'
            USING ERRCODE = 'JP001', COLUMN = 'type';
    END IF;
    IF char_length(v_type) > 128 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: type is longer than 128 characters'
            USING ERRCODE = 'JP001', COLUMN = 'type';
    END IF;
    IF v_type !~ '^[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)*$' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: type % must be lowercase dotted words of letters, '
            'digits, ''_'' and ''-'' (e.g. ''reports.render'')', quote_literal(left(v_type, 64))
            USING ERRCODE = 'JP001', COLUMN = 'type';
    END IF;

    SELECT queue, max_attempts, timeout_seconds INTO v_route
    FROM job_routes WHERE ('.' || v_type) ~ regex ORDER BY rank LIMIT 1;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'JOB_TYPE_UNROUTABLE: no queue of the topology takes job type %',
            quote_literal(v_type)
            USING ERRCODE = 'JP003', COLUMN = 'type',
                  HINT = 'the routes are the topology''s, as the servers last wrote them';
    END IF;

    IF jsonb_typeof(v_payload) <> 'object' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: payload must be a JSON object, not %',
            jsonb_typeof(v_payload)
            USING ERRCODE = 'JP001', COLUMN = 'payload';
    END IF;
    -- The payload's size as the RPC measures it (jobplane.payload_size);
    -- that is at most twice the length of jsonb's text, so most payloads
    -- need no closer look.
    SELECT max_payload_bytes INTO v_limit FROM submit_settings;
    IF octet_length(v_payload::text) > v_limit / 2 THEN
        v_size := jobplane.payload_size(v_payload);
        IF v_size > v_limit THEN
            RAISE EXCEPTION 'PAYLOAD_TOO_LARGE: payload is % bytes serialized; the limit is %',
                v_size, v_limit
                USING ERRCODE = 'JP002', COLUMN = 'payload',
                      DETAIL = format('limit=%s size=%s', v_limit, v_size);
        END IF;
    END IF;
    -- jsonb holds no NUL and no NaN or Infinity, so of the RPC's payload
    -- checks only the depth is left: no object or array below level 31
    -- (the payload itself is level 0, depth 1).
    IF jsonb_path_exists(
        v_payload, 'strict $.**{{32 to last}} ? (@.type() == "object" || @.type() == "array")'
    ) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: payload is nested more than 32 objects or arrays deep'
            USING ERRCODE = 'JP001', COLUMN = 'payload', DETAIL = 'limit=32';
    END IF;

    IF v_max_attempts < 0 OR v_max_attempts > 100 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: max_attempts must be 0 (queue default) .. 100'
            USING ERRCODE = 'JP001', COLUMN = 'max_attempts';
    END IF;
    IF char_length(v_request_id) > 256 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: request_id is longer than 256 characters'
            USING ERRCODE = 'JP001', COLUMN = 'request_id';
    END IF;
    IF v_request_id ~ v_control THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: request_id has control characters'
            USING ERRCODE = 'JP001', COLUMN = 'request_id';
    END IF;
    -- The relay sends it as the AMQP correlation-id, a short string.
    IF octet_length(v_correlation_id) > 255 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: correlation_id is longer than 255 bytes in UTF-8'
            USING ERRCODE = 'JP001', COLUMN = 'correlation_id';
    END IF;
    IF v_correlation_id ~ v_control THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: correlation_id has control characters'
            USING ERRCODE = 'JP001', COLUMN = 'correlation_id';
    END IF;

    IF jsonb_typeof(v_labels) <> 'object' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: labels must be a JSON object of strings'
            USING ERRCODE = 'JP001', COLUMN = 'labels';
    END IF;
    IF (SELECT count(*) FROM jsonb_object_keys(v_labels)) > 64 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: at most 64 labels'
            USING ERRCODE = 'JP001', COLUMN = 'labels';
    END IF;
    FOR v_label IN SELECT key, value FROM jsonb_each(v_labels) LOOP
        IF v_label.key !~ '^[a-z0-9]([a-z0-9._/-]{{0,61}}[a-z0-9])?$' THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: label key % must be 1..63 lowercase letters, '
                'digits, ''.'', ''_'', ''-'', ''/''', quote_literal(left(v_label.key, 64))
                USING ERRCODE = 'JP001', COLUMN = 'labels';
        END IF;
        IF jsonb_typeof(v_label.value) <> 'string' THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: label % must be a string', quote_literal(v_label.key)
                USING ERRCODE = 'JP001', COLUMN = 'labels[' || v_label.key || ']';
        END IF;
        IF char_length(v_label.value #>> '{{}}') > 256 THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: label % is longer than 256 characters',
                quote_literal(v_label.key)
                USING ERRCODE = 'JP001', COLUMN = 'labels[' || v_label.key || ']';
        END IF;
    END LOOP;

    IF v_timeout IS NULL THEN
        v_timeout := v_route.timeout_seconds;
    ELSIF v_timeout = 'NaN' OR NOT (v_timeout >= 0.001 AND v_timeout <= 604800) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: timeout must be at least 0.001 and at most '
            '604800 seconds'
            USING ERRCODE = 'JP001', COLUMN = 'timeout';
    END IF;
    IF v_request_id = '' THEN
        v_request_id := gen_random_uuid()::text;
    END IF;
    IF v_max_attempts = 0 THEN
        v_max_attempts := v_route.max_attempts;
    END IF;

    -- Job, first event and outbox row, as the RPC writes them. Ids are UUIDv7
    -- (a v4 with the time in milliseconds in front and the version set to 7).
    FOR v_try IN 1..3 LOOP
        v_id := encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) PLACING
                substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint)
                FROM 3) FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid;
        v_dispatch := encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) PLACING
                substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint)
                FROM 3) FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid;
        INSERT INTO jobs (id, tenant_id, type, queue, state, payload, max_attempts, request_id,
                          request_hash, correlation_id, labels, dispatch_id, last_seq,
                          timeout_seconds)
        VALUES (v_id, v_tenant, v_type, v_route.queue, 'queued', v_payload, v_max_attempts,
                v_request_id,
                sha256(convert_to(jsonb_build_array(v_type, v_payload, v_max_attempts,
                    v_correlation_id, v_labels, v_timeout)::text, 'UTF8')),
                v_correlation_id, v_labels, v_dispatch, 1, v_timeout)
        ON CONFLICT (tenant_id, request_id) DO NOTHING;
        IF FOUND THEN
            INSERT INTO job_events (job_id, seq, tenant_id, type, state, progress, message,
                                    attempt)
            VALUES (v_id, 1, v_tenant, 'queued', 'queued', 0, 'queued', 0);
            INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id)
            VALUES (v_dispatch, v_tenant, v_id, v_type, v_correlation_id);
            -- Sent at commit, and not at all when the caller rolls back.
            PERFORM pg_notify('jobplane_outbox', '');
            RETURN v_id;
        END IF;
        -- The request_id is taken (ON CONFLICT waited for its insert to
        -- commit). The same request is the same stored values.
        SELECT id, type, payload, max_attempts, correlation_id, labels, timeout_seconds
        INTO v_existing
        FROM jobs WHERE tenant_id = v_tenant AND request_id = v_request_id;
        IF FOUND THEN
            IF v_existing.type = v_type AND v_existing.payload = v_payload
                    AND v_existing.max_attempts = v_max_attempts
                    AND v_existing.correlation_id = v_correlation_id
                    AND v_existing.labels = v_labels
                    AND v_existing.timeout_seconds = v_timeout THEN
                RETURN v_existing.id;
            END IF;
            RAISE EXCEPTION 'REQUEST_ID_REUSED: request_id % was used for a different request',
                quote_literal(left(v_request_id, 64))
                USING ERRCODE = 'JP004', COLUMN = 'request_id';
        END IF;
        -- The job that held it is gone again; try once more.
    END LOOP;
    RAISE EXCEPTION 'request_id % is taken and released over and over',
        quote_literal(left(v_request_id, 64))
        USING ERRCODE = '40001';
END
$fn$
"""


def upgrade() -> None:
    for statement in filter(str.strip, _TABLES.split(";\n")):
        op.execute(statement)
    schema = op.get_bind().execute(text("SELECT quote_ident(current_schema())")).scalar_one()
    op.execute(_NUMBER_LENGTH)
    op.execute(_PAYLOAD_SIZE)
    op.execute(_SUBMIT_JOB.format(schema=schema))
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
