-- jobplane.flow_taken, of the flow limits: the topology's [[rate_limits]] and a queue's max_running_per_tenant,
-- decided at the claim (docs/flow-control.md, ADR-0043).
--
-- The current definition, as the migrations leave it in a database. A change is a
-- new migration that installs a copy of this file, frozen as
-- migrations/jobplane/migrations/sql/{revision}_flow_taken.sql;
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

-- The slots of a key taken, up to lim: its RUNNING jobs (but job) and, ahead of job
-- in line, the older jobs waiting for the key (held, or made due and not claimed yet:
-- its waiting code still the limit's; a job handed back or parked waits for a worker).
-- A RUNNING job of the key is one whose claim counted it against the key
-- (jobs.flow_slots, recorded by the claim): a job that started before the limit
-- existed, or under another entry that governed its type then, is not.
CREATE OR REPLACE FUNCTION jobplane.flow_taken(
    key     text,
    lim     integer,
    job     uuid,
    created timestamptz
) RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, @SCHEMA@, pg_temp
AS $fn$
DECLARE
    v_running bigint;
    v_waiting bigint := 0;
BEGIN
    -- Counted up to the limit, no further (indexes jobs_flow_running, jobs_flow_waiting).
    SELECT count(*) INTO v_running FROM (
        SELECT 1 FROM jobs j
         WHERE j.state = 'running' AND j.flow_slots @> ARRAY[key]
           AND j.id IS DISTINCT FROM job
         LIMIT greatest(lim, 0)) r;
    IF v_running < lim THEN
        SELECT count(*) INTO v_waiting FROM (
            SELECT 1 FROM jobs j
             WHERE j.state = 'queued' AND j.flow_key = key
               AND j.waiting_code IN ('RATE_LIMITED', 'TENANT_LIMIT')
               AND (j.create_time, j.id) < (created, job)
             LIMIT lim - v_running) w;
    END IF;
    RETURN v_running + v_waiting;
END
$fn$
