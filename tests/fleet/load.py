"""Load across a failover: submitters that never give up, and what the client was told."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from jobplane.client import AsyncClient, JobEvent
from jobplane.errors import Unavailable
from tests.faults.cluster import Cluster, check_stream
from tests.fleet import patroni


class Codes(grpc.aio.UnaryUnaryClientInterceptor):
    """The status of every unary attempt: the SDK repeats UNAVAILABLE, hiding it."""

    def __init__(self) -> None:
        self.seen: Counter[grpc.StatusCode] = Counter()

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        call = await continuation(details, request)
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            self.seen[exc.code()] += 1
        else:
            self.seen[grpc.StatusCode.OK] += 1
        return call

    def refusals(self) -> dict[str, int]:
        """Every code but OK, by name."""
        return {c.name: n for c, n in self.seen.items() if c is not grpc.StatusCode.OK}


@dataclass
class Load:
    """Jobs submitted by several submitters, with when each call began and ended."""

    names: list[str] = field(default_factory=list)
    calls: list[tuple[float, float]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def submitter(self, client: AsyncClient, k: int, ms: int = 100) -> None:
        """Submit until stopped; a call refused for the client's whole budget is repeated
        with the same request_id (it is idempotent)."""
        i = 0
        while not self.stop.is_set():
            request_id = f"fleet-{k}-{i}-{uuid.uuid4().hex[:8]}"
            began = time.monotonic()
            while True:
                try:
                    job = await client.submit(
                        "fault.work", {"ms": ms, "i": i}, request_id=request_id
                    )
                    break
                except Unavailable:
                    continue
            self.names.append(job.name)
            self.calls.append((began, time.monotonic()))
            i += 1
            await asyncio.sleep(0.02)

    def first_ok_after(self, moment: float) -> float:
        """Seconds from ``moment`` to the end of the first submit begun after it."""
        return min(end for began, end in self.calls if began >= moment) - moment

    def longest(self) -> float:
        """The longest submit, repeats included (the client-visible stall)."""
        return max(end - began for began, end in self.calls)

    def ok_after(self, moment: float) -> int:
        """How many submits begun after ``moment`` succeeded."""
        return sum(1 for began, _end in self.calls if began >= moment)


async def until(check: Callable[[], bool], timeout: float = 90, what: str = "") -> None:
    """Until ``check()`` holds (polled)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.05)


async def watch_all(
    client: AsyncClient, names: list[str]
) -> tuple[dict[str, list[JobEvent]], list[asyncio.Task[None]]]:
    """A watch of each of ``names`` in the background (they resume by seq across the failover)."""
    seen: dict[str, list[JobEvent]] = {}

    async def watch(name: str) -> None:
        seen[name] = [event async for event in client.watch(name)]

    return seen, [asyncio.create_task(watch(name)) for name in names]


async def check_watches(
    client: AsyncClient, seen: dict[str, list[JobEvent]], tasks: list[asyncio.Task[None]]
) -> None:
    """**O** on the streams: every watched job's events 1..last_seq, in order."""
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    for name, events in seen.items():
        check_stream(events, (await client.get(name)).last_seq)


def survivors(cluster: Cluster) -> list[str]:
    """The processes that died (none should)."""
    return [" ".join(proc.args) for proc in cluster.procs if not proc.alive]


async def through_bouncer(cluster: Cluster) -> int:
    """Server connections PgBouncer holds to this test's database (its SHOW SERVERS).

    PgBouncer's admin console speaks only the simple query protocol: psql asks.
    """
    database = cluster.database_url.rsplit("/", 1)[1].partition("?")[0]
    process = await asyncio.create_subprocess_exec(
        "psql",
        f"postgresql://postgres:postgres@127.0.0.1:{patroni.BOUNCER_PORT}/pgbouncer",
        "-AtF,",
        "-c",
        "SHOW SERVERS",
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await process.communicate()
    assert process.returncode == 0
    rows = [line.split(",") for line in out.decode().splitlines()]
    return sum(1 for row in rows if len(row) > 2 and row[2] == database)
