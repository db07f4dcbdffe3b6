"""What a schedule shows after a trigger or a pass that found a run going: its runs,
skips, held tick, newest runs and errors, and the jobs each overlap policy leaves
(docs/scheduling.md, "Triggering a run by hand" and "overlap policy")."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from jobplane.client import (
    CatchUp,
    FailedPrecondition,
    JobState,
    Overlap,
    Schedule,
    ScheduleNotFound,
)
from jobplane.schedule_types import SCHEDULE_LABEL
from jobplane.store.attempts import AttemptStore
from jobplane.store.schedule_ticks import tick_once
from tests.support.stack import Stack

pytestmark = pytest.mark.stack(worker=False, relay=False)

_CANCEL_REASON = "cancelled by schedules/{}: a newer run started (CANCEL_OTHER)"


async def _row(stack: Stack, schedule_id: str) -> Any:
    """The schedule's row as stored (its uid and held tick are not on the API)."""
    async with stack.engine.connect() as conn:
        found = await conn.execute(
            text("SELECT uid, next_tick, buffered_tick FROM schedules WHERE id = :id"),
            {"id": schedule_id},
        )
        return found.one()


async def _runs(stack: Stack, name: str) -> list[tuple[str, str, str]]:
    """(request_id, state, error_message) of the schedule's jobs, oldest first."""
    async with stack.engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT request_id, state, coalesce(error_message, '') FROM jobs "
                "WHERE labels->>:label = :name ORDER BY create_time, request_id"
            ),
            {"label": SCHEDULE_LABEL, "name": name},
        )
        return [(str(r), str(s), str(e)) for r, s, e in rows]


async def test_a_trigger_counts_one_run_and_leaves_the_schedules_timing_and_error(
    stack: Stack,
) -> None:
    """A trigger adds its run (newest first) and the time it ran; the next tick,
    a held tick, the skips and the newest tick's error are the schedule's still."""
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=3600, overlap=Overlap.BUFFER_ONE)
    held = datetime(2026, 1, 1, 12, tzinfo=UTC)
    async with stack.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE schedules SET last_error = 'BLOB_NOT_FOUND: gone', skipped = 2, "
                "buffered_tick = :held WHERE id = :id"
            ),
            {"held": held, "id": schedule.id},
        )
    before = await _row(stack, schedule.id)
    started = datetime.now(UTC)
    first = await client.trigger_schedule(schedule, request_id="by-hand")
    second = await client.trigger_schedule(schedule)
    ended = datetime.now(UTC)

    assert first.request_id == f"schedules/{before.uid}/trigger/by-hand"
    prefix = f"schedules/{before.uid}/trigger/"
    assert second.request_id.startswith(prefix)
    uuid.UUID(second.request_id.removeprefix(prefix))  # a new run's own id
    seen = await client.get_schedule(schedule)
    assert seen.recent_runs == (second.name, first.name)
    assert (seen.runs, seen.skipped) == (2, 2)
    assert seen.last_error == "BLOB_NOT_FOUND: gone"
    assert seen.next_run_time == schedule.next_run_time
    assert seen.last_run_time is not None and started <= seen.last_run_time <= ended
    after = await _row(stack, schedule.id)
    assert (after.next_tick, after.buffered_tick) == (before.next_tick, held)


async def test_a_trigger_skip_refusal_names_every_run_going_oldest_first(stack: Stack) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=3600)
    ended = await client.trigger_schedule(schedule)
    older = await client.trigger_schedule(schedule)
    newer = await client.trigger_schedule(schedule)
    await client.cancel(ended.name)
    with pytest.raises(FailedPrecondition) as refused:
        await client.trigger_schedule(schedule, request_id="skip", overlap=Overlap.SKIP)
    going = f"{older.name}, {newer.name}"
    assert refused.value.message == (
        f"{schedule.name} has a run going ({going}): overlap_policy SKIP starts none"
    )
    assert refused.value.metadata == {"jobs": going}
    assert (await client.get_schedule(schedule)).runs == 3
    with pytest.raises(ScheduleNotFound) as missing:
        await client.trigger_schedule("schedules/nope")
    assert missing.value.message == "schedules/nope not found"


