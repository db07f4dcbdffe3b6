"""Between the public Python types and the protobuf messages, both ways."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf import duration_pb2, json_format, struct_pb2, timestamp_pb2

from jobplane.types import EventType, Job, JobError, JobEvent, JobState
from jobplane.v1 import jobs_pb2

_STATE_TO_PB = {
    JobState.QUEUED: jobs_pb2.Job.STATE_QUEUED,
    JobState.RUNNING: jobs_pb2.Job.STATE_RUNNING,
    JobState.SUCCEEDED: jobs_pb2.Job.STATE_SUCCEEDED,
    JobState.FAILED: jobs_pb2.Job.STATE_FAILED,
    JobState.CANCELLED: jobs_pb2.Job.STATE_CANCELLED,
}
_STATE_FROM_PB: dict[int, JobState] = {int(v): k for k, v in _STATE_TO_PB.items()}

_EVENT_TO_PB = {
    EventType.QUEUED: jobs_pb2.WatchJobResponse.EVENT_TYPE_QUEUED,
    EventType.STARTED: jobs_pb2.WatchJobResponse.EVENT_TYPE_STARTED,
    EventType.PROGRESS: jobs_pb2.WatchJobResponse.EVENT_TYPE_PROGRESS,
    EventType.RETRY_SCHEDULED: jobs_pb2.WatchJobResponse.EVENT_TYPE_RETRY_SCHEDULED,
    EventType.CANCEL_REQUESTED: jobs_pb2.WatchJobResponse.EVENT_TYPE_CANCEL_REQUESTED,
    EventType.SUCCEEDED: jobs_pb2.WatchJobResponse.EVENT_TYPE_SUCCEEDED,
    EventType.FAILED: jobs_pb2.WatchJobResponse.EVENT_TYPE_FAILED,
    EventType.CANCELLED: jobs_pb2.WatchJobResponse.EVENT_TYPE_CANCELLED,
}
_EVENT_FROM_PB: dict[int, EventType] = {int(v): k for k, v in _EVENT_TO_PB.items()}


def state_to_pb(state: JobState) -> jobs_pb2.Job.State.ValueType:
    """The proto enum value of a state."""
    return _STATE_TO_PB[state]


def state_from_pb(value: int) -> JobState | None:
    """The state of a proto enum value; None for STATE_UNSPECIFIED or unknown."""
    return _STATE_FROM_PB.get(value)


def struct_from_dict(value: dict[str, Any] | None) -> struct_pb2.Struct:
    """A Struct holding ``value``."""
    message = struct_pb2.Struct()
    if value:
        message.update(value)
    return message


def dict_from_struct(message: struct_pb2.Struct) -> dict[str, Any]:
    """A plain dict from a Struct.

    Struct numbers are doubles; whole numbers that a double holds exactly come
    back as ``int``, so ``{"steps": 5}`` round-trips as it was sent.
    """
    result: dict[str, Any] = _ints(json_format.MessageToDict(message))
    return result


def _ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


def timestamp(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    """A Timestamp, or None for None."""
    if value is None:
        return None
    message = timestamp_pb2.Timestamp()
    message.FromDatetime(value)
    return message


def duration(value: timedelta) -> duration_pb2.Duration:
    """A Duration."""
    message = duration_pb2.Duration()
    message.FromTimedelta(value)
    return message


def from_timestamp(message: timestamp_pb2.Timestamp) -> datetime:
    """An aware UTC datetime."""
    return message.ToDatetime(tzinfo=UTC)


def job_to_pb(job: Job) -> jobs_pb2.Job:
    """The Job message of a job."""
    message = jobs_pb2.Job(
        name=job.name,
        type=job.type,
        state=state_to_pb(job.state),
        payload=struct_from_dict(job.payload),
        progress=job.progress,
        progress_message=job.progress_message,
        attempt=job.attempt,
        max_attempts=job.max_attempts,
        request_id=job.request_id,
        correlation_id=job.correlation_id,
        labels=job.labels,
        create_time=timestamp(job.create_time),
        update_time=timestamp(job.update_time),
        start_time=timestamp(job.start_time),
        end_time=timestamp(job.end_time),
        next_attempt_time=timestamp(job.next_attempt_time),
        cancel_requested=job.cancel_requested,
        last_seq=job.last_seq,
        timeout=duration(job.timeout),
        waiting_reason=job.waiting_reason,
        attempts_used=job.attempts_used,
    )
    if job.result is not None:
        message.result.CopyFrom(struct_from_dict(job.result))
    if job.error is not None:
        message.error.CopyFrom(
            jobs_pb2.JobError(
                code=job.error.code, message=job.error.message, retryable=job.error.retryable
            )
        )
    return message


def job_from_pb(message: jobs_pb2.Job) -> Job:
    """The public Job of a Job message."""
    state = state_from_pb(message.state)
    if state is None:
        raise ValueError(f"job {message.name} has no state")
    return Job(
        name=message.name,
        type=message.type,
        state=state,
        payload=dict_from_struct(message.payload),
        result=dict_from_struct(message.result) if message.HasField("result") else None,
        error=(
            JobError(
                code=message.error.code,
                message=message.error.message,
                retryable=message.error.retryable,
            )
            if message.HasField("error")
            else None
        ),
        progress=message.progress,
        progress_message=message.progress_message,
        attempt=message.attempt,
        max_attempts=message.max_attempts,
        request_id=message.request_id,
        correlation_id=message.correlation_id,
        labels=dict(message.labels),
        create_time=from_timestamp(message.create_time),
        update_time=from_timestamp(message.update_time),
        start_time=(from_timestamp(message.start_time) if message.HasField("start_time") else None),
        end_time=from_timestamp(message.end_time) if message.HasField("end_time") else None,
        next_attempt_time=(
            from_timestamp(message.next_attempt_time)
            if message.HasField("next_attempt_time")
            else None
        ),
        cancel_requested=message.cancel_requested,
        last_seq=message.last_seq,
        timeout=message.timeout.ToTimedelta(),
        waiting_reason=message.waiting_reason,
        attempts_used=message.attempts_used,
    )


def event_to_pb(event: JobEvent) -> jobs_pb2.WatchJobResponse:
    """The WatchJobResponse of an event."""
    return jobs_pb2.WatchJobResponse(
        name=event.name,
        seq=event.seq,
        type=_EVENT_TO_PB[event.type],
        state=state_to_pb(event.state),
        progress=event.progress,
        message=event.message,
        data=struct_from_dict(event.data),
        event_time=timestamp(event.event_time),
        attempt=event.attempt,
        terminal=event.terminal,
    )


def event_from_pb(message: jobs_pb2.WatchJobResponse) -> JobEvent:
    """The public JobEvent of a WatchJobResponse."""
    state = state_from_pb(message.state)
    event_type = _EVENT_FROM_PB.get(message.type)
    if state is None or event_type is None:
        raise ValueError(f"event {message.seq} of {message.name} has no state or type")
    return JobEvent(
        name=message.name,
        seq=message.seq,
        type=event_type,
        state=state,
        progress=message.progress,
        message=message.message,
        data=dict_from_struct(message.data),
        event_time=from_timestamp(message.event_time),
        attempt=message.attempt,
    )
