"""JobService and EventService over gRPC: thin adapters between protobuf and
:class:`JobService` / :class:`EventService`."""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import structlog

from jobplane.convert import (
    dict_from_struct,
    event_to_pb,
    job_to_pb,
    seconds_from_duration,
    state_filter_from_pb,
)
from jobplane.errors import InvalidArgument, JobplaneError, at_item
from jobplane.events.convert import event_to_pb as domain_event_to_pb
from jobplane.logs import fingerprint
from jobplane.observe import tracing
from jobplane.scheduling import time_from_timestamp
from jobplane.server.auth import current_identity
from jobplane.server.events import EventService, PublishRequest
from jobplane.server.limits import TenantLimiter
from jobplane.server.service import MAX_BATCH_SUBMIT, JobService, SubmitRequest
from jobplane.server.status import error_for, to_grpc_status
from jobplane.v1 import events_pb2, events_pb2_grpc, jobs_pb2, jobs_pb2_grpc

if TYPE_CHECKING:
    from jobplane.types import JobEvent

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Servicer = TypeVar("Servicer")
Context = grpc.aio.ServicerContext[Any, Any]

# An event's time travels as the AMQP `timestamp` property, unsigned seconds
# since 1970: earlier times could be stored but never published. Later than
# the end of year 9999 is no Timestamp at all.
MIN_EVENT_SECONDS = 0
MAX_EVENT_SECONDS = 253_402_300_799


# Clients refuse replies over 4 MiB unless told otherwise: a page of large
# jobs is cut short (with a token for the rest) before it gets there.
MAX_LIST_REPLY_BYTES = 3 * 1024 * 1024


# The most of a caller's id a log line shows (ids are checked, and refused, later).
_MAX_LOGGED_ID = 256


def _bind_ids(request_id: str, correlation_id: str) -> None:
    """Bind the request's own ids, by fingerprint (the gate bound x-request-id's; the
    request's field wins)."""
    ids = {"request_id": request_id, "correlation_id": correlation_id}
    structlog.contextvars.bind_contextvars(**{k: fingerprint(v) for k, v in ids.items() if v})


async def _abort(context: Context, error: JobplaneError) -> None:
    await context.abort_with_status(to_grpc_status(error))


def _unary(
    method: Callable[[Servicer, uuid.UUID, Req], Awaitable[Resp]],
) -> Callable[[Servicer, Req, Context], Awaitable[Resp]]:
    """Run for the caller's tenant; any failure becomes its rich status."""

    @functools.wraps(method)
    async def wrapper(self: Servicer, request: Req, context: Context) -> Resp:
        if name := getattr(request, "name", ""):
            structlog.contextvars.bind_contextvars(job=name[:_MAX_LOGGED_ID])
        try:
            return await method(self, current_identity().tenant_id, request)
        except Exception as exc:
            await _abort(context, error_for(exc, method.__name__))
        raise AssertionError("unreachable: abort raises")

    return wrapper


