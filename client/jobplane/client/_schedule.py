"""Delayed jobs in the SDK: a submit's ``schedule_time`` or ``schedule_delay`` on the wire.

The server checks both (docs/scheduling.md); the SDK refuses only what it
cannot send: both at once, and a time without a time zone (which would be
read as UTC whatever the caller meant).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from jobplane.v1 import jobs_pb2


def set_schedule(
    request: jobs_pb2.SubmitJobRequest,
    schedule_time: datetime | None,
    schedule_delay: float | timedelta | None,
) -> None:
    """Set ``request``'s schedule_time or schedule_delay (seconds or a timedelta)."""
    if schedule_time is not None and schedule_delay is not None:
        raise ValueError("schedule_time and schedule_delay: pass one of them")
    if schedule_time is not None:
        if schedule_time.tzinfo is None or schedule_time.utcoffset() is None:
            raise ValueError("schedule_time must be timezone-aware (e.g. datetime.now(UTC))")
        request.schedule_time.FromDatetime(schedule_time)
    elif schedule_delay is not None:
        if not isinstance(schedule_delay, timedelta):
            schedule_delay = timedelta(seconds=schedule_delay)
        request.schedule_delay.FromTimedelta(schedule_delay)


def set_deadline(
    request: jobs_pb2.SubmitJobRequest, deadline: datetime | float | timedelta | None
) -> None:
    """Set ``request``'s deadline (a timezone-aware datetime) or deadline_after (seconds or
    a timedelta, counted from when the server accepts the call)."""
    if isinstance(deadline, datetime):
        if deadline.tzinfo is None or deadline.utcoffset() is None:
            raise ValueError("deadline must be timezone-aware (e.g. datetime.now(UTC))")
        request.deadline.FromDatetime(deadline)
    elif deadline is not None:
        if not isinstance(deadline, timedelta):
            deadline = timedelta(seconds=deadline)
        request.deadline_after.FromTimedelta(deadline)
