"""Delayed jobs' pure parts: the checks, the waiting code read from the time, the CLI's flags."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from jobplane.client._cli_run import UsageError
from jobplane.client._cli_schedule import parse_at, parse_in
from jobplane.client._schedule import set_schedule
from jobplane.errors import InvalidArgument
from jobplane.scheduling import schedule_time_of, scheduled, time_from_timestamp
from jobplane.types import Job, JobState
from jobplane.v1 import jobs_pb2
from tests.support.jobs import stored_job

NOW = datetime(2026, 12, 6, 12, tzinfo=UTC)
DAY = 86400.0


def _job(state: JobState, at: datetime | None, code: str = "") -> Job:
    return stored_job(
        "jobs/x",
        type="t",
        state=state,
        request_id="r",
        create_time=NOW,
        update_time=NOW,
        waiting_code=code,
        schedule_time=at,
    )


def test_a_time_or_a_delay_gives_the_start() -> None:
    assert schedule_time_of(None, None, now=NOW, horizon_seconds=DAY) is None
    assert schedule_time_of(None, 60, now=NOW, horizon_seconds=DAY) == NOW + timedelta(minutes=1)
    past = datetime(2001, 1, 1, tzinfo=UTC)
    assert schedule_time_of(past, None, now=NOW, horizon_seconds=DAY) == past


@pytest.mark.parametrize(
    ("at", "delay", "field"),
    [
        (NOW, 1.0, "schedule_delay"),
        (datetime(1999, 12, 31, 23, 59, tzinfo=UTC), None, "schedule_time"),
        (NOW + timedelta(days=1, seconds=1), None, "schedule_time"),
        (None, -0.001, "schedule_delay"),
        (None, DAY + 1, "schedule_delay"),
        (None, float("nan"), "schedule_delay"),
    ],
)
def test_bad_schedules_name_their_field(
    at: datetime | None, delay: float | None, field: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        schedule_time_of(at, delay, now=NOW, horizon_seconds=DAY)
    assert info.value.field == field


def test_a_timestamp_outside_protobufs_range_is_refused() -> None:
    assert time_from_timestamp(0, 1000, field="f") == datetime(1970, 1, 1, 0, 0, 0, 1, UTC)
    for seconds, nanos in [(253_402_300_800, 0), (-62_135_596_801, 0), (0, -1), (0, 10**9)]:
        with pytest.raises(InvalidArgument):
            time_from_timestamp(seconds, nanos, field="schedule_time")


def test_only_a_queued_job_not_due_reads_scheduled() -> None:
    ahead = NOW + timedelta(hours=1)
    waiting = scheduled(_job(JobState.QUEUED, ahead), NOW)
    assert waiting.waiting_code == "SCHEDULED" and ahead.isoformat() in waiting.waiting_reason
    assert scheduled(_job(JobState.QUEUED, NOW - timedelta(seconds=1)), NOW).waiting_code == ""
    assert scheduled(_job(JobState.RUNNING, ahead), NOW).waiting_code == ""
    assert scheduled(_job(JobState.QUEUED, None), NOW).waiting_code == ""
    stored = scheduled(_job(JobState.QUEUED, ahead, "UNROUTABLE"), NOW)
    assert stored.waiting_code == "UNROUTABLE"


def test_the_sdk_sets_one_field() -> None:
    request = jobs_pb2.SubmitJobRequest()
    set_schedule(request, None, timedelta(seconds=90))
    assert request.schedule_delay.seconds == 90 and not request.HasField("schedule_time")
    request = jobs_pb2.SubmitJobRequest()
    set_schedule(request, NOW, None)
    assert request.schedule_time.ToDatetime(tzinfo=UTC) == NOW
    with pytest.raises(ValueError, match="one of them"):
        set_schedule(jobs_pb2.SubmitJobRequest(), NOW, 1)
    with pytest.raises(ValueError, match="timezone-aware"):
        set_schedule(jobs_pb2.SubmitJobRequest(), datetime(2027, 1, 1), None)


def test_the_cli_reads_at_and_in() -> None:
    assert parse_in("90") == timedelta(seconds=90)
    assert parse_in("1h30m") == timedelta(minutes=90)
    assert parse_in("2d") == timedelta(days=2)
    assert parse_at("2027-01-31T09:00:00Z") == datetime(2027, 1, 31, 9, tzinfo=UTC)
    for bad in ("-5", "soon", "1x", "", "inf", "nan"):
        with pytest.raises(UsageError):
            parse_in(bad)
    for bad in ("2027-01-31T09:00:00", "tomorrow"):
        with pytest.raises(UsageError):
            parse_at(bad)
