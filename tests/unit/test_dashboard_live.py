"""The dashboard's stream pumps: a failing source always ends its stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from jobplane.errors import InternalError, JobNotFound
from jobplane.server.dashboard.live import END, Merged
from jobplane.store.down import DatabaseUnavailable


async def _failing(exc: Exception) -> AsyncIterator[int]:
    yield 1
    raise exc


@pytest.mark.parametrize(
    ("raised", "queued"),
    [
        (ConnectionResetError("connection lost"), DatabaseUnavailable),
        (RuntimeError("a bug"), InternalError),
        (JobNotFound("jobs/x not found"), JobNotFound),
    ],
)
async def test_a_source_that_raises_ends_with_an_error_item(
    raised: Exception, queued: type[Exception]
) -> None:
    merged = Merged()
    merged.add("job", _failing(raised))
    try:
        first = await asyncio.wait_for(merged.queue.get(), 5)
        last = await asyncio.wait_for(merged.queue.get(), 5)
    finally:
        await merged.close()
    assert first == ("job", 1)
    assert last[0] == "job"
    assert isinstance(last[1], queued)


async def test_a_source_that_ends_queues_the_end() -> None:
    async def two() -> AsyncIterator[int]:
        yield 1
        yield 2

    merged = Merged()
    merged.add("job", two())
    items = [await asyncio.wait_for(merged.queue.get(), 5) for _ in range(3)]
    await merged.close()
    assert items == [("job", 1), ("job", 2), ("job", END)]
