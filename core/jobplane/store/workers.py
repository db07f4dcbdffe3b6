"""Worker registrations: which worker processes run, what they handle, until when.

A worker is live while it has not said it stopped and its last heartbeat is
younger than the lifetime it registered with. The hand-back of a job
(:meth:`~jobplane.store.attempts.AttemptStore.hand_back`) asks this table
whether any live worker handles the job's type on its queue.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.engine import autocommit
from jobplane.types import JobState

_REGISTER = text(
    """
    INSERT INTO workers (id, host, pid, types, queues, concurrency, version, expire_time)
    VALUES (:id, :host, :pid, CAST(:types AS text[]), CAST(:queues AS text[]), :concurrency,
            :version, now() + make_interval(secs => :ttl))
    ON CONFLICT (id) DO UPDATE SET heartbeat_time = now(), expire_time = excluded.expire_time,
                                   stop_time = NULL
    """
)
_BEAT = text(
    """
    UPDATE workers SET heartbeat_time = now(), expire_time = now() + make_interval(secs => :ttl)
    WHERE id = :id AND stop_time IS NULL
    RETURNING id
    """
)
# The beat of a registration made over WorkerService: its types and queues
# come back, for the server that holds nothing of it to unpark their jobs.
_RENEW = text(
    """
    UPDATE workers SET heartbeat_time = now(), expire_time = now() + make_interval(secs => :ttl)
    WHERE id = :id AND stop_time IS NULL
    RETURNING types, queues
    """
)
_STOP = text("UPDATE workers SET stop_time = now() WHERE id = :id AND stop_time IS NULL")
_LIST = text(
    """
    SELECT id, host, pid, types, queues, concurrency, version, start_time, heartbeat_time,
           expire_time, stop_time, stop_time IS NULL AND expire_time > now() AS live
    FROM workers
    WHERE (stop_time IS NULL AND expire_time > now())
       OR coalesce(stop_time, expire_time) > now() - make_interval(secs => :dead_for)
    ORDER BY live DESC, start_time DESC
    """
)
# The worker of each running attempt, by its STARTED event (the Python
# worker records its id there); the partial index of RUNNING jobs bounds it.
_RUNNING = text(
    """
    SELECT e.data->>'worker' AS worker, count(*) AS running
    FROM jobs j JOIN job_events e
      ON e.job_id = j.id AND e.attempt = j.attempt AND e.type = 'started'
    WHERE j.state = :running AND j.lease_expires_at IS NOT NULL
    GROUP BY 1
    """
)
_PRUNE = text(
    "DELETE FROM workers "
    "WHERE coalesce(stop_time, expire_time) < now() - make_interval(secs => :older_than)"
)


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One registered worker process."""

    id: uuid.UUID
    host: str
    pid: int
    types: tuple[str, ...]
    queues: tuple[str, ...]
    concurrency: int
    version: str
    start_time: datetime
    heartbeat_time: datetime
    expire_time: datetime
    stop_time: datetime | None
    live: bool

    @property
    def status(self) -> str:
        """``live``, ``stopped`` (said so) or ``lost`` (stopped heartbeating)."""
        if self.live:
            return "live"
        return "stopped" if self.stop_time is not None else "lost"


class WorkerStore:
    """Registers workers, keeps them live, lists them."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._auto = autocommit(engine)

    async def register(
        self,
        worker_id: uuid.UUID,
        *,
        host: str,
        pid: int,
        types: Sequence[str],
        queues: Sequence[str],
        concurrency: int,
        version: str,
        ttl: float,
    ) -> None:
        """Record the worker as live for ``ttl`` seconds (again, if it was)."""
        async with self._auto.connect() as conn:
            await conn.execute(
                _REGISTER,
                {
                    "id": worker_id,
                    "host": host,
                    "pid": pid,
                    "types": list(types),
                    "queues": list(queues),
                    "concurrency": concurrency,
                    "version": version,
                    "ttl": ttl,
                },
            )

    async def beat(self, worker_id: uuid.UUID, *, ttl: float) -> bool:
        """Live for another ``ttl`` seconds; False when the row is gone or stopped."""
        async with self._auto.connect() as conn:
            row = (await conn.execute(_BEAT, {"id": worker_id, "ttl": ttl})).first()
        return row is not None

    async def renew(
        self, worker_id: uuid.UUID, *, ttl: float
    ) -> tuple[list[str], list[str]] | None:
        """:meth:`beat`, returning the worker's types and queues; None when it is gone."""
        async with self._auto.connect() as conn:
            row = (await conn.execute(_RENEW, {"id": worker_id, "ttl": ttl})).first()
        return None if row is None else (list(row[0]), list(row[1]))

    async def stop(self, worker_id: uuid.UUID) -> None:
        """The worker takes no more work (it may still finish what it runs)."""
        async with self._auto.connect() as conn:
            await conn.execute(_STOP, {"id": worker_id})

    async def list(self, *, dead_for: float = 3600.0) -> list[WorkerRecord]:
        """Live workers, then those that stopped or were lost in the last ``dead_for`` s."""
        async with self._auto.connect() as conn:
            rows = (await conn.execute(_LIST, {"dead_for": dead_for})).mappings().all()
        return [
            WorkerRecord(
                id=uuid.UUID(str(r["id"])),
                host=r["host"],
                pid=int(r["pid"]),
                types=tuple(r["types"]),
                queues=tuple(r["queues"]),
                concurrency=int(r["concurrency"]),
                version=r["version"],
                start_time=r["start_time"],
                heartbeat_time=r["heartbeat_time"],
                expire_time=r["expire_time"],
                stop_time=r["stop_time"],
                live=bool(r["live"]),
            )
            for r in rows
        ]

    async def running(self) -> dict[str, int]:
        """Running attempts per worker id (every tenant's, counted); "" for unknown workers."""
        async with self._auto.connect() as conn:
            rows = await conn.execute(_RUNNING, {"running": JobState.RUNNING.value})
            return {str(worker or ""): int(count) for worker, count in rows}

    async def prune(self, *, older_than: float) -> int:
        """Forget workers dead for more than ``older_than`` seconds; how many."""
        async with self._auto.connect() as conn:
            result = await conn.execute(_PRUNE, {"older_than": older_than})
        return int(result.rowcount)
