"""Kill processes at random and watch what may never happen while they die.

- :class:`Supervisor` restarts whatever of its processes died (each restart
  may arm other fault points), until it stops;
- :func:`kill_at_random` SIGKILLs one of them every so often;
- :class:`Peaks` samples a count per group from Postgres in a loop (one
  snapshot per sample) and keeps each group's largest;
- :func:`running_spans` and :func:`most_at_once` rebuild, from the stored
  events, when each job was RUNNING, and how many of a group were at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import asyncpg

from jobplane.store.engine import asyncpg_dsn
from tests.faults.cluster import Cluster, Proc

#: What each kind of process logs once it is up.
READY = {"relay": "relay.connected", "worker": "worker.started", "serve": "server.started"}


class Supervisor:
    """Restarts any of ``procs`` that died, until stopped (``async with``).

    ``faults(proc)``, when given, names the points armed for each restart.
    Between :meth:`hold` and :meth:`release`, nothing is restarted.
    """

    def __init__(
        self, procs: Sequence[Proc], *, faults: Callable[[Proc], str] | None = None
    ) -> None:
        self.procs = list(procs)
        self.faults = faults
        self._held = False
        self._starting: dict[Proc, asyncio.Task[None]] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def hold(self) -> None:
        """Restart nothing more; returns once the restarts under way are done."""
        self._held = True
        await asyncio.gather(*self._starting.values())

    def release(self) -> None:
        """Restart again what died."""
        self._held = False

    async def __aenter__(self) -> Supervisor:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        starting = self._starting
        while not self._stop.is_set():
            for proc in self.procs:
                if self._held or proc.alive or proc in starting:
                    continue
                if self.faults is not None:
                    proc.faults = self.faults(proc)
                starting[proc] = asyncio.create_task(self._start(proc))
            await asyncio.sleep(0.1)
            for proc in [p for p, task in starting.items() if task.done()]:
                await starting.pop(proc)
        await asyncio.gather(*starting.values())

    @staticmethod
    async def _start(proc: Proc) -> None:
        # Dead again before it was up (an armed point fired early): the next round.
        with contextlib.suppress(AssertionError):
            await proc.start(ready=READY[proc.args[0]])


async def kill_at_random(
    procs: Sequence[Proc],
    rng: random.Random,
    *,
    kills: int,
    between: tuple[float, float] = (0.6, 1.4),
    spare: int = 0,
) -> int:
    """SIGKILL a random live one of ``procs`` ``kills`` times, ``between`` seconds apart,
    leaving at least ``spare`` alive; how many were killed."""
    killed = 0
    for _ in range(kills):
        await asyncio.sleep(rng.uniform(*between))
        alive = [p for p in procs if p.alive]
        if len(alive) > spare:
            rng.choice(alive).kill()
            killed += 1
    return killed


class Peaks:
    """The largest count per group that ``sql`` (rows of ``group``, ``n``) returned,
    sampled in a loop on a connection of its own until stopped (``async with``)."""

    def __init__(self, cluster: Cluster, sql: str, *args: Any) -> None:
        self._cluster = cluster
        self._sql = sql
        self._args = args
        self.peak: dict[str, int] = defaultdict(int)
        self.samples = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Peaks:
        conn = await asyncpg.connect(asyncpg_dsn(self._cluster.database_url))
        self._task = asyncio.create_task(self._run(conn))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self, conn: asyncpg.Connection) -> None:
        try:
            while not self._stop.is_set():
                for row in await conn.fetch(self._sql, *self._args):
                    self.peak[row["group"]] = max(self.peak[row["group"]], row["n"])
                self.samples += 1
                await asyncio.sleep(0.05)
        finally:
            await conn.close()


#: When a job was RUNNING: (its group, from, until).
Span = tuple[str, datetime, datetime]


async def running_spans(cluster: Cluster, ids: Sequence[uuid.UUID], group: str) -> list[Span]:
    """Each stretch of each job's history that it was RUNNING, by its events' times.

    A stretch starts with an event whose state is RUNNING after one that was
    not (a claim's ``started``) and ends with the next that is not (its
    outcome, a retry, a lease expired). An event's time is taken inside its
    transaction, before the commit: a claim its key let through only once
    another job's end had committed has a later time than that end.
    ``group`` is the SQL of the job's group (over ``j``).
    """
    rows = await cluster.query(
        f"""
        SELECT j.id, {group} AS grp, e.state, e.event_time
        FROM jobs j JOIN job_events e ON e.job_id = j.id
        WHERE j.id = ANY($1::uuid[]) ORDER BY j.id, e.seq
        """,
        list(ids),
    )
    spans: list[Span] = []
    since: dict[uuid.UUID, datetime] = {}
    for row in rows:
        job, running = row["id"], row["state"] == "running"
        if running and job not in since:
            since[job] = row["event_time"]
        elif not running and job in since:
            spans.append((row["grp"], since.pop(job), row["event_time"]))
    assert not since, f"jobs still RUNNING: {sorted(map(str, since))[:5]}"
    return spans


def most_at_once(spans: Sequence[Span]) -> dict[str, int]:
    """The most spans of each group that overlap at one moment (touching ones do not)."""
    edges: dict[str, list[tuple[datetime, int]]] = defaultdict(list)
    for grp, start, end in spans:
        edges[grp] += [(start, 1), (end, -1)]
    most: dict[str, int] = {}
    for grp, marks in edges.items():
        now = top = 0
        for _, step in sorted(marks):  # at one instant an end (-1) sorts before a start
            now += step
            top = max(top, now)
        most[grp] = top
    return most
