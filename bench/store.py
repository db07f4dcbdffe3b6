"""`--only store`: Postgres's and the store's CPU per job for submit, claim and succeed,
by group size, one statement at a time on one connection (no server, relay or
worker running): what a statement costs alone, and what grouping saves."""

from __future__ import annotations

import os
import time
import uuid
from typing import TYPE_CHECKING

from bench import procstat
from jobplane.envelope import Envelope
from jobplane.store.attempts import AttemptStore
from jobplane.store.db import Database
from jobplane.store.engine import create_engine
from jobplane.store.jobs import JobStore, NewJob

if TYPE_CHECKING:
    from bench.run import Bench

SIZES = (1, 4, 16, 64)
JOBS = 3200


def _postgres_seconds() -> float:
    tick = os.sysconf("SC_CLK_TCK")
    return sum(p.jiffies for p in procstat.read_processes() if p.comm in procstat.POSTGRES) / tick


async def fig_store(bench: Bench) -> None:
    """Per group size: µs of Postgres CPU and of this process's CPU per job, by statement."""
    from bench.run import Figure

    await bench.stop_all()
    engine = create_engine(bench.database_url, pool_size=1)
    try:
        async with Database(bench.database_url, size=1) as db:
            jobs, attempts = JobStore(engine, db), AttemptStore(db)
            for size in SIZES:
                spent: dict[str, tuple[float, float]] = {}
                marks = [(_postgres_seconds(), time.process_time())]
                created = []
                for _ in range(JOBS // size):
                    news = [
                        NewJob("bench.noop", "q", {}, uuid.uuid4().hex, max_attempts=3)
                        for _ in range(size)
                    ]
                    for result in await jobs.submit_each(bench.tenant, news):
                        assert not isinstance(result, BaseException)
                        created.append(result[0])
                marks.append((_postgres_seconds(), time.process_time()))
                rows = await db.fetch(
                    "SELECT id, dispatch_id, type FROM jobs WHERE id = ANY(CAST(:ids AS uuid[]))",
                    {"ids": [uuid.UUID(j.name.removeprefix("jobs/")) for j in created]},
                )
                envelopes = [
                    Envelope(r["dispatch_id"], r["id"], bench.tenant, r["type"]) for r in rows
                ]
                marks.append((_postgres_seconds(), time.process_time()))
                claimed = []
                for i in range(0, len(envelopes), size):
                    group = [attempts.claim_request(e) for e in envelopes[i : i + size]]
                    claimed += await attempts.claim_many(group)
                marks.append((_postgres_seconds(), time.process_time()))
                for i in range(0, len(claimed), size):
                    outcomes = [
                        attempts.succeeded(c.attempt, {})
                        for c in claimed[i : i + size]
                        if c is not None and c.attempt is not None
                    ]
                    await attempts.finish_many(outcomes)
                marks.append((_postgres_seconds(), time.process_time()))
                n = len(envelopes)
                for name, (a, b) in (("submit", (0, 1)), ("claim", (2, 3)), ("succeed", (3, 4))):
                    spent[name] = (
                        (marks[b][0] - marks[a][0]) * 1e6 / n,
                        (marks[b][1] - marks[a][1]) * 1e6 / n,
                    )
                for name, (postgres, ours) in spent.items():
                    config = {"group": size, "jobs": n}
                    bench.add(
                        Figure(f"store_{name}_postgres_us_g{size}", postgres, "µs/job", config)
                    )
                    bench.add(Figure(f"store_{name}_python_us_g{size}", ours, "µs/job", config))
    finally:
        await engine.dispose()
        await bench.start_all()
