"""Every long-running part's lifecycle: ``async with`` starts and stops it, ``run()``
is a whole process's life, and the ``started`` fixture stops what a test started."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from jobplane.lifecycle import Lifecycle
from jobplane.server.app import JobplaneServer
from jobplane.workers.relay import Relay
from jobplane.workers.runtime import Worker
from jobplane.workers.sweeper import Sweeper, SweepReport
from tests.support.parts import Started


class _Part(Lifecycle):
    """Records its starts and stops (and the grace of each stop) in ``seen``."""

    def __init__(self, name: str, seen: list[str]) -> None:
        self.name = name
        self.seen = seen

    async def start(self) -> None:
        self.seen.append(f"start {self.name}")

    async def stop(self, grace: float = 5.0) -> None:
        self.seen.append(f"stop {self.name} {grace}")


class _Made:
    """Started when made; ``close()`` stops it (as ``start_stack``'s stack)."""

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    async def close(self) -> None:
        self.seen.append("close made")


@pytest.mark.parametrize("part", [JobplaneServer, Worker, Relay, Sweeper])
def test_every_part_is_a_lifecycle(part: type) -> None:
    assert issubclass(part, Lifecycle)


async def test_async_with_starts_and_stops_with_the_default_grace() -> None:
    seen: list[str] = []

    async def failing_block() -> None:
        async with _Part("p", seen) as part:
            assert part.name == "p" and seen == ["start p"]
            raise RuntimeError("the block failed")

    with pytest.raises(RuntimeError):
        await failing_block()
    assert seen == ["start p", "stop p 5.0"]


async def test_run_serves_until_cancelled_then_stops() -> None:
    seen: list[str] = []
    task = asyncio.create_task(_Part("p", seen).run())
    await asyncio.sleep(0.01)
    assert seen == ["start p"] and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["start p", "stop p 5.0"]


async def test_a_sweeper_sweeps_in_the_background_while_entered() -> None:
    swept = asyncio.Event()

    class _Swept(Sweeper):
        async def sweep_once(self) -> SweepReport:
            swept.set()
            return SweepReport(requeued=0, failed=0, stuck_outbox=0)

    # An engine that is never connected: the sweep is faked.
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    async with _Swept(engine, interval=0.001) as sweeper:
        async with asyncio.timeout(10):
            await swept.wait()
    assert sweeper._task is None


async def test_started_stops_everything_it_started_last_first() -> None:
    seen: list[str] = []

    async def made() -> _Made:
        seen.append("make made")
        return _Made(seen)

    async with AsyncExitStack() as stack:
        started = Started(stack)
        first = await started(_Part("first", seen))
        assert await started(made()) is not None

        async def note(line: str) -> None:
            seen.append(line)

        started.callback(note, "callback")
        assert await started(_Part("graced", seen), grace=0.5) is not first
        seen.append("test")
    assert seen == [
        "start first",
        "make made",
        "start graced",
        "test",
        "stop graced 0.5",
        "callback",
        "close made",
        "stop first 5.0",
    ]
