"""Between the public Python types and the protobuf messages, both ways."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf import duration_pb2, struct_pb2, timestamp_pb2

from jobplane.errors import InvalidArgument
from jobplane.types import (
    BlobRef,
    DependencyFailurePolicy,
    EventType,
    FanOut,
    Job,
    JobError,
    JobEvent,
    JobState,
    Stage,
    StageState,
)
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
    EventType.STAGE_SUCCEEDED: jobs_pb2.WatchJobResponse.EVENT_TYPE_STAGE_SUCCEEDED,
}
_EVENT_FROM_PB: dict[int, EventType] = {int(v): k for k, v in _EVENT_TO_PB.items()}


#: DependencyFailurePolicy's numbers in jobs.proto (0: FAIL).
POLICY_TO_PB: dict[DependencyFailurePolicy, jobs_pb2.DependencyFailurePolicy.ValueType] = {
    DependencyFailurePolicy.FAIL: jobs_pb2.DEPENDENCY_FAILURE_POLICY_FAIL,
    DependencyFailurePolicy.CANCEL: jobs_pb2.DEPENDENCY_FAILURE_POLICY_CANCEL,
    DependencyFailurePolicy.RUN_ANYWAY: jobs_pb2.DEPENDENCY_FAILURE_POLICY_RUN_ANYWAY,
}
POLICY_FROM_PB: dict[int, DependencyFailurePolicy] = {
    0: DependencyFailurePolicy.FAIL,
    **{int(v): k for k, v in POLICY_TO_PB.items()},
}


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
    """A plain dict from a Struct, whatever the Struct holds.

    Struct numbers are doubles; whole numbers that a double holds exactly come
    back as ``int``, so ``{"steps": 5}`` round-trips as it was sent. NaN and
    ±Infinity come back as floats (JSON has no spelling for them, so the
    service refuses them with a field-level reason instead of failing here).
    """
    return {key: _from_value(value) for key, value in message.fields.items()}


def _from_value(value: struct_pb2.Value) -> Any:
    # Recursion is bounded: protobuf refuses to parse messages nested more
    # than 100 deep, before any of this runs.
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return dict_from_struct(value.struct_value)
    if kind == "list_value":
        return [_from_value(v) for v in value.list_value.values]
    if kind == "number_value":
        number = value.number_value
        if number.is_integer() and abs(number) <= 2**53:
            return int(number)
        return number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    # null_value, or a Value with no kind set (JSON has only null for it).
    return None


def state_filter_from_pb(value: int, *, field: str = "state") -> JobState | None:
    """The state a request filters by: None for STATE_UNSPECIFIED.

    An enum value this server does not know is INVALID_ARGUMENT rather than
    "no filter": a newer client's filter must not silently list everything.
    """
    if value == jobs_pb2.Job.STATE_UNSPECIFIED:
        return None
    state = _STATE_FROM_PB.get(value)
    if state is None:
        raise InvalidArgument(f"{field} {value} is not a known job state", field=field)
    return state


# protobuf's own range of a Duration: about ±10,000 years, nanos of the same sign.
MAX_DURATION_SECONDS = 315_576_000_000
_MAX_NANOS = 999_999_999


def seconds_from_duration(message: duration_pb2.Duration, *, field: str) -> float:
    """The seconds of a Duration; INVALID_ARGUMENT when it is not a valid one."""
    seconds, nanos = message.seconds, message.nanos
    if (
        abs(seconds) > MAX_DURATION_SECONDS
        or abs(nanos) > _MAX_NANOS
        or (seconds > 0 and nanos < 0)
        or (seconds < 0 and nanos > 0)
    ):
        raise InvalidArgument(
            f"{field} is not a valid Duration (seconds={seconds}, nanos={nanos})", field=field
        )
    return seconds + nanos / 1e9


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def timestamp(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    """A Timestamp, or None for None."""
    if value is None:
        return None
    if value.tzinfo is UTC:
        # The database's times: every one is a valid Timestamp, counted
        # straight from the epoch (what FromDatetime gives, a fifth of its work).
        delta = value - _EPOCH
        return timestamp_pb2.Timestamp(
            seconds=delta.days * 86_400 + delta.seconds, nanos=value.microsecond * 1000
        )
    message = timestamp_pb2.Timestamp()
    message.FromDatetime(value)
    return message


def duration(value: timedelta) -> duration_pb2.Duration:
    """A Duration."""
    seconds = value.days * 86_400 + value.seconds
    if abs(seconds) < MAX_DURATION_SECONDS:
        # As FromTimedelta normalizes it: the nanos take the sign of the seconds.
        nanos = value.microseconds * 1000
        if seconds < 0 and nanos > 0:
            seconds, nanos = seconds + 1, nanos - 1_000_000_000
        return duration_pb2.Duration(seconds=seconds, nanos=nanos)
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
        waiting_code=job.waiting_code,
        attempts_used=job.attempts_used,
        stage=job.stage,
        stages=[stage_to_pb(stage) for stage in job.stages],
        pipeline_version=job.pipeline_version,
        schedule_time=timestamp(job.schedule_time),
        concurrency_key=job.concurrency_key,
        concurrency_limit=job.concurrency_limit,
        deadline=timestamp(job.deadline),
        after=list(job.after),
        after_failure=(
            POLICY_TO_PB[job.after_failure]
            if job.after
            else jobs_pb2.DEPENDENCY_FAILURE_POLICY_UNSPECIFIED
        ),
        parent=job.parent,
    )
    if job.result is not None:
        message.result.CopyFrom(struct_from_dict(job.result))
    if job.error is not None:
        message.error.CopyFrom(_error_to_pb(job.error))
    if job.payload_blob is not None:
        message.payload_blob.CopyFrom(_blob_ref_to_pb(job.payload_blob))
    if job.result_blob is not None:
        message.result_blob.CopyFrom(_blob_ref_to_pb(job.result_blob))
    if job.fan_out is not None:
        fan = job.fan_out
        message.fan_out.CopyFrom(
            jobs_pb2.FanOut(
                stage=fan.stage, children=fan.children, ended=fan.ended, failed=fan.failed
            )
        )
    return message


def _blob_ref_to_pb(ref: BlobRef) -> jobs_pb2.BlobRef:
    return jobs_pb2.BlobRef(name=ref.name, sha256=ref.sha256, size=ref.size)


def _blob_ref_from_pb(message: jobs_pb2.BlobRef) -> BlobRef:
    return BlobRef(name=message.name, sha256=message.sha256, size=message.size)


def _error_to_pb(error: JobError) -> jobs_pb2.JobError:
    return jobs_pb2.JobError(code=error.code, message=error.message, retryable=error.retryable)


def _error_from_pb(message: jobs_pb2.JobError) -> JobError:
    return JobError(code=message.code, message=message.message, retryable=message.retryable)


_STAGE_STATE_TO_PB: dict[StageState, jobs_pb2.Stage.State.ValueType] = {
    StageState.PENDING: jobs_pb2.Stage.STATE_PENDING,
    StageState.QUEUED: jobs_pb2.Stage.STATE_QUEUED,
    StageState.RUNNING: jobs_pb2.Stage.STATE_RUNNING,
    StageState.SUCCEEDED: jobs_pb2.Stage.STATE_SUCCEEDED,
    StageState.FAILED: jobs_pb2.Stage.STATE_FAILED,
    StageState.CANCELLED: jobs_pb2.Stage.STATE_CANCELLED,
    StageState.SKIPPED: jobs_pb2.Stage.STATE_SKIPPED,
}
_STAGE_STATE_FROM_PB = {int(v): k for k, v in _STAGE_STATE_TO_PB.items()}


def stage_to_pb(stage: Stage) -> jobs_pb2.Stage:
    """The Stage message of a pipeline job's stage."""
    message = jobs_pb2.Stage(
        name=stage.name,
        type=stage.type,
        version=stage.version,
        state=_STAGE_STATE_TO_PB[stage.state],
        attempts=stage.attempts,
        max_attempts=stage.max_attempts,
        timeout=duration(stage.timeout),
        start_time=timestamp(stage.start_time),
        end_time=timestamp(stage.end_time),
        fan_out=stage.fan_out,
        max_failures=stage.max_failures,
        fail_fast=stage.fail_fast,
    )
    if stage.error is not None:
        message.error.CopyFrom(_error_to_pb(stage.error))
    if stage.result is not None:
        message.result.CopyFrom(struct_from_dict(stage.result))
    return message


