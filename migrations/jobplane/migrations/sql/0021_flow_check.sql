-- jobplane.flow_check, of the flow limits: the topology's [[rate_limits]] and a queue's max_running_per_tenant,
-- decided at the claim (docs/flow-control.md, ADR-0043).
--
-- The current definition, as the migrations leave it in a database. A change is a
-- new migration that installs a copy of this file, frozen as
-- migrations/jobplane/migrations/sql/{revision}_flow_check.sql;
-- tests/integration/test_sql_files.py fails while the two disagree
-- (docs/adr/0035-sql-api-as-files.md).
--
-- A limit's budget has a key: 'queue/{queue}/{tenant}' for a queue's per-tenant limit,
-- 'limit/{name}' for a [[rate_limits]] entry shared by all tenants, and
-- 'limit/{name}/{tenant}' for one with per_tenant. Each is decided under the key's
-- transaction-scoped advisory lock; the functions are VOLATILE, so their queries take
-- snapshots of their own after the lock, as jobplane.concurrency_blocker's do.
--
-- A job held for a RUNNING slot has waiting code TENANT_LIMIT or RATE_LIMITED, jobs.flow_key
-- the key and no dispatch; a job held for its start rate has RATE_LIMITED, flow_key
-- '{key}@rate' and a dispatch due at the start it reserved.
--
-- @SCHEMA@ is where jobplane's tables are, fixed when the functions are created.

-- Whether a job may start now under its limits: NULL when it may (and, unless hold,
-- its start is counted against its rate), else why not, as a jsonb object: code
-- (the waiting code), key (what it waits for: jobs.flow_key), reason, and for a start
-- rate due (when it may start). The machine's CLAIM calls it with hold false, in its
-- guard; HOLD and THROTTLE with hold true (which, finding room, answer a dispatch due
-- now, without a code), which reserves the start a job waits for:
-- the next free one of the rate, each held job the one after the last, so a backlog
-- starts as a stream at the rate. A job arriving with its reservation (waiting is
-- '{key}@rate') is admitted on it, when the rate allows a start.
CREATE OR REPLACE FUNCTION jobplane.flow_check(
    tenant  uuid,
    jtype   text,
    jqueue  text,
    job     uuid,
    created timestamptz,
    waiting text,
    hold    boolean
) RETURNS jsonb
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, @SCHEMA@, pg_temp
AS $fn$
DECLARE
    v_max    integer;
    v_key    text;
    v_lim    record;
    v_now    timestamptz := now();
    v_iv     interval;
    v_tau    interval;
    v_tat    timestamptz;
    v_booked timestamptz;
    v_due    timestamptz;
    -- A hold that finds room (a slot freed, or the rate's time came, since the
    -- claim was refused): a dispatch due now, rather than a claim that may be
    -- refused again.
    v_again  jsonb := jsonb_build_object(
        'due', v_now, 'reason', 'dispatched again: its limits have room now');
BEGIN
    SELECT q.max_running_per_tenant INTO v_max FROM queue_limits q WHERE q.queue = jqueue;
    IF FOUND THEN
        v_key := 'queue/' || jqueue || '/' || tenant;
        PERFORM pg_advisory_xact_lock(hashtextextended(v_key, 43));
        IF jobplane.flow_taken(v_key, v_max, job, created) >= v_max THEN
            RETURN jsonb_build_object('code', 'TENANT_LIMIT', 'key', v_key, 'reason', format(
                'waiting for a slot: queue %s allows %s running jobs per tenant', jqueue, v_max));
        END IF;
    END IF;
    SELECT l.* INTO v_lim FROM flow_limits l
     WHERE ('.' || jtype) ~ ANY (l.regexes) ORDER BY l.rank LIMIT 1;
    IF NOT FOUND THEN
        RETURN CASE WHEN hold THEN v_again END;
    END IF;
    v_key := 'limit/' || v_lim.name || CASE WHEN v_lim.per_tenant THEN '/' || tenant ELSE '' END;
    PERFORM pg_advisory_xact_lock(hashtextextended(v_key, 43));
    IF v_lim.max_running IS NOT NULL
       AND jobplane.flow_taken(v_key, v_lim.max_running, job, created) >= v_lim.max_running THEN
        RETURN jsonb_build_object('code', 'RATE_LIMITED', 'key', v_key, 'reason', format(
            'waiting for a slot: rate limit %s allows %s running at once',
            v_lim.name, v_lim.max_running));
    END IF;
    IF v_lim.per_second IS NULL THEN
        RETURN CASE WHEN hold THEN v_again END;
    END IF;
    -- GCRA: a start at now conforms when the theoretical arrival time (tat) is at
    -- most burst less one emission interval ahead of now; booked is the end of
    -- the reserved starts, which a job without a reservation waits behind.
    v_iv := make_interval(secs => 1.0 / v_lim.per_second);
    v_tau := make_interval(secs => v_lim.burst / v_lim.per_second);
    SELECT b.tat, b.booked INTO v_tat, v_booked FROM flow_buckets b WHERE b.key = v_key;
    IF NOT FOUND THEN
        v_tat := '-infinity';
        v_booked := '-infinity';
        INSERT INTO flow_buckets (key, tat, booked) VALUES (v_key, v_tat, v_booked)
        ON CONFLICT DO NOTHING;
    END IF;
    IF greatest(v_tat, v_now) <= v_now + v_tau - v_iv
       AND (waiting = v_key || '@rate' OR v_booked <= v_now) THEN
        IF NOT hold THEN
            UPDATE flow_buckets SET tat = greatest(v_tat, v_now) + v_iv WHERE flow_buckets.key = v_key;
        END IF;
        RETURN CASE WHEN hold THEN v_again END;
    END IF;
    IF waiting IS NOT DISTINCT FROM v_key || '@rate' THEN
        -- Late on its reservation (starts bunched ahead of it): the first start the
        -- rate allows, booked, so that jobs late together (a rate lowered under
        -- their reservations) get starts one interval apart, not one herd.
        v_due := greatest(v_now, v_tat - v_tau + v_iv);
        IF hold THEN
            v_due := greatest(v_due, v_booked);
            UPDATE flow_buckets SET booked = v_due + v_iv WHERE flow_buckets.key = v_key;
        END IF;
    ELSIF hold THEN
        v_due := greatest(v_booked, v_now, v_tat - v_tau + v_iv);
        UPDATE flow_buckets SET booked = v_due + v_iv WHERE flow_buckets.key = v_key;
    END IF;
    RETURN jsonb_build_object('code', 'RATE_LIMITED', 'key', v_key || '@rate', 'due', v_due,
        'reason', format('rate limit %s allows %s starts per second: may start at %s',
                         v_lim.name, v_lim.per_second, v_due));
END
$fn$
