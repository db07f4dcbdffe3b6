"""Concurrency keys in the machine: the release statement, and the lock it runs under.

A key's limit is decided in Postgres, by the machine's transitions (ADR-0040):

- CLAIM's guard asks ``jobplane.concurrency_blocker`` (migration 0018), which
  takes the key's transaction-scoped advisory lock and counts the key's
  RUNNING jobs and the older jobs waiting for it; a claim over the limit
  changes nothing.
- HOLD, for the delivery a claim was refused for, asks the same function
  under the same lock: while the key is still full, the job stays QUEUED
  with no dispatch (the message is acked, nothing spins through the broker),
  ``waiting_code`` CONCURRENCY_LIMIT and the job it waits for named.
- RELEASE (:func:`release`'s statement, after :data:`LOCK` in the same
  transaction, so that it reads the key as of the lock) gives the oldest
  held jobs of a key a dispatch again, as many as there are free slots. A
  job made due keeps its code, and its place in line, until its claim.

Whoever ends a RUNNING job of a key (an attempt's outcome, the sweeper's
lease expiry) releases its key after the commit; the sweeper releases every
key with held jobs on each pass (:func:`held_keys`, page by page), so a
release lost to a crash is late, not lost. The hold and the release exclude
each other by the lock: either the release sees the held job, or the hold
sees the free slot and refuses.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

from jobplane.store.machine.table import RULES, Transition, state_is, where_sources
from jobplane.store.rows import JOB_FIELDS
from jobplane.types import JobState, WaitingCode

#: The key's lock, the one ``jobplane.concurrency_blocker`` takes: the
#: statement after it in the transaction sees every claim and hold before it.
LOCK = text(
    "SELECT pg_advisory_xact_lock(hashtextextended("
    "CAST(CAST(:tenant_id AS uuid) AS text) || '/' || CAST(:key AS text), 40))"
)
_CODE = f"'{WaitingCode.CONCURRENCY_LIMIT}'"
# A held job: QUEUED, waiting for its key, without a dispatch. Its index
# (jobs_concurrency_waiting, migration 0018) also holds the jobs made due and
# not claimed yet: the same predicate less the dispatch.
_HELD = (
    f"concurrency_key IS NOT NULL AND {state_is(JobState.QUEUED)} "
    f"AND waiting_code = {_CODE} AND dispatch_id IS NULL"
)
_NEXT_KEY = f"""
    SELECT tenant_id, concurrency_key FROM jobs
    WHERE {_HELD} AND (tenant_id, concurrency_key) > ({{tenant}}, {{key}})
    ORDER BY tenant_id, concurrency_key LIMIT 1
"""
_FIRST_KEY = f"""
    SELECT tenant_id, concurrency_key FROM jobs WHERE {_HELD}
    ORDER BY tenant_id, concurrency_key LIMIT 1
"""


def held_keys(*, after: bool) -> TextClause:
    """Up to ``:limit`` keys with held jobs, in (tenant, key) order: the first
    ones, or (``after``) those after ``(:tenant_id, :key)``. The sweeper's
    repair walks them all, page by page, and releases each.

    A skip scan of the held jobs' index: one index probe per key, however
    many jobs a key holds."""
    first = (
        _NEXT_KEY.format(tenant="CAST(:tenant_id AS uuid)", key="CAST(:key AS text)")
        if after
        else _FIRST_KEY
    )
    step = _NEXT_KEY.format(tenant="k.tenant_id", key="k.concurrency_key")
    return text(
        f"""
        WITH RECURSIVE k AS (
            ({first})
            UNION ALL
            SELECT n.tenant_id, n.concurrency_key FROM k, LATERAL ({step}) n
        )
        SELECT tenant_id, concurrency_key FROM k LIMIT :limit
        """
    )


def _columns(needs: set[str], table: str) -> str:
    return ", ".join(f"{table}.{c}" for c in sorted(needs) if c in JOB_FIELDS) or f"{table}.id"


def release(needs: set[str]) -> str:
    """RELEASE's statement: the oldest held jobs of ``(:tenant_id, :key)`` due again.

    The free slots are the limit of the oldest held job less the key's jobs
    that hold or were promised one: RUNNING, or made due and not claimed yet.
    Run it after :data:`LOCK`, in that lock's transaction.
    """
    rule = RULES[Transition.RELEASE]
    key = "tenant_id = :tenant_id AND concurrency_key = :key"
    waiting = f"{key} AND {where_sources(Transition.RELEASE)} AND waiting_code = {_CODE}"
    # Each count stops at the limit: a key with many held jobs costs what one
    # at its limit does (indexes jobs_concurrency_running, _waiting).
    return f"""
        WITH lim AS (
            SELECT coalesce((
                SELECT concurrency_limit FROM jobs
                WHERE {waiting} AND dispatch_id IS NULL
                ORDER BY create_time, id LIMIT 1), 0) AS n
        ), taken AS (
            SELECT (SELECT count(*) FROM (
                        SELECT 1 FROM jobs WHERE {key} AND {state_is(JobState.RUNNING)}
                        LIMIT (SELECT greatest(n, 0) FROM lim)) r)
                 + (SELECT count(*) FROM (
                        SELECT 1 FROM jobs WHERE {waiting} AND dispatch_id IS NOT NULL
                        LIMIT (SELECT greatest(n, 0) FROM lim)) d) AS n
        ), p AS (
            SELECT jobs.id FROM jobs
            WHERE jobs.id IN (
                SELECT id FROM jobs
                WHERE {waiting} AND dispatch_id IS NULL
                ORDER BY create_time, id
                LIMIT greatest(0, (SELECT n FROM lim) - (SELECT n FROM taken)))
            ORDER BY jobs.id
            FOR UPDATE
        )
        UPDATE jobs SET {rule.sets}, last_seq = jobs.last_seq + 1, update_time = now()
        FROM p
        WHERE jobs.id = p.id AND {where_sources(Transition.RELEASE, "jobs")}
          AND jobs.waiting_code = {_CODE} AND jobs.dispatch_id IS NULL
        RETURNING {_columns(needs, "jobs")},
                  CAST('{Transition.RELEASE}' AS text) AS transition,
                  CAST('queued' AS text) AS from_state
    """
