"""Concurrency keys in the store: reject mode at submit, and a key's release.

A job whose concurrency key is full is refused, not written, in reject mode.

A job submitted with ``concurrency_mode`` REJECT is refused with
:class:`~jobplane.errors.ConcurrencyLimitReached` while its key (per tenant)
already has its limit of jobs in flight: QUEUED or RUNNING. The count is
taken under the key's advisory lock (the one the machine's claim and
release take, :data:`jobplane.store.machine.concurrency.LOCK`), held to the
submit's commit, so of many submits at once exactly the limit's get in.
A request whose request_id the tenant has used is a replay: it is not
counted against its key, and returns the stored job as any replay does.
See ADR-0040.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import text

from jobplane.errors import ConcurrencyLimitReached
from jobplane.names import job_name
from jobplane.store.db import Conn
from jobplane.store.job_submit import NewJob
from jobplane.store.machine import AnyConn, Row, StateMachine, Transition, fetch_rows, state_is
from jobplane.store.machine.concurrency import LOCK
from jobplane.types import ConcurrencyMode, JobState

# The jobs in flight of a key, oldest first, but the batch's own replays.
_IN_FLIGHT = text(
    f"""
    SELECT id FROM jobs
    WHERE tenant_id = :tenant_id AND concurrency_key = :key
      AND {state_is(JobState.QUEUED, JobState.RUNNING)}
      AND request_id <> ALL (CAST(:request_ids AS text[]))
    ORDER BY create_time, id
    LIMIT :limit
    """
)
_TAKEN = text(
    """
    SELECT request_id FROM jobs
    WHERE tenant_id = :tenant_id AND request_id = ANY (CAST(:request_ids AS text[]))
    """
)


def rejects(news: Sequence[NewJob]) -> bool:
    """Whether any of ``news`` is refused, rather than queued, when its key is full."""
    return any(n.concurrency_key and n.concurrency_mode is ConcurrencyMode.REJECT for n in news)


async def refuse_full_keys(
    conn: Conn, tenant_id: uuid.UUID, news: Sequence[NewJob]
) -> dict[int, ConcurrencyLimitReached]:
    """The requests of ``news`` their full key refuses, by index; run in the
    submit's transaction, before its insert (the keys' locks stay to its commit).

    A batch's own jobs count against their key in the batch's order.
    """
    if not rejects(news):
        return {}
    request_ids = [n.request_id for n in news]
    params = {"tenant_id": tenant_id, "request_ids": request_ids}
    taken = {row["request_id"] for row in await conn.fetch(_TAKEN, params)}
    by_key: dict[str, list[int]] = {}
    for i, new in enumerate(news):
        if new.concurrency_key is not None and new.request_id not in taken:
            by_key.setdefault(new.concurrency_key, []).append(i)
    refused: dict[int, ConcurrencyLimitReached] = {}
    # Locks in key order: two batches of the same keys wait, never deadlock.
    for key in sorted(by_key):
        indexes = by_key[key]
        if not rejects([news[i] for i in indexes]):
            continue
        await conn.fetch(LOCK, {"tenant_id": tenant_id, "key": key})
        limit = max(news[i].concurrency_limit for i in indexes)
        holders = [
            job_name(row["id"])
            for row in await conn.fetch(_IN_FLIGHT, {**params, "key": key, "limit": limit})
        ]
        for i in indexes:
            new = news[i]
            if new.concurrency_mode is ConcurrencyMode.REJECT and len(holders) >= (
                new.concurrency_limit
            ):
                refused[i] = _reached(new, holders)
            else:
                holders.append("")  # accepted: it holds a place, not named yet
    return refused


def _reached(new: NewJob, holders: Sequence[str]) -> ConcurrencyLimitReached:
    named = [name for name in holders if name][: new.concurrency_limit]
    return ConcurrencyLimitReached(
        f"concurrency key {new.concurrency_key!r} already has {new.concurrency_limit} "
        f"job(s) in flight: {', '.join(named) or 'in this batch'}",
        metadata={
            "concurrency_key": str(new.concurrency_key),
            "concurrency_limit": str(new.concurrency_limit),
            "holders": ",".join(named),
        },
    )


async def release_key(conn: AnyConn, machine: StateMachine, tenant_id: Any, key: str) -> int:
    """RELEASE ``key`` of ``tenant_id`` on ``conn`` (in a transaction): how many
    held jobs were made due again."""
    params = {"tenant_id": tenant_id, "key": key}
    await fetch_rows(conn, LOCK, params)
    return len(await machine.apply(conn, Transition.RELEASE, params, returning=("id",)))


def ended_keys(rows: Iterable[Row | None]) -> set[tuple[Any, str]]:
    """The (tenant, key) of each changed row that had a concurrency key."""
    return {
        (row["tenant_id"], str(row["concurrency_key"]))
        for row in rows
        if row is not None and row["concurrency_key"] is not None
    }
