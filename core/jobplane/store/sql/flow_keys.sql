-- jobplane.flow_keys, of the flow limits: the topology's [[rate_limits]] and a queue's max_running_per_tenant,
-- decided at the claim (docs/flow-control.md, ADR-0043).
--
-- The current definition, as the migrations leave it in a database. A change is a
-- new migration that installs a copy of this file, frozen as
-- migrations/jobplane/migrations/sql/{revision}_flow_keys.sql;
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

-- The keys of the RUNNING limits a job of (tenant, type, queue) counts against:
-- its queue's per-tenant limit, and the max_running of the first entry that matches
-- its type. Its claim records them (jobs.flow_slots); its end frees a slot of each.
CREATE OR REPLACE FUNCTION jobplane.flow_keys(tenant uuid, jtype text, jqueue text)
RETURNS SETOF text
LANGUAGE sql
STABLE
SET search_path = pg_catalog, @SCHEMA@, pg_temp
AS $fn$
    SELECT 'queue/' || q.queue || '/' || tenant FROM queue_limits q WHERE q.queue = jqueue
    UNION ALL
    SELECT k FROM (
        SELECT CASE WHEN l.max_running IS NOT NULL THEN
                   'limit/' || l.name || CASE WHEN l.per_tenant THEN '/' || tenant ELSE '' END
               END AS k
          FROM flow_limits l
         WHERE ('.' || jtype) ~ ANY (l.regexes)
         ORDER BY l.rank LIMIT 1) f
     WHERE k IS NOT NULL
$fn$