class JobServiceServicer(jobs_pb2_grpc.JobServiceServicer):
    """The JobService RPCs, for callers :class:`~jobplane.server.auth.CallGate` admitted."""

    def __init__(self, service: JobService, limiter: TenantLimiter | None = None) -> None:
        self._service = service
        self._encoded = EncodedEvents()
        self._limiter = limiter

    @_unary
    async def SubmitJob(
        self, tenant: uuid.UUID, request: jobs_pb2.SubmitJobRequest
    ) -> jobs_pb2.Job:
        _bind_ids(request.request_id, request.correlation_id)
        job = await self._service.submit(tenant, submit_request(request))
        return job_to_pb(job)

    @_unary
    async def BatchSubmitJobs(
        self, tenant: uuid.UUID, request: jobs_pb2.BatchSubmitJobsRequest
    ) -> jobs_pb2.BatchSubmitJobsResponse:
        items = []
        for i, item in enumerate(request.requests):
            try:
                items.append(submit_request(item))
            except JobplaneError as exc:
                raise at_item(exc, i) from None
        if self._limiter is not None and len(items) <= MAX_BATCH_SUBMIT:
            # The gate spent one token before the body was read; a batch is
            # one submit a job.
            self._limiter.take_submit(tenant, len(items) - 1, taken=1)
        jobs = await self._service.submit_many(tenant, items)
        return jobs_pb2.BatchSubmitJobsResponse(jobs=[job_to_pb(job) for job in jobs])

    @_unary
    async def GetJob(self, tenant: uuid.UUID, request: jobs_pb2.GetJobRequest) -> jobs_pb2.Job:
        return job_to_pb(await self._service.get(tenant, request.name))

    @_unary
    async def ListJobs(
        self, tenant: uuid.UUID, request: jobs_pb2.ListJobsRequest
    ) -> jobs_pb2.ListJobsResponse:
        state = state_filter_from_pb(request.state)
        page = await self._service.list(
            tenant,
            page_size=request.page_size,
            page_token=request.page_token,
            state=state,
            job_type=request.type,
            waiting_code=request.waiting_code,
            parent=request.parent,
        )
        reply = jobs_pb2.ListJobsResponse(next_page_token=page.next_page_token)
        size = 0
        for job in page.jobs:
            message = job_to_pb(job)
            size += message.ByteSize()
            if reply.jobs and size > MAX_LIST_REPLY_BYTES:
                # The rest of the page follows on the next one.
                last = page.jobs[len(reply.jobs) - 1]
                reply.next_page_token = self._service.page_token_after(
                    last,
                    state=state,
                    job_type=request.type,
                    waiting_code=request.waiting_code,
                    parent=request.parent,
                )
                break
            reply.jobs.append(message)
        return reply

    @_unary
    async def CancelJob(
        self, tenant: uuid.UUID, request: jobs_pb2.CancelJobRequest
    ) -> jobs_pb2.Job:
        return job_to_pb(await self._service.cancel(tenant, request.name, request.reason))

    @_unary
    async def RetryJob(self, tenant: uuid.UUID, request: jobs_pb2.RetryJobRequest) -> jobs_pb2.Job:
        return job_to_pb(await self._service.retry(tenant, request.name, request.from_stage))

    # Bytes where the stub says WatchJobResponse: the same message on the wire,
    # encoded once (the server's WatchJob serializer passes bytes through).
    async def WatchJob(  # type: ignore[override]
        self, request: jobs_pb2.WatchJobRequest, context: Context
    ) -> AsyncIterator[bytes]:
        """The job's events, each an encoded ``WatchJobResponse`` (:class:`EncodedEvents`)."""
        if request.name:
            structlog.contextvars.bind_contextvars(job=request.name[:_MAX_LOGGED_ID])
        try:
            tenant = current_identity().tenant_id
            async for event in self._service.watch(tenant, request.name, request.after_seq):
                # Bytes: the server's WatchJob serializer passes them through.
                yield self._encoded(event)
        except Exception as exc:
            await _abort(context, error_for(exc, "WatchJob"))


class EncodedEvents:
    """Each job event's ``WatchJobResponse``, encoded once for all of its job's streams.

    Events never change once written, and a job's streams take the same event
    objects from one feed (ADR-0005): the newest ``most`` encodings are kept, by
    (job name, seq), the oldest dropped first.
    """

    def __init__(self, most: int = 8192) -> None:
        self._most = most
        self._encoded: dict[tuple[str, int], bytes] = {}

    def __call__(self, event: JobEvent) -> bytes:
        key = (event.name, event.seq)
        found = self._encoded.get(key)
        if found is None:
            found = self._encoded[key] = event_to_pb(event).SerializeToString()
            if len(self._encoded) > self._most:
                del self._encoded[next(iter(self._encoded))]
        return found


