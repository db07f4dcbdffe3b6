"""The sweeper's loop outlives any failure of a sweep, and stops without raising it;
a sweep reports and logs what each of its repairs did."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import pytest
import structlog
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import create_async_engine
from structlog.testing import capture_logs

from jobplane.names import job_name
from jobplane.store.sweeps import (
    EventsBehind,
    LeaseRepair,
    Republished,
    RepublishPass,
    SweepStore,
)
from jobplane.workers import sweeper as sweeper_module
from jobplane.workers.sweeper import Sweeper, SweepReport


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


class _BusyStore(_FakeStore):
    """Every repair finds something; what each call was asked is recorded."""

    def __init__(self) -> None:
        super().__init__([])
        self.repairs = [LeaseRepair(2, 1), LeaseRepair(0, 1)]
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self.job, self.dispatch = uuid.uuid4(), uuid.uuid4()

    async def expire_leases(self, **kwargs: Any) -> LeaseRepair:
        self.asked.append(("expire_leases", {k: v for k, v in kwargs.items() if k != "decide"}))
        return self.repairs.pop(0) if self.repairs else LeaseRepair()

    async def release_held(self, *, limit: int) -> int:
        self.asked.append(("release_held", {"limit": limit}))
        return 4

    async def settle_dependencies(self, *, limit: int) -> int:
        self.asked.append(("settle_dependencies", {"limit": limit}))
        return 2

    async def analyze_grown(self, **kwargs: Any) -> list[str]:
        return ["jobs", "outbox"]

    async def republish_unclaimed(self, **kwargs: Any) -> RepublishPass | None:
        self.asked.append(("republish_unclaimed", kwargs))
        return RepublishPass([Republished(self.job, self.dispatch, 2)], 10, True)

    async def stuck_outbox(self, **kwargs: Any) -> int:
        self.asked.append(("stuck_outbox", kwargs))
        return 5

    async def events_behind(self, **kwargs: Any) -> EventsBehind:
        self.asked.append(("events_behind", kwargs))
        return EventsBehind(7, 12.345)


class _Deadlines:
    async def run_once(self) -> int:
        return 3


async def test_a_sweep_reports_and_logs_what_each_repair_did(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A logger not yet used, so that capture_logs sees its lines.
    monkeypatch.setattr(sweeper_module, "log", structlog.get_logger("jobplane.sweeper"))
    # A process started earlier in the run may have set a level above info.
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        await _sweep_and_check()
    finally:
        structlog.configure(**saved)


async def _sweep_and_check() -> None:
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    sweeper = Sweeper(
        engine, batch_size=3, lease_grace=7.0, stuck_after=90.0, republish_after=100.0
    )
    store = _BusyStore()
    sweeper._store = store
    sweeper.deadlines = _Deadlines()  # type: ignore[assignment]
    with capture_logs() as logs:
        report = await sweeper.sweep_once()
    assert report == SweepReport(
        requeued=2, failed=2, stuck_outbox=5, republished=1, events_behind=7, deadlines=3
    )
    # A whole batch of expired leases: the repair runs again until one is short.
    assert store.asked == [
        ("expire_leases", {"grace": 7.0, "limit": 3}),
        ("expire_leases", {"grace": 7.0, "limit": 3}),
        ("release_held", {"limit": 3}),
        ("settle_dependencies", {"limit": 3}),
        ("republish_unclaimed", {"after": 100.0, "scan": 10_000}),
        ("stuck_outbox", {"older_than": 90.0}),
        ("events_behind", {"older_than": 90.0}),
    ]
    lines = {line.pop("event"): line for line in logs if line["log_level"] != "debug"}
    assert lines == {
        "sweeper.keys.released": {"log_level": "info", "jobs": 4},
        "sweeper.dependencies.settled": {"log_level": "warning", "jobs": 2},
        "sweeper.dispatch.republished": {
            "log_level": "warning",
            "job": job_name(store.job),
            "event_id": str(store.dispatch),
            "republish": 2,
            "next_after": 400.0,
        },
        "sweeper.tables.analyzed": {"log_level": "info", "tables": ["jobs", "outbox"]},
        "sweeper.leases.expired": {"log_level": "warning", "requeued": 2, "failed": 2},
        "sweeper.outbox.stuck": {"log_level": "warning", "rows": 5, "older_than": 90.0},
        "sweeper.events.behind": {
            "log_level": "warning",
            "events": 7,
            "oldest_seconds": 12.3,
            "older_than": 90.0,
        },
    }
    # The lost-dispatch pass has a schedule of its own: not due again at once.
    store.asked.clear()
    await sweeper.sweep_once()
    assert "republish_unclaimed" not in [name for name, _ in store.asked]
