"""What the scheduler says of its passes, with the pass itself faked: a line when
a pass did something, a warning when runs are late, and failures by kind."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine

from jobplane.store.schedule_ticks import TickReport
from jobplane.workers import scheduler as scheduler_module
from jobplane.workers.scheduler import LATE_SECONDS, Scheduler
from tests.support.logs import module_lines

Lines = list[MutableMapping[str, Any]]


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Lines]:
    with module_lines(monkeypatch, scheduler_module, "jobplane.scheduler") as captured:
        yield captured


def _scheduler(
    monkeypatch: pytest.MonkeyPatch,
    passes: list[TickReport | Exception],
    spent: asyncio.Event | None = None,
) -> Scheduler:
    async def tick_once(engine: Any, **kwargs: Any) -> TickReport:
        outcome = passes.pop(0) if passes else TickReport(0, 0, 0, 0, 0.0)
        if not passes and spent is not None:
            spent.set()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(scheduler_module, "tick_once", tick_once)
    return Scheduler(create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none"), poll=0.01)


async def test_a_pass_that_did_something_is_one_line(
    lines: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = TickReport(runs=2, skipped=1, refused=1, failed=3, lag_seconds=1.23456)
    scheduler = _scheduler(monkeypatch, [report])
    assert await scheduler.tick_once() == report
    assert lines == [
        {
            "event": "scheduler.ticked",
            "log_level": "info",
            "runs": 2,
            "skipped": 1,
            "refused": 1,
            "failed": 3,
            "lag_seconds": 1.235,
        }
    ]


@pytest.mark.parametrize(
    "report",
    [
        TickReport(runs=1, skipped=0, refused=0, failed=0, lag_seconds=0.0),
        TickReport(runs=0, skipped=0, refused=1, failed=0, lag_seconds=0.0),
        TickReport(runs=0, skipped=0, refused=0, failed=1, lag_seconds=0.0),
    ],
    ids=["runs", "refused", "failed"],
)
async def test_each_kind_of_work_is_said(
    report: TickReport, lines: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _scheduler(monkeypatch, [report]).tick_once()
    assert [line["event"] for line in lines] == ["scheduler.ticked"]


async def test_a_quiet_pass_says_nothing_and_late_runs_are_warned_of(
    lines: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = _scheduler(
        monkeypatch,
        [
            TickReport(runs=0, skipped=4, refused=0, failed=0, lag_seconds=0.0),
            TickReport(runs=0, skipped=0, refused=0, failed=0, lag_seconds=LATE_SECONDS),
            TickReport(runs=0, skipped=0, refused=0, failed=0, lag_seconds=LATE_SECONDS + 0.06),
        ],
    )
    for _ in range(3):
        await scheduler.tick_once()
    assert lines == [{"event": "scheduler.late", "log_level": "warning", "lag_seconds": 10.1}]


async def test_the_loop_says_what_failed_and_goes_on(
    lines: Lines, monkeypatch: pytest.MonkeyPatch
) -> None:
    transient = DBAPIError("SELECT ...", {}, ConnectionResetError("gone"))
    ticked = TickReport(runs=1, skipped=0, refused=0, failed=0, lag_seconds=0.0)
    bug = RuntimeError("a bug")
    spent = asyncio.Event()
    scheduler = _scheduler(monkeypatch, [transient, bug, ticked], spent)
    await scheduler.start()
    try:
        await asyncio.wait_for(spent.wait(), 5)
    finally:
        await scheduler.stop()
    assert [(line["event"], line["log_level"]) for line in lines] == [
        ("scheduler.db.error", "warning"),
        ("scheduler.error", "error"),
        ("scheduler.ticked", "info"),
    ]
    # Each failure line names the error; only the unexpected one carries its traceback.
    assert lines[0] == {
        "event": "scheduler.db.error",
        "log_level": "warning",
        "error": "sqlalchemy.exc.DBAPIError from ConnectionResetError: gone",
    }
    assert lines[1]["error"] == "RuntimeError: a bug"
    assert lines[1]["exc_info"] is bug
