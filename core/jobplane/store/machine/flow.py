"""Flow limits in the machine: the hold a refused claim ends in, and the release of a slot.

A claim of a job that a limit applies to (a ``[[rate_limits]]`` entry of the
topology matches its type, or its queue has ``max_running_per_tenant``) asks
``jobplane.flow_check`` in CLAIM's guard, after its concurrency key
(ADR-0040, ADR-0043). When the claim is refused:

- :func:`hold` is the statement of HOLD and THROTTLE, which it decides
  between, for the delivery refused: asked again under the same locks, the
  key or a RUNNING limit (``max_running``, ``max_running_per_tenant``)
  holds the job without a dispatch (HOLD: ``waiting_code``
  CONCURRENCY_LIMIT, RATE_LIMITED or TENANT_LIMIT), the start rate gives it
  a dispatch due at the start it reserves (THROTTLE: RATE_LIMITED). The
  message is acked either way; nothing spins through the broker. When its
  key has room again and no flow limit applies, no row changes and the
  claim is tried again; when a flow limit applies and has room, the job is
  THROTTLEd with a dispatch due now (a claim tried again might be refused
  again, and its delivery is acked).
- :func:`release` is RELEASE_LIMIT's statement: after ``jobplane.flow_free``
  (which takes the limit's lock and counts the free slots, ``:free``), the
  oldest jobs held for the limit get a dispatch again, as many as are free.

Whoever ends a RUNNING job that started under a limit releases its limits
after the commit (:data:`ENDED_KEYS` names those with held jobs); the
sweeper releases every limit with held jobs on each pass
(:func:`held_flow_keys`), so one lost to a crash is late, not lost.
"""

from __future__ import annotations

from sqlalchemy import TextClause, text

from jobplane.store.machine.admission import LIMITED
from jobplane.store.machine.table import (
    ATTEMPTS_LEFT,
    BY_DISPATCH,
    RULES,
    Transition,
    where_sources,
)
from jobplane.store.rows import JOB_FIELDS
from jobplane.types import WaitingCode

_FLOW_CODES = f"('{WaitingCode.RATE_LIMITED}', '{WaitingCode.TENANT_LIMIT}')"


# A job held for a RUNNING slot of a limit: QUEUED, waiting for it, no dispatch.
def _held(table: str = "") -> str:
    at = f"{table}." if table else ""
    return (
        f"{where_sources(Transition.RELEASE_LIMIT, table)} AND {at}flow_key IS NOT NULL "
        f"AND {at}waiting_code IN {_FLOW_CODES} AND {at}dispatch_id IS NULL"
    )


_HELD = _held()

#: Of the budgets ``:keys`` ended RUNNING jobs held slots of, those with held jobs.
ENDED_KEYS = text(
    f"""
    SELECT f.key FROM unnest(CAST(:keys AS text[])) AS f(key)
    WHERE EXISTS (SELECT 1 FROM jobs WHERE flow_key = f.key AND {_HELD})
    ORDER BY f.key
    """
)
#: The free slots of ``:key``, under its lock (NULL: it has no limit any more).
FREE = text("SELECT jobplane.flow_free(:key) AS free")


def held_flow_keys() -> TextClause:
    """Up to ``:limit`` budgets with held jobs, in order, after ``:after`` ('' for the first).

    A skip scan of the waiting jobs' index (jobs_flow_waiting): one index
    probe per budget, however many jobs a budget holds."""
    step = f"SELECT flow_key FROM jobs WHERE {_HELD} AND flow_key > {{after}} "
    step += "ORDER BY flow_key LIMIT 1"
    return text(
        f"""
        WITH RECURSIVE k AS (
            ({step.format(after="CAST(:after AS text)")})
            UNION ALL
            SELECT n.flow_key FROM k, LATERAL ({step.format(after="k.flow_key")}) n
        )
        SELECT flow_key FROM k LIMIT :limit
        """
    )


_KNOWN = frozenset({*JOB_FIELDS, "flow_key", "flow_slots"})


