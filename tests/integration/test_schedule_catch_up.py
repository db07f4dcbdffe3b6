"""A schedule's ticks after downtime under CatchUp.ALL's limit, and what a failed
pass tells operators (docs/scheduling.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import structlog
from sqlalchemy import text
from structlog.testing import capture_logs

from jobplane.client import CatchUp, Overlap
from jobplane.schedule_types import SCHEDULE_LABEL
from jobplane.store import schedule_ticks
from jobplane.store.schedule_ticks import tick_once
from tests.support.stack import Stack

pytestmark = pytest.mark.stack(worker=False, relay=False)


async def _request_ids(stack: Stack, name: str) -> list[str]:
    async with stack.engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT request_id FROM jobs WHERE labels->>:label = :name ORDER BY request_id"),
            {"label": SCHEDULE_LABEL, "name": name},
        )
        return [str(r) for (r,) in rows]


async def test_catch_up_all_runs_only_the_newest_ticks_up_to_its_limit(stack: Stack) -> None:
    client = stack.client()
    now = datetime.now(UTC)
    start = now - timedelta(hours=1, minutes=5)
    # Ticks every 10 minutes; the six of the last hour were missed.
    schedule = await client.create_schedule(
        "demo.echo",
        interval=600,
        start_time=start,
        catch_up=CatchUp.ALL,
        catch_up_limit=2,
        overlap=Overlap.ALLOW_ALL,
    )
    async with stack.engine.begin() as conn:
        await conn.execute(
            text("UPDATE schedules SET next_tick = :t, next_run_time = :t WHERE id = :id"),
            {"t": start, "id": schedule.id},
        )
    await tick_once(stack.engine, now=now)
    ticks = [r.rsplit("/", 1)[1] for r in await _request_ids(stack, schedule.name)]
    assert ticks == [(start + timedelta(minutes=m)).isoformat() for m in (50, 60)]


async def test_a_failed_pass_is_logged_naming_its_schedule_and_error(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", cron="* * * * *", schedule_id="zoneless")
    due = schedule.next_run_time
    assert due is not None
    async with stack.engine.begin() as conn:
        await conn.execute(
            text("UPDATE schedules SET time_zone = 'Nowhere/Atlantis' WHERE id = 'zoneless'")
        )
    # A logger not yet used, so that capture_logs sees its line.
    monkeypatch.setattr(schedule_ticks, "log", structlog.get_logger("jobplane.scheduler"))
    with capture_logs() as lines:
        report = await tick_once(stack.engine, now=due + timedelta(seconds=1))
    assert report.failed == 1
    (line,) = [line for line in lines if line["event"] == "scheduler.schedule.failed"]
    assert line["log_level"] == "warning"
    assert line["schedule"] == "schedules/zoneless"
    assert "ZoneInfoNotFoundError" in line["error"]
    seen = await client.get_schedule(schedule)
    assert seen.last_error == f"INTERNAL: {line['error']}"
