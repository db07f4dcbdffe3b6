"""Delayed jobs: when a job may first start, its checks, and how a waiting one reads.

A job submitted with ``schedule_time`` (or ``schedule_delay``, counted from
when the server accepts it) is written at once, QUEUED, with its dispatch due
at that time; the relay publishes nothing before (docs/scheduling.md,
ADR-0039). Nothing is written when the time comes: a QUEUED job whose
schedule_time is still ahead reads as waiting with :attr:`WaitingCode.SCHEDULED`,
decided here at read time.

Pure: the server's checks, the store's rows and the SDK share it.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from jobplane.errors import InvalidArgument
from jobplane.types import Job, JobState, WaitingCode

#: The earliest schedule_time taken: anything before is a mistake (an unset
#: clock, seconds read as milliseconds), not a wish to run now.
MIN_SCHEDULE_TIME = datetime(2000, 1, 1, tzinfo=UTC)
#: ``JOBPLANE_MAX_SCHEDULE_SECONDS`` by default: how far ahead a job may be scheduled.
DEFAULT_MAX_SCHEDULE_SECONDS = 366 * 24 * 3600.0
#: The most that setting may be (ten years).
MAX_SCHEDULE_SECONDS_LIMIT = 10 * 366 * 24 * 3600.0
# protobuf's own range of a Timestamp: 0001-01-01T00:00:00Z .. 9999-12-31T23:59:59.999999999Z.
_MIN_TIMESTAMP_SECONDS = -62_135_596_800
_MAX_TIMESTAMP_SECONDS = 253_402_300_799


def time_from_timestamp(seconds: int, nanos: int, *, field: str) -> datetime:
    """An aware UTC datetime of a Timestamp's fields; INVALID_ARGUMENT outside protobuf's range."""
    if not (
        _MIN_TIMESTAMP_SECONDS <= seconds <= _MAX_TIMESTAMP_SECONDS and 0 <= nanos < 1_000_000_000
    ):
        raise InvalidArgument(
            f"{field} is not a valid Timestamp (seconds={seconds}, nanos={nanos})", field=field
        )
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds, microseconds=nanos // 1000)


def schedule_time_of(
    at: datetime | None,
    delay_seconds: float | None,
    *,
    now: datetime,
    horizon_seconds: float,
) -> datetime | None:
    """When a job submitted at ``now`` may first start; None when neither is set.

    Refuses (INVALID_ARGUMENT, naming the field) both set, a time before
    :data:`MIN_SCHEDULE_TIME` or more than ``horizon_seconds`` after ``now``,
    and a delay that is negative or beyond the horizon. A time already past
    (after 2000) is taken: the job runs at once.
    """
    horizon = timedelta(seconds=horizon_seconds)
    if at is not None and delay_seconds is not None:
        raise InvalidArgument(
            "schedule_delay goes with no schedule_time: set one of them",
            field="schedule_delay",
        )
    if at is not None:
        if at < MIN_SCHEDULE_TIME:
            raise InvalidArgument(
                f"schedule_time must be 2000-01-01T00:00:00Z or later, not {at.isoformat()}",
                field="schedule_time",
            )
        if at > now + horizon:
            raise InvalidArgument(
                f"schedule_time is more than {horizon_seconds:.0f} seconds ahead "
                "(the server's JOBPLANE_MAX_SCHEDULE_SECONDS)",
                field="schedule_time",
                metadata={"limit": f"{horizon_seconds:.0f}"},
            )
        return at
    if delay_seconds is None:
        return None
    if not 0 <= delay_seconds <= horizon_seconds:  # NaN too
        raise InvalidArgument(
            f"schedule_delay must be 0 to {horizon_seconds:.0f} seconds "
            f"(the server's JOBPLANE_MAX_SCHEDULE_SECONDS), not {delay_seconds:g}",
            field="schedule_delay",
            metadata={"limit": f"{horizon_seconds:.0f}"},
        )
    return now + timedelta(seconds=delay_seconds)


def scheduled(job: Job, now: datetime | None = None) -> Job:
    """``job`` as it reads at ``now``: a QUEUED job whose schedule_time is ahead waits,
    :attr:`WaitingCode.SCHEDULED`, unless it already waits for another known reason."""
    if job.state is not JobState.QUEUED or job.schedule_time is None or job.waiting_code:
        return job
    if job.schedule_time <= (now or datetime.now(UTC)):
        return job
    return replace(
        job,
        waiting_code=WaitingCode.SCHEDULED.value,
        waiting_reason=f"scheduled: due at {job.schedule_time.isoformat()}",
    )


def deadline_of(
    at: datetime | None,
    after_seconds: float | None,
    *,
    now: datetime,
    horizon_seconds: float,
    schedule_time: datetime | None = None,
) -> datetime | None:
    """The time by which a job submitted at ``now`` must have ended; None when neither is set.

    Refuses (INVALID_ARGUMENT, naming the field) both set, a deadline not
    after ``now`` (already past) or more than ``horizon_seconds`` after it, an
    ``after_seconds`` not more than 0 or beyond the horizon, and a deadline
    not after the job's ``schedule_time`` (the job could never run). See
    docs/scheduling.md#deadlines.
    """
    if at is not None and after_seconds is not None:
        raise InvalidArgument(
            "deadline_after goes with no deadline: set one of them", field="deadline_after"
        )
    field = "deadline"
    if at is not None:
        if not at > now:
            raise InvalidArgument(
                f"deadline has passed already ({at.isoformat()}, now {now.isoformat()})",
                field="deadline",
            )
        if at > now + timedelta(seconds=horizon_seconds):
            raise InvalidArgument(
                f"deadline is more than {horizon_seconds:.0f} seconds ahead "
                "(the server's JOBPLANE_MAX_SCHEDULE_SECONDS)",
                field="deadline",
                metadata={"limit": f"{horizon_seconds:.0f}"},
            )
        deadline = at
    elif after_seconds is not None:
        if not 0 < after_seconds <= horizon_seconds:  # NaN too
            raise InvalidArgument(
                f"deadline_after must be more than 0, up to {horizon_seconds:.0f} seconds "
                f"(the server's JOBPLANE_MAX_SCHEDULE_SECONDS), not {after_seconds:g}",
                field="deadline_after",
                metadata={"limit": f"{horizon_seconds:.0f}"},
            )
        deadline = now + timedelta(seconds=after_seconds)
        field = "deadline_after"
        if not deadline > now:  # less than the microsecond a time keeps
            raise InvalidArgument(
                "deadline_after must be at least a microsecond", field="deadline_after"
            )
    else:
        return None
    if schedule_time is not None and not deadline > schedule_time:
        raise InvalidArgument(
            f"{field} must be after the job's schedule_time ({schedule_time.isoformat()}): "
            f"the job could never run",
            field=field,
        )
    return deadline