def stage_from_pb(message: jobs_pb2.Stage) -> Stage:
    """The public Stage of a Stage message (a state it does not know reads as PENDING)."""
    return Stage(
        name=message.name,
        type=message.type,
        version=message.version,
        state=_STAGE_STATE_FROM_PB.get(message.state, StageState.PENDING),
        attempts=message.attempts,
        max_attempts=message.max_attempts,
        timeout=message.timeout.ToTimedelta(),
        start_time=from_timestamp(message.start_time) if message.HasField("start_time") else None,
        end_time=from_timestamp(message.end_time) if message.HasField("end_time") else None,
        error=_error_from_pb(message.error) if message.HasField("error") else None,
        result=dict_from_struct(message.result) if message.HasField("result") else None,
        fan_out=message.fan_out,
        max_failures=message.max_failures,
        fail_fast=message.fail_fast,
    )


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
        error=_error_from_pb(message.error) if message.HasField("error") else None,
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
        waiting_code=message.waiting_code,
        attempts_used=message.attempts_used,
        stage=message.stage,
        stages=tuple(stage_from_pb(s) for s in message.stages),
        pipeline_version=message.pipeline_version,
        payload_blob=(
            _blob_ref_from_pb(message.payload_blob) if message.HasField("payload_blob") else None
        ),
        result_blob=(
            _blob_ref_from_pb(message.result_blob) if message.HasField("result_blob") else None
        ),
        schedule_time=(
            from_timestamp(message.schedule_time) if message.HasField("schedule_time") else None
        ),
        concurrency_key=message.concurrency_key,
        concurrency_limit=message.concurrency_limit,
        deadline=from_timestamp(message.deadline) if message.HasField("deadline") else None,
        after=tuple(message.after),
        after_failure=POLICY_FROM_PB.get(message.after_failure, DependencyFailurePolicy.FAIL),
        parent=message.parent,
        fan_out=(
            FanOut(
                message.fan_out.stage,
                message.fan_out.children,
                message.fan_out.ended,
                message.fan_out.failed,
            )
            if message.HasField("fan_out")
            else None
        ),
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
        stage=event.stage,
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
        stage=message.stage,
    )
