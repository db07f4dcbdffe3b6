-- jobplane.flow_free, of the flow limits: the topology's [[rate_limits]] and a queue's max_running_per_tenant,
-- decided at the claim (docs/flow-control.md, ADR-0043).
--
-- The current definition, as the migrations leave it in a database. A change is a
-- new migration that installs a copy of this file, frozen as
-- migrations/jobplane/migrations/sql/{revision}_flow_free.sql;
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

-- The RUNNING slots of a key free for held jobs, under the key's lock: its limit
-- less its RUNNING jobs and its jobs made due and not claimed yet; NULL when the key
-- has no limit any more (every held job may go).
CREATE OR REPLACE FUNCTION jobplane.flow_free(key text) RETURNS integer
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, @SCHEMA@, pg_temp
AS $fn$
DECLARE
    v_kind   text := split_part(key, '/', 1);
    v_name   text := split_part(key, '/', 2);
    v_max    integer;
    v_taken  bigint;
    v_due    bigint;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(key, 43));
    IF v_kind = 'queue' THEN
        SELECT q.max_running_per_tenant INTO v_max FROM queue_limits q WHERE q.queue = v_name;
        IF v_max IS NULL THEN
            RETURN NULL;
        END IF;
    ELSE
        SELECT l.max_running INTO v_max FROM flow_limits l WHERE l.name = v_name;
        IF v_max IS NULL THEN
            RETURN NULL;
        END IF;
    END IF;
    v_taken := jobplane.flow_taken(key, v_max, NULL, '-infinity');
    SELECT count(*) INTO v_due FROM (
        SELECT 1 FROM jobs j
         WHERE j.state = 'queued' AND j.flow_key = key AND j.dispatch_id IS NOT NULL
           AND j.waiting_code IN ('RATE_LIMITED', 'TENANT_LIMIT')
         LIMIT greatest(v_max, 0)) d;
    RETURN greatest(0, v_max - v_taken - v_due);
END
$fn$
