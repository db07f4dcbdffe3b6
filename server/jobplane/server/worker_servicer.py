"""WorkerService over gRPC: a thin adapter between protobuf and :class:`WorkerService`."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import grpc

from jobplane.convert import dict_from_struct, duration, seconds_from_duration, struct_from_dict
from jobplane.envelope import Envelope
from jobplane.errors import InvalidArgument
from jobplane.names import job_name
from jobplane.scheduling import time_from_timestamp
from jobplane.server.auth import current_worker
from jobplane.server.status import error_for, to_grpc_status
from jobplane.server.worker_protocol import (
    REGISTRATION_TTL,
    RENEW_INTERVAL,
    Claimed,
    Fence,
    Registration,
    WorkerService,
    parse_worker_name,
    worker_name,
)
from jobplane.store.attempts import Attempt, ClaimStatus, HandBack, ProgressUpdate
from jobplane.v1 import workers_pb2, workers_pb2_grpc
from jobplane.workers.children import ChildRequest

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Context = grpc.aio.ServicerContext[Any, Any]

_STATUS = {
    ClaimStatus.CLAIMED: workers_pb2.ClaimJobResponse.STATUS_CLAIMED,
    ClaimStatus.FINISHED: workers_pb2.ClaimJobResponse.STATUS_FINISHED,
    ClaimStatus.STALE: workers_pb2.ClaimJobResponse.STATUS_STALE,
    ClaimStatus.IN_FLIGHT: workers_pb2.ClaimJobResponse.STATUS_IN_FLIGHT,
    ClaimStatus.NOT_FOUND: workers_pb2.ClaimJobResponse.STATUS_NOT_FOUND,
    ClaimStatus.EXHAUSTED: workers_pb2.ClaimJobResponse.STATUS_EXHAUSTED,
    # Held by its concurrency key, without a dispatch: the message is stale now.
    ClaimStatus.HELD: workers_pb2.ClaimJobResponse.STATUS_STALE,
}

_HAND_BACK = {
    HandBack.HANDED_BACK: workers_pb2.HandBackJobResponse.STATUS_HANDED_BACK,
    HandBack.PARKED: workers_pb2.HandBackJobResponse.STATUS_PARKED,
    HandBack.NOT_QUEUED: workers_pb2.HandBackJobResponse.STATUS_NOT_QUEUED,
    HandBack.NOT_FOUND: workers_pb2.HandBackJobResponse.STATUS_NOT_FOUND,
}


def _worker_call(
    method: Callable[[WorkerServiceServicer, Req], Awaitable[Resp]],
) -> Callable[[WorkerServiceServicer, Req, Context], Awaitable[Resp]]:
    """Run for an admitted worker key; any failure becomes its rich status."""

    @functools.wraps(method)
    async def wrapper(self: WorkerServiceServicer, request: Req, context: Context) -> Resp:
        try:
            current_worker()  # fail closed if served without the worker gate
            return await method(self, request)
        except Exception as exc:
            await context.abort_with_status(to_grpc_status(error_for(exc, method.__name__)))
        raise AssertionError("unreachable: abort raises")

    return wrapper


def _stage_fields(attempt: Attempt) -> tuple[str, str, dict[str, Any] | None]:
    """The pipeline stage of an attempt (stage, version, inputs), empty when it has none.

    Read by name, so that it serves an :class:`Attempt` with or without stages:
    ``attempt.stage`` is a stage run (``name``, ``version``, ``inputs``: the
    results of the stages before it, by stage name) or None for a plain job.
    """
    stage: Any = getattr(attempt, "stage", None)
    if stage is None:
        return "", "", None
    name = getattr(stage, "name", None)
    version = getattr(stage, "version", None)
    inputs = getattr(stage, "inputs", None)
    return (
        name if isinstance(name, str) else "",
        version if isinstance(version, str) else "",
        {str(k): v for k, v in inputs.items()} if isinstance(inputs, Mapping) else None,
    )


def _fence(ref: workers_pb2.AttemptRef, present: bool) -> Fence:
    if not present:
        raise InvalidArgument(
            "attempt is required: the AttemptRef ClaimJob returned", field="attempt"
        )
    return Fence.parse(ref.job, ref.attempt, ref.lease_token)


def _reports(
    reports: Iterable[workers_pb2.Progress], *, required: bool = False
) -> list[ProgressUpdate]:
    return WorkerService.reports(
        [(r.progress, r.message, dict_from_struct(r.data)) for r in reports], required=required
    )


def _lease_expire_time(seconds: float) -> Any:
    # The database's clock sets the lease; the server's tells the worker about when.
    return datetime.now(UTC) + timedelta(seconds=seconds)


def claim_to_pb(claimed: Claimed) -> workers_pb2.ClaimJobResponse:
    """The ClaimJob answer for a claim."""
    result = claimed.result
    reply = workers_pb2.ClaimJobResponse(
        status=(
            workers_pb2.ClaimJobResponse.STATUS_OTHER_DEPLOYMENT
            if claimed.other_deployment
            else _STATUS[result.status]
        )
    )
    if result.status is ClaimStatus.IN_FLIGHT:
        reply.retry_after.CopyFrom(duration(timedelta(seconds=claimed.retry_after)))
    attempt = result.attempt
    if attempt is None:
        return reply
    reply.attempt.CopyFrom(
        workers_pb2.AttemptRef(
            job=job_name(attempt.job_id),
            attempt=attempt.attempt,
            lease_token=str(attempt.lease_token),
        )
    )
    reply.type = attempt.type
    reply.payload.CopyFrom(struct_from_dict(attempt.payload))
    reply.max_attempts = attempt.max_attempts
    reply.attempts_left = max(0, attempt.attempts_left)
    reply.timeout.CopyFrom(duration(timedelta(seconds=attempt.timeout_seconds)))
    reply.lease_expire_time.FromDatetime(_lease_expire_time(claimed.lease_seconds))
    reply.lease_duration.CopyFrom(duration(timedelta(seconds=claimed.lease_seconds)))
    reply.correlation_id = attempt.correlation_id
    reply.request_id = attempt.request_id
    stage, version, inputs = _stage_fields(attempt)
    reply.stage = stage
    reply.stage_version = version
    if inputs is not None:
        reply.inputs.CopyFrom(struct_from_dict(inputs))
    _fan_fields(reply, getattr(attempt, "stage", None))
    return reply


def _fan_fields(reply: workers_pb2.ClaimJobResponse, stage: Any) -> None:
    """A stage's fan-out (ADR-0047): whether it spawns the next stage's children,
    and the results of the children it joins, in item order."""
    reply.fans_out = bool(getattr(stage, "fans_out", False))
    for item in getattr(stage, "results", None) or ():
        message = workers_pb2.ItemResult(
            index=item.index,
            job=item.job,
            state=item.state.name,
            error_code=item.error.code if item.error else "",
            error_message=item.error.message if item.error else "",
        )
        if item.result is not None:
            message.result.CopyFrom(struct_from_dict(dict(item.result)))
        reply.results.append(message)


class WorkerServiceServicer(workers_pb2_grpc.WorkerServiceServicer):
    """The WorkerService RPCs, for worker keys :class:`~jobplane.server.auth.CallGate` admitted."""

    def __init__(self, service: WorkerService) -> None:
        self._service = service

    @_worker_call
    async def ClaimJob(self, request: workers_pb2.ClaimJobRequest) -> workers_pb2.ClaimJobResponse:
        return claim_to_pb(await self._service.claim(self._envelope(request)))

    def _envelope(
        self, request: workers_pb2.ClaimJobRequest | workers_pb2.HandBackJobRequest
    ) -> Envelope:
        return self._service.envelope(
            request.message_body,
            event_id=request.event_id,
            job_id=request.job_id,
            tenant_id=request.tenant_id,
            job_type=request.type,
        )

    @_worker_call
    async def Heartbeat(
        self, request: workers_pb2.HeartbeatRequest
    ) -> workers_pb2.HeartbeatResponse:
        fence = _fence(request.attempt, request.HasField("attempt"))
        cancel = await self._service.heartbeat(fence)
        reply = workers_pb2.HeartbeatResponse(cancel_requested=cancel)
        reply.lease_expire_time.FromDatetime(_lease_expire_time(self._service.lease_seconds))
        return reply

    @_worker_call
    async def ReportProgress(
        self, request: workers_pb2.ReportProgressRequest
    ) -> workers_pb2.ReportProgressResponse:
        fence = _fence(request.attempt, request.HasField("attempt"))
        updates = _reports(request.reports, required=True)
        cancel = await self._service.progress(fence, updates)
        return workers_pb2.ReportProgressResponse(cancel_requested=cancel)

    @_worker_call
    async def CompleteJob(
        self, request: workers_pb2.CompleteJobRequest
    ) -> workers_pb2.CompleteJobResponse:
        fence = _fence(request.attempt, request.HasField("attempt"))
        pending = _reports(request.reports)
        items = [dict_from_struct(item) for item in request.items]
        await self._service.complete(
            fence,
            dict_from_struct(request.result),
            pending,
            items=items,
            has_result=request.HasField("result"),
        )
        return workers_pb2.CompleteJobResponse()

    @_worker_call
    async def FailJob(self, request: workers_pb2.FailJobRequest) -> workers_pb2.FailJobResponse:
        fence = _fence(request.attempt, request.HasField("attempt"))
        pending = _reports(request.reports)
        delay = (
            seconds_from_duration(request.retry_delay, field="retry_delay")
            if request.HasField("retry_delay")
            else None
        )
        failed = await self._service.fail(
            fence,
            request.code,
            request.message,
            retryable=request.retryable,
            delay=delay,
            pending=pending,
        )
        reply = workers_pb2.FailJobResponse(retry_scheduled=failed.retry_scheduled)
        if failed.delay is not None:
            reply.retry_delay.CopyFrom(duration(timedelta(seconds=failed.delay)))
        return reply

    @_worker_call
    async def ReportCancelled(
        self, request: workers_pb2.ReportCancelledRequest
    ) -> workers_pb2.ReportCancelledResponse:
        fence = _fence(request.attempt, request.HasField("attempt"))
        await self._service.cancelled(fence, _reports(request.reports))
        return workers_pb2.ReportCancelledResponse()

    @_worker_call
    async def RegisterWorker(
        self, request: workers_pb2.RegisterWorkerRequest
    ) -> workers_pb2.RegisterWorkerResponse:
        registration = self._service.registration(
            Registration(
                types=list(request.types),
                queues=list(request.queues),
                concurrency=request.concurrency,
                host=request.host,
                pid=request.pid,
                version=request.version,
            )
        )
        worker_id = await self._service.register(registration)
        return workers_pb2.RegisterWorkerResponse(
            name=worker_name(worker_id),
            ttl=duration(timedelta(seconds=REGISTRATION_TTL)),
            renew_interval=duration(timedelta(seconds=RENEW_INTERVAL)),
        )

    @_worker_call
    async def RenewWorker(
        self, request: workers_pb2.RenewWorkerRequest
    ) -> workers_pb2.RenewWorkerResponse:
        await self._service.renew(parse_worker_name(request.name))
        return workers_pb2.RenewWorkerResponse()

    @_worker_call
    async def StopWorker(
        self, request: workers_pb2.StopWorkerRequest
    ) -> workers_pb2.StopWorkerResponse:
        await self._service.stop_worker(parse_worker_name(request.name))
        return workers_pb2.StopWorkerResponse()

    @_worker_call
    async def HandBackJob(
        self, request: workers_pb2.HandBackJobRequest
    ) -> workers_pb2.HandBackJobResponse:
        status, reason, other = await self._service.hand_back(self._envelope(request))
        return workers_pb2.HandBackJobResponse(
            status=(
                workers_pb2.HandBackJobResponse.STATUS_OTHER_DEPLOYMENT
                if other
                else _HAND_BACK[status]
            ),
            waiting_reason=reason,
        )

    @_worker_call
    async def SubmitChildJob(
        self, request: workers_pb2.SubmitChildJobRequest
    ) -> workers_pb2.SubmitChildJobResponse:
        fence = _fence(request.attempt, request.HasField("attempt"))
        name, created = await self._service.submit_child(fence, child_request(request))
        return workers_pb2.SubmitChildJobResponse(name=name, created=created)


def child_request(request: workers_pb2.SubmitChildJobRequest) -> ChildRequest:
    """The child a SubmitChildJob call asks for, as plain values."""
    return ChildRequest(
        key=request.key,
        type=request.type,
        payload=dict_from_struct(request.payload),
        max_attempts=request.max_attempts,
        timeout_seconds=(
            seconds_from_duration(request.timeout, field="timeout")
            if request.HasField("timeout")
            else None
        ),
        correlation_id=request.correlation_id or None,
        schedule_time=(
            time_from_timestamp(
                request.schedule_time.seconds, request.schedule_time.nanos, field="schedule_time"
            )
            if request.HasField("schedule_time")
            else None
        ),
        schedule_delay_seconds=(
            seconds_from_duration(request.schedule_delay, field="schedule_delay")
            if request.HasField("schedule_delay")
            else None
        ),
    )
