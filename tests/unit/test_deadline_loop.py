"""The sweeper's deadline loop against a fake store: pages, log lines, failures.

docs/operations.md promises one ``job.deadline_exceeded`` line per job ended,
with ``was`` (the state it was in).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
from sqlalchemy.exc import DBAPIError

from jobplane.names import job_name
from jobplane.workers import deadlines
from jobplane.workers.deadlines import DeadlineLoop
from tests.support.logs import module_lines

Lines = list[MutableMapping[str, Any]]


class Store:
    """end_due hands out ``pages`` one by one, then nothing; or raises ``failures``."""

    def __init__(self, pages: list[list[dict[str, Any]]], failures: list[Exception]) -> None:
        self.pages = pages
        self.failures = failures
        self.limits: list[int] = []
        self.next_asked = asyncio.Event()

    async def end_due(self, *, limit: int) -> list[dict[str, Any]]:
        self.limits.append(limit)
        if self.failures:
            raise self.failures.pop(0)
        return self.pages.pop(0) if self.pages else []

    async def seconds_until_next(self) -> float | None:
        self.next_asked.set()
        return None


def _row(state: str) -> dict[str, Any]:
    return {"id": uuid.uuid4(), "tenant_id": uuid.uuid4(), "from_state": state}


def _loop(store: Store, *, limit: int = 2) -> DeadlineLoop:
    engine: Any = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deadlines, "DeadlineStore", lambda _engine: store)
        return DeadlineLoop(engine, poll=0.01, limit=limit)


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Lines]:
    with module_lines(monkeypatch, deadlines, "jobplane.sweeper") as captured:
        yield captured


async def test_every_page_of_due_jobs_is_ended_and_each_job_logged(lines: Lines) -> None:
    pages = [[_row("queued"), _row("running")], [_row("queued"), _row("queued")], [_row("x")]]
    rows = [row for page in pages for row in page]
    store = Store([list(page) for page in pages], [])
    assert await _loop(store).run_once() == 5
    # A full page means more may be due: asked again until a page is short.
    assert store.limits == [2, 2, 2]
    assert lines == [
        {
            "event": "job.deadline_exceeded",
            "log_level": "warning",
            "job": job_name(row["id"]),
            "tenant_id": str(row["tenant_id"]),
            "was": row["from_state"],
        }
        for row in rows
    ]
    empty = Store([], [])
    assert await _loop(empty).run_once() == 0
    assert empty.limits == [2]


async def test_the_loop_says_what_failed_and_goes_on(lines: Lines) -> None:
    transient = DBAPIError("SELECT ...", {}, ConnectionResetError("gone"))
    store = Store([], [transient, RuntimeError("a bug")])
    loop = _loop(store)
    await loop.start()
    try:
        await asyncio.wait_for(store.next_asked.wait(), 5)
    finally:
        await loop.stop()
    events = [(line["event"], line["log_level"]) for line in lines]
    assert events == [("sweeper.db.error", "warning"), ("sweeper.deadlines.error", "error")]
    assert lines[1]["error"] == "RuntimeError: a bug"
    assert len(store.limits) == 3


class _Due(Store):
    """A deadline due at once, every time the loop asks."""

    async def seconds_until_next(self) -> float | None:
        return 0.0


async def test_the_next_deadline_wakes_the_loop_before_its_poll(lines: Lines) -> None:
    store = _Due([], [])
    engine: Any = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deadlines, "DeadlineStore", lambda _engine: store)
        loop = DeadlineLoop(engine, poll=60.0, limit=2)
    await loop.start()
    try:
        for _ in range(100):
            if len(store.limits) >= 3:
                break
            await asyncio.sleep(0.05)
    finally:
        await loop.stop()
    # Looked again at the deadline (at least _MIN_SLEEP later), not a minute later.
    assert len(store.limits) >= 3
    assert lines == []
