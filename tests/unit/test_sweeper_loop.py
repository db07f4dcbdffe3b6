"""The sweeper's loop outlives any failure of a sweep, and stops without raising it."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import create_async_engine

from jobplane.store.sweeps import EventsBehind, LeaseRepair, RepublishPass, SweepStore
from jobplane.workers.sweeper import Sweeper


class _FakeStore(SweepStore):
    """Raises the queued failures one sweep at a time, then sweeps nothing."""

    def __init__(self, failures: list[BaseException]) -> None:
        # An engine that is never connected: every statement is faked below.
        super().__init__(create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none"))
        self.failures = failures
        self.sweeps = 0
        self.swept_five = asyncio.Event()

    async def expire_leases(self, **kwargs: Any) -> LeaseRepair:
        self.sweeps += 1
        if self.sweeps >= 5:
            self.swept_five.set()
        if self.failures:
            raise self.failures.pop(0)
        return LeaseRepair()

    async def republish_unclaimed(self, **kwargs: Any) -> RepublishPass | None:
        return RepublishPass([], 0, True)

    async def stuck_outbox(self, **kwargs: Any) -> int:
        return 0

    async def events_behind(self, **kwargs: Any) -> EventsBehind:
        return EventsBehind(0, None)


async def test_the_loop_keeps_sweeping_after_any_failure() -> None:
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    sweeper = Sweeper(engine, interval=0.001)
    store = _FakeStore([RuntimeError("a bug"), PoolTimeout("no pooled connection"), KeyError("k")])
    sweeper._store = store
    await sweeper.start()
    try:
        async with asyncio.timeout(10):
            await store.swept_five.wait()
    finally:
        await sweeper.stop()  # raises nothing, whatever happened before
    assert store.failures == []
