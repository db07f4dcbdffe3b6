"""The topology's flow limits in the database, for the claim to read (ADR-0043).

``flow_limits`` holds the ``[[rate_limits]]`` entries (their patterns as the
POSIX regexes ``job_routes`` uses) and ``queue_limits`` each queue's
``max_running_per_tenant``. :func:`sync_flow_limits` writes them in the
transaction of :func:`jobplane.store.routes.sync_submit_rules`, so ``jobplane
migrate``, ``jobplane topology apply`` and every server start keep them as
the topology says; a claim reads them, so a change takes effect at the next
claim, without a restart. A ``[[rate_limits]]`` entry changed or removed
starts afresh: its rate's buckets are reset and the jobs waiting for a start
it reserved are dispatched again now, to be decided under the new entry (a
reservation made under the old rate would hold them to it).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from jobplane.ids import new_id
from jobplane.store.machine import MACHINE, Cause, StateMachine, Transition
from jobplane.store.machine.table import state_is
from jobplane.topics import topic_regex
from jobplane.topology import Topology
from jobplane.types import JobState

_READ_LIMITS = text(
    "SELECT name, rank, patterns, regexes, per_second, burst, max_running, per_tenant "
    "FROM flow_limits ORDER BY rank"
)
_READ_QUEUES = text("SELECT queue, max_running_per_tenant FROM queue_limits ORDER BY queue")
_INSERT_LIMIT = text(
    "INSERT INTO flow_limits (name, rank, patterns, regexes, per_second, burst, max_running, "
    "per_tenant) VALUES (:name, :rank, :patterns, :regexes, :per_second, :burst, :max_running, "
    ":per_tenant)"
)
_INSERT_QUEUE = text(
    "INSERT INTO queue_limits (queue, max_running_per_tenant) VALUES (:queue, :max_running)"
)


# The budgets of the entries named: 'limit/{name}' and 'limit/{name}/{tenant}'.
_RESET_BUCKETS = text(
    "DELETE FROM flow_buckets WHERE split_part(key, '/', 1) = 'limit' "
    "AND split_part(key, '/', 2) = ANY(CAST(:names AS text[]))"
)
# The jobs waiting for a start the entries named reserved ('{key}@rate').
_THROTTLED = text(
    f"SELECT id, tenant_id FROM jobs WHERE {state_is(JobState.QUEUED)} "
    "AND flow_key LIKE 'limit/%@rate' "
    "AND dispatch_id IS NOT NULL "
    "AND split_part(split_part(flow_key, '@', 1), '/', 2) = ANY(CAST(:names AS text[])) "
    "ORDER BY id"
)


def flow_rows(topology: Topology) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows of ``flow_limits`` and ``queue_limits`` ``topology`` says."""
    limits = [
        {
            "name": limit.name,
            "rank": rank,
            "patterns": list(limit.types),
            "regexes": [topic_regex(p) for p in limit.types],
            "per_second": limit.per_second,
            "burst": float(limit.burst),
            "max_running": limit.max_running,
            "per_tenant": limit.per_tenant,
        }
        for rank, limit in enumerate(topology.rate_limits, start=1)
    ]
    queues = [
        {"queue": q.name, "max_running": q.max_running_per_tenant}
        for q in sorted(topology.queues, key=lambda q: q.name)
        if q.max_running_per_tenant > 0
    ]
    return limits, queues


async def sync_flow_limits(conn: AsyncConnection, topology: Topology) -> bool:
    """Make the two tables say what ``topology`` says; whether anything was written.

    Run under the sync's lock, in its transaction."""
    limits, queues = flow_rows(topology)
    current_limits = [dict(r._mapping) for r in await conn.execute(_READ_LIMITS)]
    current_queues = [
        {"queue": r.queue, "max_running": r.max_running_per_tenant}
        for r in await conn.execute(_READ_QUEUES)
    ]
    changed = False
    if current_limits != limits:
        await conn.execute(text("DELETE FROM flow_limits"))
        if limits:
            await conn.execute(_INSERT_LIMIT, limits)
        new = {str(limit["name"]): limit for limit in limits}
        old = [str(limit["name"]) for limit in current_limits if new.get(limit["name"]) != limit]
        await restart_limits(conn, old)
        changed = True
    if current_queues != queues:
        await conn.execute(text("DELETE FROM queue_limits"))
        if queues:
            await conn.execute(_INSERT_QUEUE, queues)
        changed = True
    return changed


async def restart_limits(
    conn: AsyncConnection, names: list[str], machine: StateMachine = MACHINE
) -> int:
    """The entries ``names`` (changed or removed) start afresh: their buckets reset,
    the jobs throttled under them dispatched again now; how many were."""
    if not names:
        return 0
    await conn.execute(_RESET_BUCKETS, {"names": names})
    jobs = (await conn.execute(_THROTTLED, {"names": names})).all()
    cause = Cause("its rate limit changed: dispatched again", {"limits": names})
    params = [{"id": j.id, "tenant_id": j.tenant_id, "dispatch_id": new_id()} for j in jobs]
    if params and machine.groupable(Transition.REDISPATCH):
        binds = [machine.prepare(Transition.REDISPATCH, p, cause) for p in params]
        await machine.apply_many(conn, Transition.REDISPATCH, binds, returning=("id",))
    else:
        for p in params:
            await machine.apply(conn, Transition.REDISPATCH, p, cause, returning=("id",))
    return len(params)
