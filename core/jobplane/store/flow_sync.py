"""The topology's flow limits in the database, for the claim to read (ADR-0043).

``flow_limits`` holds the ``[[rate_limits]]`` entries (their patterns as the
POSIX regexes ``job_routes`` uses) and ``queue_limits`` each queue's
``max_running_per_tenant``. :func:`sync_flow_limits` writes them in the
transaction of :func:`jobplane.store.routes.sync_submit_rules`, so ``jobplane
migrate``, ``jobplane topology apply`` and every server start keep them as
the topology says; a claim reads them, so a change takes effect at the next
claim, without a restart.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from jobplane.topics import topic_regex
from jobplane.topology import Topology

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
        changed = True
    if current_queues != queues:
        await conn.execute(text("DELETE FROM queue_limits"))
        if queues:
            await conn.execute(_INSERT_QUEUE, queues)
        changed = True
    return changed
