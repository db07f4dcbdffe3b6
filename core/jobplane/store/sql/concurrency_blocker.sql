-- jobplane.concurrency_blocker: the job a job of a concurrency key waits for, or NULL
-- when the key has room for it (docs/flow-control.md, ADR-0040).
--
-- The current definition, as the migrations leave it in a database. A change is a
-- new migration that installs a copy of this file, frozen as
-- migrations/jobplane/migrations/sql/{revision}_concurrency_blocker.sql;
-- tests/integration/test_sql_files.py fails while the two disagree
-- (docs/adr/0035-sql-api-as-files.md).
--
-- The state machine's CLAIM and HOLD transitions call it in their guard. It first takes
-- the key's transaction-scoped advisory lock, then counts: VOLATILE, so its query takes
-- a snapshot of its own after the lock, and sees every claim, hold and release that
-- committed before the lock was granted (the statement that calls it took its
-- snapshot before it waited). Under the lock, a key's slots are the jobs RUNNING, and
-- ahead of the job in line, the older jobs waiting for the key (waiting_code
-- CONCURRENCY_LIMIT: held, or made due again and not claimed yet). Calling it twice in
-- one transaction gives the same answer: the lock is still held.
--
-- @SCHEMA@ is where jobplane's tables are, fixed when the function is created.

CREATE OR REPLACE FUNCTION jobplane.concurrency_blocker(
    tenant  uuid,
    key     text,
    lim     integer,
    job     uuid,
    created timestamptz
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, @SCHEMA@, pg_temp
AS $fn$
DECLARE
    v_running bigint;
    v_waiting bigint;
    v_blocker uuid;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(tenant::text || '/' || key, 40));
    -- Counted up to the limit, no further: a key with many jobs waiting costs
    -- what one at its limit does (indexes jobs_concurrency_running and
    -- jobs_concurrency_waiting, migration 0018).
    SELECT count(*) INTO v_running FROM (
        SELECT 1 FROM jobs j
         WHERE j.tenant_id = tenant AND j.concurrency_key = key AND j.id <> job
           AND j.state = 'running'
         LIMIT greatest(lim, 0)) r;
    v_waiting := 0;
    IF v_running < lim THEN
        SELECT count(*) INTO v_waiting FROM (
            SELECT 1 FROM jobs j
             WHERE j.tenant_id = tenant AND j.concurrency_key = key
               AND j.state = 'queued' AND j.waiting_code = 'CONCURRENCY_LIMIT'
               AND (j.create_time, j.id) < (created, job)
             LIMIT lim - v_running) w;
    END IF;
    IF v_running + v_waiting < lim THEN
        RETURN NULL;
    END IF;
    -- Full: the job named is the oldest running one if there is any, else the
    -- oldest in line, each the first of its index.
    SELECT j.id INTO v_blocker FROM jobs j
     WHERE j.tenant_id = tenant AND j.concurrency_key = key AND j.id <> job
       AND j.state = 'running'
     ORDER BY j.create_time, j.id
     LIMIT 1;
    IF v_blocker IS NULL THEN
        SELECT j.id INTO v_blocker FROM jobs j
         WHERE j.tenant_id = tenant AND j.concurrency_key = key
           AND j.state = 'queued' AND j.waiting_code = 'CONCURRENCY_LIMIT'
           AND (j.create_time, j.id) < (created, job)
         ORDER BY j.create_time, j.id
         LIMIT 1;
    END IF;
    RETURN v_blocker;
END
$fn$
