-- jobplane.submit_job: a job, its first event, its outbox row (and job.queued) in the
-- caller's transaction, with SubmitJob's checks (ADR-0012).
--
-- The current definition, as the migrations leave it in a database. A change is a
-- new migration that installs a copy of this file, frozen as
-- migrations/jobplane/migrations/sql/{revision}_submit_job.sql; tests/integration/test_sql_files.py fails
-- while the two disagree (docs/adr/0035-sql-api-as-files.md).
--
-- @SCHEMA@ is where jobplane's tables are, fixed when the function is created so that
-- no caller's search_path can point it at tables of its own.

CREATE OR REPLACE FUNCTION jobplane.submit_job(
    tenant          text,
    type            text,
    payload         jsonb DEFAULT '{}',
    request_id      text DEFAULT '',
    correlation_id  text DEFAULT '',
    max_attempts    integer DEFAULT 0,
    labels          jsonb DEFAULT '{}',
    timeout_seconds double precision DEFAULT NULL,
    -- Delayed jobs (docs/scheduling.md): at most one of the two.
    schedule_time   timestamptz DEFAULT NULL,
    schedule_delay  interval DEFAULT NULL,
    -- Concurrency keys (docs/flow-control.md): mode 'queue' (NULL) or 'reject'.
    concurrency_key   text DEFAULT NULL,
    concurrency_limit integer DEFAULT NULL,
    concurrency_mode  text DEFAULT NULL,
    -- Deadlines (docs/scheduling.md#deadlines): at most one of the two.
    deadline          timestamptz DEFAULT NULL,
    deadline_after    interval DEFAULT NULL,
    -- Dependencies (docs/workflows.md): ids of the caller's jobs it runs
    -- after, and what a failure of one does: 'fail' (NULL), 'cancel' or
    -- 'run_anyway'.
    after             uuid[] DEFAULT NULL,
    after_failure     text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, @SCHEMA@, pg_temp
SET extra_float_digits = 1
AS $fn$
#variable_conflict use_column
DECLARE
    v_tenant         uuid;
    v_type           text := coalesce(submit_job.type, '');
    v_payload        jsonb := coalesce(submit_job.payload, '{}');
    v_request_id     text := coalesce(submit_job.request_id, '');
    v_correlation_id text := coalesce(submit_job.correlation_id, '');
    v_max_attempts   integer := coalesce(submit_job.max_attempts, 0);
    v_labels         jsonb := coalesce(submit_job.labels, '{}');
    v_timeout        double precision := submit_job.timeout_seconds;
    v_route          record;
    v_limit          integer;
    v_size           bigint;
    v_label          record;
    v_id             uuid;
    v_dispatch       uuid;
    v_existing       record;
    v_control        constant text := '[' || chr(1) || '-' || chr(31) || ']';
    v_lifecycle      boolean;
    v_event_id       uuid;
    v_event_time     timestamptz;
    v_correlation    text;
    v_event_payload  text;
    v_body           text;
    v_digest         bytea;
    v_schedule       timestamptz := submit_job.schedule_time;
    v_horizon        interval;
    v_accepted       timestamptz := clock_timestamp();
    -- Concurrency keys.
    v_key            text := nullif(submit_job.concurrency_key, '');
    v_key_limit      integer := coalesce(submit_job.concurrency_limit, 0);
    v_key_mode       text := coalesce(submit_job.concurrency_mode, '');
    v_holders        text;
    v_in_flight      bigint;
    -- Deadlines.
    v_deadline       timestamptz := submit_job.deadline;
    -- Dependencies.
    v_after          uuid[] := submit_job.after;
    v_policy         text := coalesce(submit_job.after_failure, '');
    v_missing        integer;
    v_deps_waiting   integer := 0;
    v_deps_failed    integer := 0;
    v_deps_failed_on uuid;
    v_waits          boolean := false;
    v_reason         text;
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

    IF EXISTS (SELECT 1 FROM job_pipelines WHERE name = v_type) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: type % is a pipeline: submit it with SubmitJob, '
            'which writes its stages', quote_literal(v_type)
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
    SELECT max_payload_bytes, lifecycle_events, make_interval(secs => max_schedule_seconds)
    INTO v_limit, v_lifecycle, v_horizon FROM submit_settings;
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
        v_payload, 'strict $.**{32 to last} ? (@.type() == "object" || @.type() == "array")'
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
    -- The request_ids of the jobs the system submits: a fan-out's children
    -- (fan:{job}:{stage}:{attempt}:{item}) and child jobs (child:{job}:{key}).
    -- A caller's job with one would be taken for that child, or make its
    -- submit fail (0028).
    IF starts_with(v_request_id, 'fan:') OR starts_with(v_request_id, 'child:') THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: request_id % starts with %, which is the system''s '
            '(its prefixes: fan:, child:)', quote_literal(left(v_request_id, 64)),
            quote_literal(split_part(v_request_id, ':', 1) || ':')
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
        IF v_label.key !~ '^[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?$' THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: label key % must be 1..63 lowercase letters, '
                'digits, ''.'', ''_'', ''-'', ''/''', quote_literal(left(v_label.key, 64))
                USING ERRCODE = 'JP001', COLUMN = 'labels';
        END IF;
        IF jsonb_typeof(v_label.value) <> 'string' THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: label % must be a string', quote_literal(v_label.key)
                USING ERRCODE = 'JP001', COLUMN = 'labels[' || v_label.key || ']';
        END IF;
        IF char_length(v_label.value #>> '{}') > 256 THEN
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
    -- Delayed jobs: the RPC's checks (jobplane.scheduling), the delay
    -- counted from this call.
    IF v_schedule IS NOT NULL AND submit_job.schedule_delay IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: schedule_delay goes with no schedule_time: set one '
            'of them'
            USING ERRCODE = 'JP001', COLUMN = 'schedule_delay';
    END IF;
    IF v_schedule IS NOT NULL AND NOT v_schedule >= '2000-01-01T00:00:00Z' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: schedule_time must be 2000-01-01T00:00:00Z or later'
            USING ERRCODE = 'JP001', COLUMN = 'schedule_time';
    END IF;
    IF v_schedule IS NOT NULL AND v_schedule > v_accepted + v_horizon THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: schedule_time is more than % ahead', v_horizon
            USING ERRCODE = 'JP001', COLUMN = 'schedule_time';
    END IF;
    IF submit_job.schedule_delay IS NOT NULL THEN
        IF v_accepted + submit_job.schedule_delay < v_accepted
                OR v_accepted + submit_job.schedule_delay > v_accepted + v_horizon THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: schedule_delay must be 0 to %', v_horizon
                USING ERRCODE = 'JP001', COLUMN = 'schedule_delay';
        END IF;
        v_schedule := v_accepted + submit_job.schedule_delay;
    END IF;
    -- Deadlines: the RPC's checks (jobplane.scheduling.deadline_of), the
    -- delay counted from this call.
    IF v_deadline IS NOT NULL AND submit_job.deadline_after IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: deadline_after goes with no deadline: set one '
            'of them'
            USING ERRCODE = 'JP001', COLUMN = 'deadline_after';
    END IF;
    IF submit_job.deadline_after IS NOT NULL THEN
        IF NOT v_accepted + submit_job.deadline_after > v_accepted
                OR v_accepted + submit_job.deadline_after > v_accepted + v_horizon THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: deadline_after must be more than 0, up to %',
                v_horizon
                USING ERRCODE = 'JP001', COLUMN = 'deadline_after';
        END IF;
        v_deadline := v_accepted + submit_job.deadline_after;
    ELSIF v_deadline IS NOT NULL THEN
        IF NOT v_deadline > v_accepted THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: deadline has passed already'
                USING ERRCODE = 'JP001', COLUMN = 'deadline';
        END IF;
        IF v_deadline > v_accepted + v_horizon THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: deadline is more than % ahead', v_horizon
                USING ERRCODE = 'JP001', COLUMN = 'deadline';
        END IF;
    END IF;
    IF v_deadline IS NOT NULL AND v_schedule IS NOT NULL AND NOT v_deadline > v_schedule THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % must be after the job''s schedule_time',
            CASE WHEN submit_job.deadline_after IS NOT NULL THEN 'deadline_after'
                 ELSE 'deadline' END
            USING ERRCODE = 'JP001',
                  COLUMN = CASE WHEN submit_job.deadline_after IS NOT NULL THEN 'deadline_after'
                                ELSE 'deadline' END;
    END IF;
    -- Concurrency keys: SubmitJob's checks, then reject mode's refusal under
    -- the key's lock (the one the claims take), held to the caller's commit.
    IF v_key_mode NOT IN ('', 'queue', 'reject') THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: concurrency_mode must be queue or reject'
            USING ERRCODE = 'JP001', COLUMN = 'concurrency_mode';
    END IF;
    IF v_key IS NULL THEN
        IF v_key_limit <> 0 THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: concurrency_limit needs a concurrency_key'
                USING ERRCODE = 'JP001', COLUMN = 'concurrency_limit';
        END IF;
        IF v_key_mode <> '' THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: concurrency_mode needs a concurrency_key'
                USING ERRCODE = 'JP001', COLUMN = 'concurrency_mode';
        END IF;
    ELSE
        IF char_length(v_key) > 256 THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: concurrency_key is longer than 256 characters'
                USING ERRCODE = 'JP001', COLUMN = 'concurrency_key';
        END IF;
        IF v_key ~ ('[' || chr(1) || '-' || chr(31) || chr(127) || '-' || chr(159) || ']') THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: concurrency_key has control characters'
                USING ERRCODE = 'JP001', COLUMN = 'concurrency_key';
        END IF;
        IF v_key ~ '^\s*$' THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: concurrency_key is blank'
                USING ERRCODE = 'JP001', COLUMN = 'concurrency_key';
        END IF;
        IF v_key_limit < 0 OR v_key_limit > 10000 THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: concurrency_limit must be 1 to 10000 (0 means 1)'
                USING ERRCODE = 'JP001', COLUMN = 'concurrency_limit';
        END IF;
        v_key_limit := greatest(v_key_limit, 1);
    END IF;
    IF v_key IS NOT NULL AND v_key_mode = 'reject' AND NOT EXISTS (
            SELECT 1 FROM jobs WHERE tenant_id = v_tenant AND request_id = v_request_id) THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(v_tenant::text || '/' || v_key, 40));
        SELECT count(*), string_agg('jobs/' || h.id, ',' ORDER BY h.create_time, h.id)
        INTO v_in_flight, v_holders
        FROM (SELECT id, create_time FROM jobs
              WHERE tenant_id = v_tenant AND concurrency_key = v_key
                AND state IN ('queued', 'running')
                -- A transaction with the same request_id that committed while
                -- this one waited for the lock: this call is its replay.
                AND request_id IS DISTINCT FROM v_request_id
              ORDER BY create_time, id LIMIT v_key_limit) AS h;
        IF v_in_flight >= v_key_limit THEN
            RAISE EXCEPTION 'CONCURRENCY_LIMIT_REACHED: concurrency key % already has % job(s) '
                'in flight: %', quote_literal(left(v_key, 64)), v_key_limit,
                replace(v_holders, ',', ', ')
                USING ERRCODE = 'JP007',
                      DETAIL = format('concurrency_limit=%s holders=%s', v_key_limit, v_holders);
        END IF;
    END IF;

    -- Dependencies: SubmitJob's checks, then the jobs named are marked and
    -- locked (in id order) to the caller's commit, as the RPC does. A job
    -- already ended counts at once; one that failed under policy fail or
    -- cancel leaves the job waiting for the sweeper's next pass to end it.
    IF v_policy NOT IN ('', 'fail', 'cancel', 'run_anyway') THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: after_failure must be fail, cancel or run_anyway'
            USING ERRCODE = 'JP001', COLUMN = 'after_failure';
    END IF;
    IF coalesce(cardinality(v_after), 0) = 0 THEN
        IF v_policy <> '' THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: after_failure needs after'
                USING ERRCODE = 'JP001', COLUMN = 'after_failure';
        END IF;
        v_after := NULL;
    ELSE
        IF array_ndims(v_after) > 1 THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: after must be a one-dimensional array of job ids'
                USING ERRCODE = 'JP001', COLUMN = 'after';
        END IF;
        IF cardinality(v_after) > 100 THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: after names at most 100 jobs'
                USING ERRCODE = 'JP001', COLUMN = 'after';
        END IF;
        IF array_position(v_after, NULL) IS NOT NULL THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: after[%] is NULL', array_position(v_after, NULL) - 1
                USING ERRCODE = 'JP001', COLUMN = 'after[' || (array_position(v_after, NULL) - 1) || ']';
        END IF;
        IF (SELECT count(DISTINCT a) FROM unnest(v_after) a) < cardinality(v_after) THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: after names a job twice'
                USING ERRCODE = 'JP001', COLUMN = 'after';
        END IF;
        v_policy := CASE WHEN v_policy = '' THEN 'fail' ELSE v_policy END;
        WITH p AS (
            SELECT id FROM jobs WHERE tenant_id = v_tenant AND id = ANY (v_after)
            ORDER BY id FOR UPDATE
        )
        UPDATE jobs SET has_dependents = true FROM p WHERE jobs.id = p.id;
        SELECT min(a.ord) INTO v_missing
        FROM unnest(v_after) WITH ORDINALITY AS a(id, ord)
        WHERE NOT EXISTS (SELECT 1 FROM jobs WHERE tenant_id = v_tenant AND jobs.id = a.id);
        IF v_missing IS NOT NULL THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: after[%]: no job jobs/% (a job of yours that '
                'exists when this one is submitted)', v_missing - 1, v_after[v_missing]
                USING ERRCODE = 'JP001', COLUMN = 'after[' || (v_missing - 1) || ']';
        END IF;
        SELECT count(*) FILTER (WHERE state NOT IN ('succeeded', 'failed', 'cancelled')),
               count(*) FILTER (WHERE state IN ('failed', 'cancelled')),
               (array_agg(id ORDER BY id) FILTER (WHERE state IN ('failed', 'cancelled')))[1]
        INTO v_deps_waiting, v_deps_failed, v_deps_failed_on
        FROM jobs WHERE tenant_id = v_tenant AND id = ANY (v_after);
        v_waits := v_deps_waiting > 0 OR (v_deps_failed > 0 AND v_policy <> 'run_anyway');
        SELECT format('waiting for %s to end (it runs after them)',
                      string_agg('jobs/' || w.id, ', ' ORDER BY w.id))
        INTO v_reason
        FROM (SELECT id FROM jobs WHERE tenant_id = v_tenant AND id = ANY (v_after)
                AND (v_deps_waiting = 0 OR state NOT IN ('succeeded', 'failed', 'cancelled'))
              ORDER BY id LIMIT 10) AS w;
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
                          timeout_seconds, lifecycle_seq, schedule_time, concurrency_key,
                          concurrency_limit, deadline, after_ids, after_failure, deps_waiting,
                          deps_failed, deps_failed_on, waiting_code, waiting_reason)
        VALUES (v_id, v_tenant, v_type, v_route.queue, 'queued', v_payload, v_max_attempts,
                v_request_id,
                sha256(convert_to(jsonb_build_array(v_type, v_payload, v_max_attempts,
                    v_correlation_id, v_labels, v_timeout)::text, 'UTF8')),
                v_correlation_id, v_labels, CASE WHEN NOT v_waits THEN v_dispatch END, 1,
                v_timeout, 1, v_schedule, v_key,
                CASE WHEN v_key IS NOT NULL THEN v_key_limit END, v_deadline, v_after,
                CASE WHEN v_after IS NOT NULL THEN v_policy END, v_deps_waiting, v_deps_failed,
                v_deps_failed_on, CASE WHEN v_waits THEN 'DEPENDENCIES' END,
                CASE WHEN v_waits THEN v_reason END)
        ON CONFLICT (tenant_id, request_id) DO NOTHING;
        IF FOUND THEN
            -- Its edges: one that ended already carries its outcome.
            INSERT INTO job_dependencies (job_id, depends_on, tenant_id, outcome)
            SELECT v_id, x.id, v_tenant,
                   CASE WHEN x.state IN ('succeeded', 'failed', 'cancelled') THEN x.state END
            FROM jobs x WHERE x.tenant_id = v_tenant AND x.id = ANY (v_after);
            INSERT INTO job_events (job_id, seq, tenant_id, type, state, progress, message,
                                    attempt)
            VALUES (v_id, 1, v_tenant, 'queued', 'queued', 0, 'queued', 0);
            -- A delayed job's dispatch is due at its schedule_time (GREATEST
            -- skips the NULL of a job without one). Its queue: the relay's
            -- credit and fair claim are per queue (docs/flow-control.md).
            -- A job that waits for the jobs it runs after has none yet.
            IF NOT v_waits THEN
                INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id,
                                    available_at, queue)
                VALUES (v_dispatch, v_tenant, v_id, v_type, v_correlation_id,
                        greatest(now(), v_schedule), v_route.queue);
            END IF;
            -- Its job.queued, as the servers' state machine writes it
            -- (jobplane.store.machine.DomainEvents): the id is the version-3
            -- UUID of (job id, event seq 1), the body the envelope in
            -- compact JSON, the job its outbox row's order key.
            IF v_lifecycle THEN
                v_digest := decode(md5(uuid_send(v_id) || convert_to('1', 'UTF8')), 'hex');
                v_event_id := encode(set_byte(set_byte(v_digest, 6,
                        (get_byte(v_digest, 6) & 15) | 48), 8,
                        (get_byte(v_digest, 8) & 63) | 128), 'hex')::uuid;
                v_event_time := clock_timestamp();
                v_correlation := coalesce(nullif(v_correlation_id, ''), v_id::text);
                v_event_payload := '{"name":' || to_json('jobs/' || v_id)::text
                    || ',"job_id":' || to_json(v_id::text)::text
                    || ',"type":' || to_json(v_type)::text
                    || ',"queue":' || to_json(v_route.queue::text)::text
                    || ',"state":' || to_json('queued'::text)::text
                    || ',"attempt":' || '0'
                    || ',"max_attempts":' || v_max_attempts::text
                    || ',"labels":' || coalesce((
                        SELECT '{' || string_agg(to_json(l.key)::text || ':'
                                || to_json(l.value)::text, ',' ORDER BY l.key COLLATE "C")
                            || '}'
                        FROM jsonb_each_text(v_labels) AS l), '{}')
                    || CASE WHEN v_schedule IS NULL THEN '' ELSE ',"schedule_time":'
                        || to_json(to_char(v_schedule AT TIME ZONE 'UTC',
                                           'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))::text END
                    || '}';
                -- A lifecycle event: published only where the topology says (0027).
                INSERT INTO events (tenant_id, event_id, event_type, event_time, correlation_id,
                                    causation_id, payload, request_hash, job_id, lifecycle)
                VALUES (v_tenant, v_event_id, 'job.queued', v_event_time, v_correlation, NULL,
                        v_event_payload::jsonb, CAST('' AS bytea), v_id, true)
                ON CONFLICT (tenant_id, event_id) DO NOTHING;
                IF FOUND THEN
                    PERFORM pg_notify('jobplane_domain_events', v_tenant::text);
                END IF;
            END IF;
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
