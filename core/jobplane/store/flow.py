"""Flow limits in the store: the release of a limit's slots when its RUNNING jobs end.

A job whose claim counted it against RUNNING limits (``jobs.flow_slots``:
its queue's ``max_running_per_tenant``, the ``max_running`` of the first
``[[rate_limits]]`` entry that matched its type) holds a slot of each while
RUNNING. Whoever ends one (an attempt's outcome, the sweeper's
lease expiry) calls :func:`release_limits` after the commit: for each budget
of those jobs with held jobs, in a transaction of its own, the oldest held
jobs get a dispatch again, as many as are free. See ADR-0043.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from jobplane.store.machine import AnyConn, Row, StateMachine, Transition, fetch_rows
from jobplane.store.machine.flow import ENDED_KEYS, FREE

#: What an end must return for :func:`ended_limits`.
ENDED_COLUMNS = ("flow_slots",)


def ended_limits(rows: Iterable[Row | None]) -> list[str]:
    """The budgets the ended rows held slots of (recorded by their claims)."""
    return sorted({str(k) for row in rows if row is not None for k in row["flow_slots"] or ()})


def held_limits(rows: Iterable[Row]) -> list[str]:
    """The budgets whose running slots hold these held jobs (a start rate's
    reservation, ``…@rate``, is no slot: its job has a dispatch due)."""
    keys = {str(row["flow_key"]) for row in rows if row["flow_key"] is not None}
    return sorted(key for key in keys if not key.endswith("@rate"))


async def limit_keys(conn: AnyConn, ended: Sequence[str]) -> list[str]:
    """Of the budgets ``ended``, those with held jobs."""
    if not ended:
        return []
    return [str(row["key"]) for row in await fetch_rows(conn, ENDED_KEYS, {"keys": list(ended)})]


async def release_limit(conn: AnyConn, machine: StateMachine, key: str) -> int:
    """RELEASE_LIMIT ``key`` on ``conn`` (in a transaction): how many held jobs
    were made due again."""
    rows = await fetch_rows(conn, FREE, {"key": key})
    free = rows[0]["free"] if rows else 0
    params = {"key": key, "free": free}
    return len(await machine.apply(conn, Transition.RELEASE_LIMIT, params, returning=("id",)))