async def test_a_trigger_cancel_other_cancels_the_queued_run_and_stops_the_running_one(
    stack: Stack,
) -> None:
    client = stack.client()
    schedule = await client.create_schedule("demo.echo", interval=3600)
    queued = await client.trigger_schedule(schedule)
    running = await client.trigger_schedule(schedule)
    await AttemptStore(stack.db, lease_seconds=30.0).claim(await stack.envelope(running.id))
    newest = await client.trigger_schedule(schedule, overlap=Overlap.CANCEL_OTHER)

    reason = _CANCEL_REASON.format(schedule.id)
    gone = await client.get(queued.name)
    assert gone.state is JobState.CANCELLED
    assert gone.error is not None and gone.error.message == reason
    asked = await client.get(running.name)
    assert asked.state is JobState.RUNNING and asked.cancel_requested
    cancel_reason = await stack.scalar(
        "SELECT cancel_reason FROM jobs WHERE id = :id", id=running.id
    )
    assert cancel_reason == reason
    assert (await client.get(newest.name)).state is JobState.QUEUED
    # Each job's newest event says why.
    for job in (queued, running):
        message = await stack.scalar(
            "SELECT message FROM job_events WHERE job_id = :id ORDER BY seq DESC LIMIT 1",
            id=job.id,
        )
        assert message == reason


async def test_a_pass_counts_every_schedules_refused_run_and_a_started_run_clears_the_error(
    stack: Stack,
) -> None:
    client = stack.client()
    made = [
        await client.create_schedule("demo.echo", interval=10, overlap=Overlap.ALLOW_ALL)
        for _ in range(2)
    ]
    due = max(s.next_run_time for s in made if s.next_run_time is not None)
    async with stack.engine.begin() as conn:  # their runs name a blob that is gone
        await conn.execute(
            text("UPDATE schedules SET payload = CAST(:payload AS jsonb)"),
            {"payload": '{"input": "blobs/' + "b" * 64 + '"}'},
        )
    report = await tick_once(stack.engine, now=due + timedelta(seconds=1))
    assert (report.runs, report.skipped, report.refused, report.failed) == (0, 0, 2, 0)
    for schedule in made:
        seen = await client.get_schedule(schedule)
        assert (seen.runs, seen.skipped, seen.recent_runs) == (0, 0, ())
        assert seen.last_error.startswith("BLOB_NOT_FOUND: ")
    async with stack.engine.begin() as conn:
        await conn.execute(text("UPDATE schedules SET payload = '{}'"))
    report = await tick_once(stack.engine, now=due + timedelta(seconds=11))
    assert (report.runs, report.refused) == (2, 0)
    for schedule in made:
        seen = await client.get_schedule(schedule)
        assert (seen.runs, seen.last_error) == (1, "")


async def _missed(stack: Stack, overlap: Overlap) -> tuple[Schedule, datetime, datetime]:
    """A schedule ticking every 10 minutes, catch-up ALL of the newest three, whose
    ticks of the last hour were missed; one run of it queued. The schedule, its
    first missed tick and now."""
    client = stack.client()
    now = datetime.now(UTC).replace(microsecond=0)
    start = now - timedelta(hours=1, minutes=5)
    schedule = await client.create_schedule(
        "demo.echo",
        interval=600,
        start_time=start,
        catch_up=CatchUp.ALL,
        catch_up_limit=3,
        overlap=overlap,
    )
    await client.trigger_schedule(schedule, request_id="going")
    async with stack.engine.begin() as conn:
        await conn.execute(
            text("UPDATE schedules SET next_tick = :t, next_run_time = :t WHERE id = :id"),
            {"t": start, "id": schedule.id},
        )
    return schedule, start, now


