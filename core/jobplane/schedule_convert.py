"""Schedules between :mod:`jobplane.schedule_types` and protobuf, both ways.

The SDK and the server share it, as they share :mod:`jobplane.convert` for jobs.
A value protobuf can carry but a datetime cannot (a Timestamp past year
9999) is refused here, naming its field.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Literal

from google.protobuf import timestamp_pb2

from jobplane.convert import (
    dict_from_struct,
    duration,
    seconds_from_duration,
    struct_from_dict,
    timestamp,
)
from jobplane.errors import InvalidArgument
from jobplane.schedule_spec import CatchUp, Overlap, Spec
from jobplane.schedule_types import JobTemplate, Schedule
from jobplane.v1 import schedules_pb2

__all__ = ["schedule_from_pb", "schedule_to_pb"]

_OVERLAP = {
    Overlap.SKIP: schedules_pb2.Schedule.OVERLAP_POLICY_SKIP,
    Overlap.BUFFER_ONE: schedules_pb2.Schedule.OVERLAP_POLICY_BUFFER_ONE,
    Overlap.ALLOW_ALL: schedules_pb2.Schedule.OVERLAP_POLICY_ALLOW_ALL,
    Overlap.CANCEL_OTHER: schedules_pb2.Schedule.OVERLAP_POLICY_CANCEL_OTHER,
}
_CATCH_UP = {
    CatchUp.SKIP: schedules_pb2.Schedule.CATCH_UP_POLICY_SKIP,
    CatchUp.ONE: schedules_pb2.Schedule.CATCH_UP_POLICY_ONE,
    CatchUp.ALL: schedules_pb2.Schedule.CATCH_UP_POLICY_ALL,
}
_OutputTime = Literal["next_run_time", "last_run_time", "create_time", "update_time"]
_OVERLAP_FROM = {v: k for k, v in _OVERLAP.items()}
_CATCH_UP_FROM = {v: k for k, v in _CATCH_UP.items()}


def _time(message: timestamp_pb2.Timestamp, field: str) -> datetime:
    try:
        return message.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise InvalidArgument(f"{field} is not a valid Timestamp", field=field) from None


def spec_from_pb(message: schedules_pb2.ScheduleSpec, prefix: str = "schedule.spec") -> Spec:
    """The spec's values; its checks are :func:`jobplane.schedule_spec.check_spec`'s."""
    return Spec(
        cron=message.cron,
        time_zone=message.time_zone,
        interval_seconds=seconds_from_duration(message.interval, field=f"{prefix}.interval"),
        start_time=_time(message.start_time, f"{prefix}.start_time")
        if message.HasField("start_time")
        else None,
        end_time=_time(message.end_time, f"{prefix}.end_time")
        if message.HasField("end_time")
        else None,
        jitter_seconds=seconds_from_duration(message.jitter, field=f"{prefix}.jitter"),
    )


def template_from_pb(message: schedules_pb2.JobTemplate, prefix: str) -> JobTemplate:
    """The job template's values (checked by the server as SubmitJob checks them)."""
    return JobTemplate(
        type=message.type,
        payload=dict_from_struct(message.payload),
        labels=dict(message.labels),
        max_attempts=message.max_attempts,
        timeout_seconds=seconds_from_duration(message.timeout, field=f"{prefix}.timeout")
        if message.HasField("timeout")
        else None,
    )


def overlap_from_pb(value: int, field: str = "overlap_policy") -> Overlap | None:
    """An OverlapPolicy of a request (None when unspecified); INVALID_ARGUMENT when unknown."""
    if not value:
        return None
    overlap: Overlap | None = _OVERLAP_FROM.get(value)  # type: ignore[call-overload]
    if overlap is None:
        raise InvalidArgument(f"unknown overlap_policy {value}", field=field)
    return overlap


def overlap_to_pb(overlap: Overlap | None) -> schedules_pb2.Schedule.OverlapPolicy.ValueType:
    """An OverlapPolicy for a request (unspecified for None)."""
    if overlap is None:
        return schedules_pb2.Schedule.OVERLAP_POLICY_UNSPECIFIED
    return _OVERLAP[overlap]


def schedule_from_pb(
    message: schedules_pb2.Schedule, prefix: str = "schedule", *, output: bool = True
) -> Schedule:
    """A Schedule message as plain values. ``output=False`` (a request's schedule):
    the output-only fields are ignored, as AIP-203 has it."""
    overlap = _OVERLAP_FROM.get(message.overlap_policy)
    catch_up = _CATCH_UP_FROM.get(message.catch_up_policy)
    if overlap is None and message.overlap_policy:
        raise InvalidArgument("unknown overlap_policy", field=f"{prefix}.overlap_policy")
    if catch_up is None and message.catch_up_policy:
        raise InvalidArgument("unknown catch_up_policy", field=f"{prefix}.catch_up_policy")
    schedule = Schedule(
        name=message.name,
        template=template_from_pb(message.job, f"{prefix}.job"),
        spec=spec_from_pb(message.spec, f"{prefix}.spec"),
        description=message.description,
        overlap=overlap or Overlap.SKIP,
        catch_up=catch_up or CatchUp.SKIP,
        catch_up_limit=message.catch_up_limit,
    )
    return _with_output(schedule, message) if output else schedule


def _with_output(schedule: Schedule, message: schedules_pb2.Schedule) -> Schedule:
    """``schedule`` with the output-only fields of ``message``."""

    def time(field: _OutputTime) -> datetime | None:
        return _time(getattr(message, field), field) if message.HasField(field) else None

    return replace(
        schedule,
        paused=message.paused,
        next_run_time=time("next_run_time"),
        last_run_time=time("last_run_time"),
        recent_runs=tuple(message.recent_jobs),
        runs=message.run_count,
        skipped=message.skipped_count,
        last_error=message.last_error,
        create_time=time("create_time"),
        update_time=time("update_time"),
    )


def schedule_to_pb(schedule: Schedule) -> schedules_pb2.Schedule:
    """The Schedule message of ``schedule``."""
    spec, template = schedule.spec, schedule.template
    message = schedules_pb2.Schedule(
        name=schedule.name,
        description=schedule.description,
        job=schedules_pb2.JobTemplate(
            type=template.type,
            payload=struct_from_dict(template.payload),
            labels=template.labels,
            max_attempts=template.max_attempts,
            timeout=None
            if template.timeout_seconds is None
            else duration(timedelta(seconds=template.timeout_seconds)),
        ),
        spec=schedules_pb2.ScheduleSpec(
            cron=spec.cron,
            time_zone=spec.time_zone,
            interval=duration(timedelta(seconds=spec.interval_seconds))
            if spec.interval_seconds
            else None,
            start_time=timestamp(spec.start_time),
            end_time=timestamp(spec.end_time),
            jitter=duration(timedelta(seconds=spec.jitter_seconds))
            if spec.jitter_seconds
            else None,
        ),
        overlap_policy=_OVERLAP[schedule.overlap],
        catch_up_policy=_CATCH_UP[schedule.catch_up],
        catch_up_limit=schedule.catch_up_limit,
        paused=schedule.paused,
        next_run_time=timestamp(schedule.next_run_time),
        last_run_time=timestamp(schedule.last_run_time),
        recent_jobs=list(schedule.recent_runs),
        run_count=schedule.runs,
        skipped_count=schedule.skipped,
        last_error=schedule.last_error,
        create_time=timestamp(schedule.create_time),
        update_time=timestamp(schedule.update_time),
    )
    return message