def _columns(needs: set[str], table: str) -> str:
    return ", ".join(f"{table}.{c}" for c in sorted(needs) if c in _KNOWN) or f"{table}.id"


def hold(needs: set[str]) -> str:
    """HOLD's and THROTTLE's statement: the refused delivery's job held, or throttled.

    Each function is called once for the row (materialized CTEs): the key
    first; the flow limits only when the key admits it.
    """
    columns = "id, tenant_id, type, queue, create_time, concurrency_key, concurrency_limit"
    return f"""
        WITH c AS MATERIALIZED (
            SELECT {columns}, flow_key, {LIMITED} AS limited FROM jobs
            WHERE {BY_DISPATCH} AND type = :type AND {where_sources(Transition.HOLD)}
              AND {ATTEMPTS_LEFT}
            FOR UPDATE
        ), k AS MATERIALIZED (
            SELECT c.*, CASE WHEN c.concurrency_key IS NOT NULL THEN
                jobplane.concurrency_blocker(c.tenant_id, c.concurrency_key,
                                             c.concurrency_limit, c.id, c.create_time)
                END AS blocker
            FROM c
        ), f AS MATERIALIZED (
            SELECT k.id, k.blocker, CASE WHEN k.blocker IS NULL AND k.limited THEN
                jobplane.flow_check(k.tenant_id, k.type, k.queue, k.id, k.create_time,
                                    k.flow_key, true)
                END AS h
            FROM k
        ), d AS (
            SELECT id, blocker, h ->> 'code' AS code, h ->> 'key' AS key,
                   h ->> 'reason' AS reason, CAST(h ->> 'due' AS timestamptz) AS due
            FROM f WHERE blocker IS NOT NULL OR h IS NOT NULL
        )
        UPDATE jobs SET
            dispatch_id = CASE WHEN d.due IS NULL THEN NULL ELSE gen_random_uuid() END,
            next_attempt_time = d.due,
            waiting_code = CASE WHEN d.blocker IS NOT NULL
                THEN '{WaitingCode.CONCURRENCY_LIMIT}' ELSE d.code END,
            waiting_reason = CASE WHEN d.blocker IS NOT NULL
                THEN format('waiting for jobs/%s: concurrency key %s allows %s running at once',
                            d.blocker, jobs.concurrency_key, jobs.concurrency_limit)
                ELSE d.reason END,
            flow_key = CASE WHEN d.blocker IS NOT NULL THEN NULL ELSE d.key END,
            last_seq = jobs.last_seq + 1, update_time = now()
        FROM d
        WHERE jobs.id = d.id
        RETURNING {_columns(needs, "jobs")},
                  CAST(CASE WHEN d.due IS NULL THEN '{Transition.HOLD}'
                       ELSE '{Transition.THROTTLE}' END AS text) AS transition,
                  CAST('queued' AS text) AS from_state
    """


def release(needs: set[str]) -> str:
    """RELEASE_LIMIT's statement: the oldest jobs held for ``:key`` due again, ``:free``
    of them (NULL: all). Run it after :data:`FREE`, in that lock's transaction."""
    rule = RULES[Transition.RELEASE_LIMIT]
    return f"""
        WITH p AS (
            SELECT jobs.id FROM jobs
            WHERE jobs.id IN (
                SELECT id FROM jobs WHERE flow_key = :key AND {_HELD}
                ORDER BY create_time, id
                LIMIT CAST(:free AS integer))
            ORDER BY jobs.id
            FOR UPDATE
        )
        UPDATE jobs SET {rule.sets}, last_seq = jobs.last_seq + 1, update_time = now()
        FROM p
        WHERE jobs.id = p.id AND jobs.flow_key = :key AND {_held("jobs")}
        RETURNING {_columns(needs, "jobs")},
                  CAST('{Transition.RELEASE_LIMIT}' AS text) AS transition,
                  CAST('queued' AS text) AS from_state
    """