# The three missed ticks run, minutes after the start: 40, 50 and 60.
_TICKS = (40, 50, 60)


@pytest.mark.parametrize(
    ("overlap", "states", "skipped", "held"),
    [
        (Overlap.SKIP, ["queued"], 3, None),
        (Overlap.BUFFER_ONE, ["queued"], 2, 40),
        (Overlap.ALLOW_ALL, ["queued"] * 4, 0, None),
        (Overlap.CANCEL_OTHER, ["cancelled"] * 3 + ["queued"], 0, None),
    ],
)
async def test_missed_ticks_while_a_run_goes_follow_the_overlap_policy(
    stack: Stack, overlap: Overlap, states: list[str], skipped: int, held: int | None
) -> None:
    """Every missed tick caught up meets the run going: SKIP skips each, BUFFER_ONE
    holds the oldest and skips the others, ALLOW_ALL runs each and CANCEL_OTHER
    runs each, cancelling the one before it."""
    schedule, start, now = await _missed(stack, overlap)
    uid = (await _row(stack, schedule.id)).uid
    report = await tick_once(stack.engine, now=now)

    runs = await _runs(stack, schedule.name)
    started = len(states) - 1
    tick_keys = [f"schedules/{uid}/{(start + timedelta(minutes=m)).isoformat()}" for m in _TICKS]
    assert [r for r, _, _ in runs] == [f"schedules/{uid}/trigger/going", *tick_keys[:started]]
    assert [s for _, s, _ in runs] == states
    reason = _CANCEL_REASON.format(schedule.id)
    assert [e for _, s, e in runs if s == "cancelled"] == [reason] * states.count("cancelled")
    assert (report.runs, report.skipped, report.refused, report.failed) == (started, skipped, 0, 0)
    if started:
        # Due at the start (the row says so): the lag is the hour and five minutes since.
        assert 3900 <= report.lag_seconds < 3960
    else:
        assert report.lag_seconds == 0.0

    seen = await stack.client().get_schedule(schedule)
    assert (seen.runs, seen.skipped) == (1 + started, skipped)
    assert len(seen.recent_runs) == 1 + started
    names = await _names_by_request(stack, [r for r, _, _ in runs])
    assert list(seen.recent_runs) == names[::-1]  # newest first
    assert seen.last_run_time is not None
    assert (seen.last_run_time == now) is bool(started)
    assert seen.next_run_time == start + timedelta(minutes=70)
    row = await _row(stack, schedule.id)
    assert row.buffered_tick == (None if held is None else start + timedelta(minutes=held))


async def test_missed_ticks_catch_up_skip_runs_none_and_counts_one_skip(stack: Stack) -> None:
    """Catch-up SKIP: the pass that finds only missed ticks starts none and says
    it skipped once, whatever the overlap."""
    client = stack.client()
    now = datetime.now(UTC).replace(microsecond=0)
    start = now - timedelta(hours=1, minutes=5)
    schedule = await client.create_schedule(
        "demo.echo", interval=600, start_time=start, overlap=Overlap.ALLOW_ALL
    )
    async with stack.engine.begin() as conn:
        await conn.execute(
            text("UPDATE schedules SET next_tick = :t, next_run_time = :t WHERE id = :id"),
            {"t": start, "id": schedule.id},
        )
    report = await tick_once(stack.engine, now=now)
    assert (report.runs, report.skipped) == (0, 1)
    seen = await client.get_schedule(schedule)
    assert (seen.runs, seen.skipped, seen.last_run_time) == (0, 1, None)
    assert seen.next_run_time == start + timedelta(minutes=70)


async def _names_by_request(stack: Stack, request_ids: list[str]) -> list[str]:
    """``jobs/{id}`` of the jobs with these request_ids, in their order."""
    names = []
    for request_id in request_ids:
        job_id = await stack.scalar(
            "SELECT id FROM jobs WHERE request_id = :request_id", request_id=request_id
        )
        names.append(f"jobs/{job_id}")
    return names