class EventServiceServicer(events_pb2_grpc.EventServiceServicer):
    """The EventService RPCs, for callers :class:`~jobplane.server.auth.CallGate` admitted."""

    def __init__(self, service: EventService) -> None:
        self._service = service

    async def PublishEvent(
        self, request: events_pb2.PublishEventRequest, context: Context
    ) -> events_pb2.Event:
        _bind_ids("", request.correlation_id)
        try:
            tenant = current_identity().tenant_id
            metadata = dict(
                (key, value)
                for key, value in context.invocation_metadata() or ()
                if key in ("traceparent", "tracestate") and isinstance(value, str)
            )
            # With tracing on, the server span's context (the caller's trace
            # goes on through it); else the caller's, as sent.
            traceparent, tracestate = tracing.outgoing(
                metadata.get("traceparent"), metadata.get("tracestate")
            )
            stored = await self._service.publish(
                tenant,
                PublishRequest(
                    event_id=request.event_id,
                    event_type=request.event_type,
                    timestamp=(
                        _event_time(request.timestamp) if request.HasField("timestamp") else None
                    ),
                    project_id=request.project_id if request.HasField("project_id") else None,
                    correlation_id=request.correlation_id,
                    causation_id=(
                        request.causation_id if request.HasField("causation_id") else None
                    ),
                    payload=dict_from_struct(request.payload),
                    traceparent=traceparent,
                    tracestate=tracestate,
                ),
            )
            return domain_event_to_pb(stored.event)
        except Exception as exc:
            await _abort(context, error_for(exc, "PublishEvent"))
        raise AssertionError("unreachable: abort raises")

    async def SubscribeEvents(
        self, request: events_pb2.SubscribeEventsRequest, context: Context
    ) -> AsyncIterator[events_pb2.SubscribeEventsResponse]:
        try:
            tenant = current_identity().tenant_id
            async for stored in self._service.subscribe(
                tenant, list(request.type_patterns), request.after_cursor, int(request.start)
            ):
                yield events_pb2.SubscribeEventsResponse(
                    event=domain_event_to_pb(stored.event), cursor=stored.position.cursor()
                )
        except Exception as exc:
            await _abort(context, error_for(exc, "SubscribeEvents"))


def submit_request(request: jobs_pb2.SubmitJobRequest) -> SubmitRequest:
    """A SubmitJobRequest as plain values (the timeout checked)."""
    return SubmitRequest(
        type=request.type,
        payload=dict_from_struct(request.payload),
        request_id=request.request_id,
        correlation_id=request.correlation_id,
        max_attempts=request.max_attempts,
        labels=dict(request.labels),
        timeout_seconds=(
            seconds_from_duration(request.timeout, field="timeout")
            if request.HasField("timeout")
            else None
        ),
        payload_blob=request.payload_blob,
        blob_references=tuple(request.blob_references),
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
        concurrency_key=request.concurrency_key,
        concurrency_limit=request.concurrency_limit,
        concurrency_mode=request.concurrency_mode,
        deadline=(
            time_from_timestamp(request.deadline.seconds, request.deadline.nanos, field="deadline")
            if request.HasField("deadline")
            else None
        ),
        deadline_after_seconds=(
            seconds_from_duration(request.deadline_after, field="deadline_after")
            if request.HasField("deadline_after")
            else None
        ),
        after=tuple(request.after),
        after_failure=request.after_failure,
    )


def _event_time(message: Any) -> datetime:
    """An event's time from a Timestamp; INVALID_ARGUMENT unless AMQP can carry it."""
    seconds, nanos = message.seconds, message.nanos
    if not (MIN_EVENT_SECONDS <= seconds <= MAX_EVENT_SECONDS and 0 <= nanos < 1_000_000_000):
        raise InvalidArgument(
            f"timestamp must be a valid Timestamp from 1970-01-01T00:00:00Z to the end of "
            f"year 9999 (seconds={seconds}, nanos={nanos})",
            field="timestamp",
        )
    return datetime.fromtimestamp(seconds, UTC).replace(microsecond=nanos // 1000)
