"""Flow limits in the store: the release of a limit's slots when its RUNNING jobs end.

A job that started under a limit (``jobs.flow_limited``: a ``[[rate_limits]]``
entry matched its type, or its queue has ``max_running_per_tenant``) holds a
slot while RUNNING. Whoever ends one (an attempt's outcome, the sweeper's
lease expiry) calls :func:`release_limits` after the commit: for each budget
of those jobs with held jobs, in a transaction of its own, the oldest held
jobs get a dispatch again, as many as are free. See ADR-0043.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from jobplane.store.machine import AnyConn, Row, StateMachine, Transition, fetch_rows
from jobplane.store.machine.flow import ENDED_KEYS, FREE

#: What an end must return for :func:`ended_limits`.
ENDED_COLUMNS = ("tenant_id", "type", "queue", "flow_limited")


def ended_limits(rows: Iterable[Row | None]) -> list[tuple[Any, str, str]]:
    """The (tenant, type, queue) of each ended row that held a slot of a limit."""
    return sorted(
        {
            (row["tenant_id"], str(row["type"]), str(row["queue"]))
            for row in rows
            if row is not None and row["flow_limited"]
        },
        key=str,
    )


async def limit_keys(conn: AnyConn, ended: Sequence[tuple[Any, str, str]]) -> list[str]:
    """The budgets ``ended``'s jobs held slots of that have held jobs."""
    if not ended:
        return []
    binds = {
        "tenants": [e[0] for e in ended],
        "types": [e[1] for e in ended],
        "queues": [e[2] for e in ended],
    }
    return [str(row["key"]) for row in await fetch_rows(conn, ENDED_KEYS, binds)]


async def release_limit(conn: AnyConn, machine: StateMachine, key: str) -> int:
    """RELEASE_LIMIT ``key`` on ``conn`` (in a transaction): how many held jobs
    were made due again."""
    rows = await fetch_rows(conn, FREE, {"key": key})
    free = rows[0]["free"] if rows else 0
    params = {"key": key, "free": free}
    return len(await machine.apply(conn, Transition.RELEASE_LIMIT, params, returning=("id",)))
