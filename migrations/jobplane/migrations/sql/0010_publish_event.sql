CREATE OR REPLACE FUNCTION jobplane.publish_event(
    tenant         text,
    event_id       text,
    event_type     text,
    payload        jsonb DEFAULT '{}',
    event_time     timestamptz DEFAULT NULL,
    project_id     text DEFAULT NULL,
    correlation_id text DEFAULT '',
    causation_id   text DEFAULT NULL,
    traceparent    text DEFAULT NULL,
    tracestate     text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, @SCHEMA@, pg_temp
AS $fn$
#variable_conflict use_column
DECLARE
    v_tenant         uuid;
    v_event_id       text := coalesce(publish_event.event_id, '');
    v_type           text := coalesce(publish_event.event_type, '');
    v_payload        jsonb := coalesce(publish_event.payload, '{}');
    v_time           timestamptz := publish_event.event_time;
    v_project        text := publish_event.project_id;
    v_correlation    text := coalesce(publish_event.correlation_id, '');
    v_causation      text := publish_event.causation_id;
    v_traceparent    text;
    v_tracestate     text;
    v_limit          integer;
    v_size           bigint;
    v_field          record;
    v_body           bytea;
    v_headers        jsonb;
    v_existing       record;
    v_bad_id         constant text := '[' || chr(1) || '-' || chr(31) || chr(127) || ']';
BEGIN
    SELECT id INTO v_tenant FROM tenants WHERE name = publish_event.tenant;
    IF v_tenant IS NULL THEN
        RAISE EXCEPTION 'TENANT_NOT_FOUND: no tenant is named %',
            coalesce(quote_literal(left(publish_event.tenant, 64)), 'NULL')
            USING ERRCODE = 'JP005', COLUMN = 'tenant';
    END IF;

    -- The order of the checks is PublishEvent's, so both name the same field
    -- first: the time (read before the call reaches the service), the id,
    -- the payload, then the envelope's fields.
    IF v_time IS NOT NULL AND NOT (v_time >= '1970-01-01 00:00:00+00'
                                   AND v_time < '10000-01-01 00:00:00+00') THEN
        -- The AMQP timestamp property holds unsigned seconds since 1970.
        RAISE EXCEPTION 'INVALID_ARGUMENT: timestamp must be a valid Timestamp from '
            '1970-01-01T00:00:00Z to the end of year 9999 (%)', v_time
            USING ERRCODE = 'JP001', COLUMN = 'timestamp';
    END IF;
    IF v_event_id = '' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_id is required (a UUID the publisher chooses)'
            USING ERRCODE = 'JP001', COLUMN = 'event_id';
    END IF;
    IF v_event_id !~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_id % must be a UUID in its canonical '
            'lowercase form (8-4-4-4-12 hex digits)', quote_literal(left(v_event_id, 64))
            USING ERRCODE = 'JP001', COLUMN = 'event_id';
    END IF;

    IF jsonb_typeof(v_payload) <> 'object' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: payload must be a JSON object, not %',
            jsonb_typeof(v_payload)
            USING ERRCODE = 'JP001', COLUMN = 'payload';
    END IF;
    -- Measured as the RPC measures it (jobplane.payload_size, migration
    -- 0007), against the limit the servers enforce; at most twice the length
    -- of jsonb's text, so most payloads need no closer look.
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
    IF jsonb_path_exists(
        v_payload, 'strict $.**{32 to last} ? (@.type() == "object" || @.type() == "array")'
    ) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: payload is nested more than 32 objects or arrays deep'
            USING ERRCODE = 'JP001', COLUMN = 'payload', DETAIL = 'limit=32';
    END IF;

    IF v_event_id = '00000000-0000-0000-0000-000000000000' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_id must not be the nil UUID'
            USING ERRCODE = 'JP001', COLUMN = 'event_id';
    END IF;
    IF v_type = '' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_type is required'
            USING ERRCODE = 'JP001', COLUMN = 'event_type';
    END IF;
    IF char_length(v_type) > 128 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_type is longer than 128 characters'
            USING ERRCODE = 'JP001', COLUMN = 'event_type';
    END IF;
    IF v_type !~ '^[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)*$' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_type % must be lowercase dotted words of '
            'letters, digits, ''_'' and ''-'' (e.g. ''artifact.created'')',
            quote_literal(left(v_type, 64))
            USING ERRCODE = 'JP001', COLUMN = 'event_type';
    END IF;
    -- Unset, the correlation id is the event's own id: it starts a chain.
    IF v_correlation = '' THEN
        v_correlation := v_event_id;
    END IF;
    -- Each id travels as an AMQP short string or header: no control
    -- character, at most 255 bytes.
    FOR v_field IN
        SELECT * FROM (VALUES (1, 'project_id', v_project), (2, 'correlation_id', v_correlation),
                              (3, 'causation_id', v_causation)) AS f (n, name, value)
        ORDER BY n
    LOOP
        CONTINUE WHEN v_field.value IS NULL;
        IF v_field.value = '' THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: % must be a non-empty string or unset',
                v_field.name
                USING ERRCODE = 'JP001', COLUMN = v_field.name;
        END IF;
        IF v_field.value ~ v_bad_id THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: % has a control character', v_field.name
                USING ERRCODE = 'JP001', COLUMN = v_field.name;
        END IF;
        IF octet_length(v_field.value) > 255 THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: % is longer than 255 bytes of UTF-8', v_field.name
                USING ERRCODE = 'JP001', COLUMN = v_field.name;
        END IF;
    END LOOP;

    -- W3C trace context that is not one is ignored, as the recommendation
    -- says (and as PublishEvent does with its metadata), not refused.
    IF char_length(publish_event.traceparent) <= 512 AND publish_event.traceparent
            ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[ -~]*)?$' THEN
        v_traceparent := publish_event.traceparent;
    END IF;
    IF coalesce(publish_event.traceparent, '') <> '' AND publish_event.tracestate <> ''
            AND char_length(publish_event.tracestate) <= 512
            AND publish_event.tracestate ~ '^[ -~]*$' THEN
        v_tracestate := publish_event.tracestate;
    END IF;

    IF v_time IS NULL THEN
        -- As PublishEvent without a time: when the call was made.
        v_time := clock_timestamp();
    END IF;
    INSERT INTO events (tenant_id, event_id, event_type, event_time, project_id, correlation_id,
                        causation_id, payload, traceparent, tracestate, request_hash)
    VALUES (v_tenant, v_event_id::uuid, v_type, v_time, v_project, v_correlation, v_causation,
            v_payload, v_traceparent, v_tracestate,
            sha256(convert_to(jsonb_build_array(v_type, v_project, v_correlation, v_causation,
                v_payload)::text, 'UTF8')))
    ON CONFLICT (tenant_id, event_id) DO NOTHING;
    IF NOT FOUND THEN
        -- Stored before (ON CONFLICT waited for the writer to commit), by
        -- either path: the same event is the same stored values, compared as
        -- Postgres compares them; the time only when this call gives one.
        SELECT event_type, event_time, project_id, correlation_id, causation_id, payload, job_id
        INTO v_existing
        FROM events WHERE tenant_id = v_tenant AND event_id = v_event_id::uuid;
        IF v_existing.event_type = v_type AND v_existing.payload = v_payload
                AND v_existing.project_id IS NOT DISTINCT FROM v_project
                AND v_existing.correlation_id = v_correlation
                AND v_existing.causation_id IS NOT DISTINCT FROM v_causation
                AND v_existing.job_id IS NULL
                AND (publish_event.event_time IS NULL
                     OR v_existing.event_time = publish_event.event_time) THEN
            RETURN v_event_id::uuid;
        END IF;
        RAISE EXCEPTION 'EVENT_ID_REUSED: event_id % was published with a different event',
            quote_literal(v_event_id)
            USING ERRCODE = 'JP006', COLUMN = 'event_id';
    END IF;

    PERFORM pg_notify('jobplane_domain_events', v_tenant::text);
    RETURN v_event_id::uuid;
END
$fn$
