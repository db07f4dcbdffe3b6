"""Every field of a schedule, as created and as a get, a list and a pause show it
(docs/scheduling.md, "What the schedule shows")."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from jobplane.client import CatchUp, JobTemplate, Overlap, Schedule, Spec
from tests.support.stack import Stack

pytestmark = pytest.mark.stack(worker=False, relay=False)


async def test_every_field_of_a_schedule_reads_back_as_created(stack: Stack) -> None:
    client = stack.client()
    # Ahead of now by years, whenever the test runs: the first run is the start.
    year = datetime.now(UTC).year + 4
    start = datetime(year, 1, 1, 6, tzinfo=UTC)
    end = datetime(year + 1, 1, 1, tzinfo=UTC)
    made = await client.create_schedule(
        "demo.echo",
        {"n": 1, "deep": {"list": [1, 2]}},
        interval=90,
        start_time=start,
        end_time=end,
        jitter=5,
        overlap=Overlap.ALLOW_ALL,
        catch_up=CatchUp.ALL,
        catch_up_limit=7,
        labels={"team": "bi"},
        max_attempts=4,
        attempt_timeout=120,
        description="every 90 s",
        schedule_id="every-90",
    )
    assert made.next_run_time is not None
    assert start <= made.next_run_time <= start + timedelta(seconds=5)
    assert made.create_time is not None and made.update_time is not None
    assert made == Schedule(
        name="schedules/every-90",
        template=JobTemplate(
            type="demo.echo",
            payload={"n": 1, "deep": {"list": [1, 2]}},
            labels={"team": "bi"},
            max_attempts=4,
            timeout_seconds=120.0,
        ),
        spec=Spec(interval_seconds=90.0, start_time=start, end_time=end, jitter_seconds=5.0),
        description="every 90 s",
        overlap=Overlap.ALLOW_ALL,
        catch_up=CatchUp.ALL,
        catch_up_limit=7,
        paused=False,
        next_run_time=made.next_run_time,
        last_run_time=None,
        recent_runs=(),
        runs=0,
        skipped=0,
        last_error="",
        create_time=made.create_time,
        update_time=made.update_time,
    )
    assert await client.get_schedule("every-90") == made
    assert (await client.list_schedules()).schedules == [made]

    paused = await client.pause_schedule(made)
    assert paused.update_time is not None and paused.update_time >= made.update_time
    assert paused == replace(made, paused=True, next_run_time=None, update_time=paused.update_time)
    assert await client.get_schedule("every-90") == paused


async def test_a_cron_schedules_spec_reads_back_with_its_zone(stack: Stack) -> None:
    client = stack.client()
    made = await client.create_schedule(
        "demo.echo", cron="30 2 * * *", time_zone="Europe/Berlin", schedule_id="nightly"
    )
    assert made.spec == Spec(cron="30 2 * * *", time_zone="Europe/Berlin")
    assert made.template == JobTemplate(type="demo.echo")
    assert (made.overlap, made.catch_up, made.catch_up_limit) == (Overlap.SKIP, CatchUp.SKIP, 0)
    assert await client.get_schedule("nightly") == made
