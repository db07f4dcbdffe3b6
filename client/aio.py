"""The asyncio client of the JobService and EventService APIs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import uuid
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import IO, Any, Self, TypeVar

import grpc

from jobplane.blobs.names import referenced_digests
from jobplane.client._blobs import Download, Source, blob_from_pb, upload_requests
from jobplane.client._errors import error_from_rpc, is_retryable
from jobplane.client._retry import (
    Backoff,
    EventCursor,
    RetryPolicy,
    stream_failure,
    stream_retry_delay,
)
from jobplane.client.batch import MAX_BATCH_SIZE, JobSpec, batches, shifted
from jobplane.client.subscription import EventSubscription, SubscribeStart, domain_event_of
from jobplane.client.tls import ClientTLS
from jobplane.convert import event_from_pb, job_from_pb, state_to_pb, struct_from_dict
from jobplane.errors import (
    BlobsDisabled,
    BlobTooLarge,
    InvalidArgument,
    JobplaneError,
    TenantLimitExceeded,
    Unavailable,
)
from jobplane.events.envelope import Event
from jobplane.types import Blob, BlobPage, BlobRef, Job, JobEvent, JobPage, JobState
from jobplane.v1 import (
    blobs_pb2,
    blobs_pb2_grpc,
    events_pb2,
    events_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
)

DEFAULT_ADDRESS = "127.0.0.1:50051"
#: Payloads larger than this (compact JSON) are uploaded as a blob and
#: submitted by reference (the server's JOBPLANE_INLINE_BYTES default).
DEFAULT_INLINE_BYTES = 64 * 1024
#: The largest payload or result by reference the SDK reads back whole.
MAX_BLOB_JSON_BYTES = 64 * 1024 * 1024

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# A call that is safe to repeat (reads, and submit with its request_id) is
# repeated while the server cannot be reached or its database is down, with
# these pauses, until the call's deadline (the client's ``timeout``) passes.
_UNARY_RETRY = RetryPolicy(initial_delay=0.05, max_delay=1.0, max_elapsed=None, jitter=0.2)
# The deadline of repeated calls of a client created with ``timeout=None``.
_UNBOUNDED_CALL_BUDGET = 60.0

# A submit refused by the tenant's rate limit is repeated after the delay the
# server asks for, when that is this short, at most _LIMIT_RETRIES times;
# otherwise the caller gets TenantLimitExceeded with its retry_delay.
_LIMIT_WAIT_MAX = 2.0
_LIMIT_RETRIES = 3

# The largest reply the SDK reads. A Job holds a payload and a result, each at
# most 5.5 times its JSON size as a protobuf Struct, and the server bounds
# that JSON size at 4 MiB (jobplane.config.MAX_PAYLOAD_BYTES_LIMIT): at most
# 44 MiB and the rest of the Job, which this leaves room for. gRPC's default
# of 4 MiB would refuse the reply of a job the server accepted.
MAX_RECEIVE_BYTES = 64 * 1024 * 1024

# grpc waits up to two minutes between reconnects of a broken channel by
# default, and calls fail at once in between; a restarted server should be
# found again within the watch backoff instead.
_CHANNEL_OPTIONS: tuple[tuple[str, int | str], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
)


def job_name_of(job: str | Job) -> str:
    """The resource name of a job given as a name or a :class:`Job`."""
    return job.name if isinstance(job, Job) else job


def _compact(payload: Mapping[str, Any]) -> bytes:
    """The payload as the server measures it: compact JSON."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def inline_bytes_from_env(env: Mapping[str, str] | None = None) -> int:
    """``JOBPLANE_INLINE_BYTES`` (positive), else the default."""
    env = os.environ if env is None else env
    raw = env.get("JOBPLANE_INLINE_BYTES", "").strip()
    if not raw:
        return DEFAULT_INLINE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"JOBPLANE_INLINE_BYTES must be a positive integer, not {raw!r}")
    return value


def _tls_of(tls: ClientTLS | bool | None) -> ClientTLS | None:
    if isinstance(tls, ClientTLS):
        return tls
    return ClientTLS() if tls else None


def clean_api_key(api_key: str | None) -> str | None:
    """``api_key`` without the whitespace around it; None when nothing is left.

    Keys are read from files and secrets, which end in a newline more often
    than not; gRPC refuses such a metadata value with a traceback that names
    neither the key nor the cause. What gRPC cannot send after stripping
    (characters outside printable ASCII) raises :class:`InvalidArgument`
    with ``field="api_key"``, in one line that does not repeat the key.
    """
    if api_key is None:
        return None
    key = api_key.strip()
    for position, char in enumerate(key):
        if not " " <= char <= "~":
            raise InvalidArgument(
                f"the API key is malformed: character {position + 1} is {char!a}, "
                "and a key is printable ASCII",
                field="api_key",
            )
    return key or None


def connection_from_env(
    address: str | None = None,
    api_key: str | None = None,
    tls: ClientTLS | bool | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[str, str | None, ClientTLS | None]:
    """Address, API key and TLS settings: the arguments given, else ``env``'s ``JOBPLANE_*``.

    ``env`` defaults to the process's environment; see :meth:`AsyncClient.from_env`.
    """
    env = os.environ if env is None else env
    return (
        address or env.get("JOBPLANE_ADDRESS") or DEFAULT_ADDRESS,
        clean_api_key(api_key) or clean_api_key(env.get("JOBPLANE_API_KEY")),
        ClientTLS.from_env(env) if tls is None else _tls_of(tls),
    )


class AsyncClient:
    """An asyncio client of one jobplane server.

    Use it as an async context manager, or call :meth:`close` when done. The
    channel opens on first use, on the event loop that makes the call; use one
    client from one event loop.

    ``tls`` is a :class:`ClientTLS` (certificates, mutual TLS, the expected
    server name), or True for TLS that trusts the system's roots; None or
    False speak plaintext.

    ``api_key`` is used without the whitespace around it (a key read from
    a file ends in a newline); a key gRPC cannot send raises
    :class:`~jobplane.errors.InvalidArgument` (``field="api_key"``) here.

    ``tracing=True`` sends the caller's OpenTelemetry trace context with
    every call, each in a client span (:mod:`jobplane.client.tracing`; needs
    ``opentelemetry-api``), so a job's trace continues the caller's.
    ``interceptors`` are grpc.aio client interceptors for the channel, after
    the tracing ones.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        api_key: str | None = None,
        *,
        timeout: float | None = 30.0,
        watch_retry: RetryPolicy | None = None,
        tls: ClientTLS | bool | None = None,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
        tracing: bool = False,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        if inline_bytes <= 0:
            raise ValueError("inline_bytes must be positive")
        self._interceptors = list(interceptors)
        if tracing:
            # Imported only when asked for: the base install has no opentelemetry.
            from jobplane.client.tracing import client_interceptors

            self._interceptors[:0] = client_interceptors()
        self._inline_bytes = inline_bytes
        self._address = address
        api_key = clean_api_key(api_key)
        self._api_key = api_key
        self._timeout = timeout
        self._watch_retry = watch_retry or RetryPolicy()
        self._tls = _tls_of(tls)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key else ()
        )
        self._channel: grpc.aio.Channel | None = None
        self._stub: jobs_pb2_grpc.JobServiceAsyncStub | None = None
        self._event_stub: events_pb2_grpc.EventServiceAsyncStub | None = None
        self._blob_stub: blobs_pb2_grpc.BlobServiceAsyncStub | None = None
        self._closed = False

    @classmethod
    def from_env(
        cls,
        *,
        address: str | None = None,
        api_key: str | None = None,
        timeout: float | None = 30.0,
        watch_retry: RetryPolicy | None = None,
        tls: ClientTLS | bool | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Self:
        """A client for ``JOBPLANE_ADDRESS`` with key ``JOBPLANE_API_KEY``.

        TLS as :meth:`ClientTLS.from_env` reads it from ``JOBPLANE_TLS``,
        ``JOBPLANE_TLS_CA``, ``JOBPLANE_TLS_CLIENT_CERT``,
        ``JOBPLANE_TLS_CLIENT_KEY`` (PEM file paths) and
        ``JOBPLANE_TLS_SERVER_NAME``. Payloads over ``JOBPLANE_INLINE_BYTES``
        go by reference. Arguments, when given, win over the environment;
        ``env`` stands in for the process's environment.
        """
        address, api_key, tls = connection_from_env(address, api_key, tls, env)
        return cls(
            address,
            api_key,
            timeout=timeout,
            watch_retry=watch_retry,
            tls=tls,
            inline_bytes=inline_bytes_from_env(env),
        )

    @property
    def address(self) -> str:
        """The ``host:port`` of the server."""
        return self._address

    @property
    def api_key(self) -> str | None:
        """The API key sent with every call."""
        return self._api_key

    @property
    def tls(self) -> ClientTLS | None:
        """The channel's TLS settings; None when it speaks plaintext."""
        return self._tls

    @property
    def timeout(self) -> float | None:
        """Deadline in seconds of each unary call (watch streams have none)."""
        return self._timeout

    @property
    def watch_retry(self) -> RetryPolicy:
        """How :meth:`watch` and :meth:`subscribe` reconnect."""
        return self._watch_retry

    def __repr__(self) -> str:
        return f"{type(self).__name__}(address={self._address!r})"

    async def __aenter__(self) -> Self:
        self._get_stub()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; calls still running fail. Safe to call twice."""
        self._closed = True
        channel, self._channel = self._channel, None
        self._stub = self._event_stub = None
        self._blob_stub = None
        if channel is not None:
            await channel.close()

    def _get_channel(self) -> grpc.aio.Channel:
        if self._closed:
            raise RuntimeError("the client has been closed")
        if self._channel is None:
            self._channel = self._open_channel()
        return self._channel

    def _get_stub(self) -> jobs_pb2_grpc.JobServiceAsyncStub:
        channel = self._get_channel()
        if self._stub is None:
            self._stub = jobs_pb2_grpc.JobServiceStub(channel)
        return self._stub

    def _get_event_stub(self) -> events_pb2_grpc.EventServiceAsyncStub:
        channel = self._get_channel()
        if self._event_stub is None:
            self._event_stub = events_pb2_grpc.EventServiceStub(channel)
        return self._event_stub

    def _get_blob_stub(self) -> blobs_pb2_grpc.BlobServiceAsyncStub:
        channel = self._get_channel()
        if self._blob_stub is None:
            self._blob_stub = blobs_pb2_grpc.BlobServiceStub(channel)
        return self._blob_stub

    def _open_channel(self) -> grpc.aio.Channel:
        interceptors = self._interceptors or None
        if self._tls is None:
            return grpc.aio.insecure_channel(
                self._address, options=_CHANNEL_OPTIONS, interceptors=interceptors
            )
        return grpc.aio.secure_channel(
            self._address,
            self._tls.credentials(),
            options=(*_CHANNEL_OPTIONS, *self._tls.channel_options()),
            interceptors=interceptors,
        )

    async def _call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        *,
        repeatable: bool = False,
        timeout: float | None = None,
    ) -> Resp:
        """One unary call; a ``repeatable`` one is retried while it is refused.

        Refused means UNAVAILABLE (the server or its database is down), a lost
        connection or a call the server shed (:func:`is_retryable`); also a
        tenant limit whose ``retry_delay`` is short (at most
        ``_LIMIT_WAIT_MAX``), after that delay. ``timeout``, else the
        client's, is the deadline of the call with all its repeats.
        """
        timeout = self._timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout or _UNBOUNDED_CALL_BUDGET)
        backoff = Backoff(_UNARY_RETRY)
        limited = 0
        refused: grpc.aio.AioRpcError | None = None
        while True:
            remaining = deadline - loop.time()
            try:
                return await method(
                    request,
                    timeout=remaining if timeout is not None else None,
                    metadata=self._metadata,
                )
            except grpc.aio.AioRpcError as exc:
                if not repeatable or self._closed:
                    raise error_from_rpc(exc) from exc
                if refused is not None and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    # The budget ran out in a repeat of a refused call (one
                    # still connecting, say): why it failed is the refusal.
                    raise error_from_rpc(refused) from exc
                delay: float | None
                if is_retryable(exc):
                    refused = exc
                    delay = backoff.failure()
                else:
                    error = error_from_rpc(exc)
                    delay = error.retry_delay
                    if (
                        not isinstance(error, TenantLimitExceeded)
                        or delay is None
                        or delay > _LIMIT_WAIT_MAX
                        or limited >= _LIMIT_RETRIES
                    ):
                        raise error from exc
                    limited += 1
                if delay is None or loop.time() + delay >= deadline:
                    raise error_from_rpc(exc) from exc
            await asyncio.sleep(delay)

    async def submit(
        self,
        type: str,
        payload: dict[str, Any] | None = None,
        *,
        request_id: str | None = None,
        correlation_id: str = "",
        max_attempts: int = 0,
        labels: Mapping[str, str] | None = None,
        attempt_timeout: float | timedelta | None = None,
    ) -> Job:
        """Create a job of ``type`` and return it (normally QUEUED).

        ``request_id`` is the idempotency key: submitting again with the same
        one returns the original job. When None, a fresh UUID is used, which
        still makes the call's own retries safe. ``max_attempts`` 0 means the
        queue's default. ``attempt_timeout`` (seconds or a timedelta) bounds
        each attempt's run time; None means the queue's default.
        """
        request = await self._submit_request(
            JobSpec(
                type,
                payload,
                request_id=request_id,
                correlation_id=correlation_id,
                max_attempts=max_attempts,
                labels=labels,
                attempt_timeout=attempt_timeout,
            )
        )
        # Without a request_id a repeated call could create a second job.
        job = await self._call(
            self._get_stub().SubmitJob, request, repeatable=bool(request.request_id)
        )
        return job_from_pb(job)

    async def submit_many(
        self,
        specs: Iterable[JobSpec | Mapping[str, Any]],
        *,
        batch_size: int = MAX_BATCH_SIZE,
    ) -> list[Job]:
        """Create many jobs, through BatchSubmitJobs; the jobs in the order of ``specs``.

        Each spec is a :class:`JobSpec` (or a mapping of its field names): the
        arguments of :meth:`submit`, with the same meanings, a large payload
        going as a blob as there. The specs go in calls of at most
        ``batch_size`` (at most 1,000) and 8 MiB; each call creates all its
        jobs or none, and is repeated on the same terms as :meth:`submit`
        (a spec without a request_id gets a fresh UUID, so a repeated call
        creates nothing twice). A refused spec raises the server's error with
        ``field`` ``requests[i]…`` and ``metadata["index"]`` naming it by its
        index ``i`` in ``specs``; the calls before it have created their jobs
        (give request_ids to make submitting all again safe).
        """
        if not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be 1 to {MAX_BATCH_SIZE}")
        requests = [await self._submit_request(JobSpec.of(spec)) for spec in specs]
        stub = self._get_stub()
        jobs: list[Job] = []
        for batch in batches(requests, size=batch_size):
            offset = len(jobs)
            try:
                reply = await self._call(
                    stub.BatchSubmitJobs,
                    jobs_pb2.BatchSubmitJobsRequest(requests=batch),
                    repeatable=True,
                )
            except JobplaneError as exc:
                error = shifted(exc, offset)
                if error is exc:
                    raise
                raise error from exc.__cause__
            jobs.extend(job_from_pb(job) for job in reply.jobs)
        return jobs

    async def _submit_request(self, spec: JobSpec) -> jobs_pb2.SubmitJobRequest:
        """The SubmitJobRequest of ``spec``: a request_id, and a large payload as a blob."""
        payload = spec.payload
        request = jobs_pb2.SubmitJobRequest(
            type=spec.type,
            payload=struct_from_dict(payload),
            request_id=str(uuid.uuid4()) if spec.request_id is None else spec.request_id,
            correlation_id=spec.correlation_id,
            max_attempts=spec.max_attempts,
            labels=dict(spec.labels or {}),
        )
        attempt_timeout = spec.attempt_timeout
        if attempt_timeout is not None:
            if not isinstance(attempt_timeout, timedelta):
                attempt_timeout = timedelta(seconds=attempt_timeout)
            request.timeout.FromTimedelta(attempt_timeout)
        body = _compact(payload) if payload else None
        if body is not None and len(body) > self._inline_bytes:
            # Too large to go inline: as a blob, by reference. A server
            # without an object store takes it inline (up to its limit).
            try:
                blob = await self.upload(body, content_type="application/json")
            except BlobsDisabled:
                pass
            else:
                request.ClearField("payload")
                request.payload_blob = blob.name
                # The names inside are references still (the server cannot see them).
                request.blob_references.extend(
                    f"blobs/{d}" for d in sorted(referenced_digests(payload or {}))
                )
        return request

    async def get(self, name: str | Job, *, resolve_blobs: bool = True) -> Job:
        """The job as the server stores it now.

        A payload or result that went by reference (``payload_blob``,
        ``result_blob``) is downloaded into ``payload`` / ``result``; with
        ``resolve_blobs=False`` they stay ``{}`` and only the references are set.
        """
        request = jobs_pb2.GetJobRequest(name=job_name_of(name))
        job = job_from_pb(await self._call(self._get_stub().GetJob, request, repeatable=True))
        return await self.resolve_blobs(job) if resolve_blobs else job

    async def resolve_blobs(self, job: Job) -> Job:
        """``job`` with its payload and result read from their blobs, when they went by one."""
        if job.payload_blob is not None:
            job = dataclasses.replace(job, payload=await self._json_blob(job.payload_blob))
        if job.result_blob is not None and job.result is not None:
            job = dataclasses.replace(job, result=await self._json_blob(job.result_blob))
        return job

    async def _json_blob(self, ref: BlobRef) -> dict[str, Any]:
        if ref.size > MAX_BLOB_JSON_BYTES:
            raise BlobTooLarge(f"{ref.name} has {ref.size} bytes, more than the SDK reads whole")
        value = json.loads(await self.read_blob(ref.name))
        if not isinstance(value, dict):
            raise InvalidArgument(f"{ref.name} does not hold a JSON object", field="name")
        return value

    async def list(
        self,
        *,
        page_size: int = 0,
        page_token: str = "",
        state: JobState | None = None,
        type: str | None = None,
    ) -> JobPage:
        """One page of the caller's jobs, newest first.

        ``page_size`` 0 means the server default (50). Pass the page's
        ``next_page_token`` with the same filters to get the next page.
        """
        request = jobs_pb2.ListJobsRequest(
            page_size=page_size,
            page_token=page_token,
            state=state_to_pb(state) if state is not None else jobs_pb2.Job.STATE_UNSPECIFIED,
            type=type or "",
        )
        response = await self._call(self._get_stub().ListJobs, request, repeatable=True)
        return JobPage(
            jobs=[job_from_pb(j) for j in response.jobs],
            next_page_token=response.next_page_token,
        )

    async def iter_jobs(
        self,
        *,
        page_size: int = 0,
        page_token: str = "",
        state: JobState | None = None,
        type: str | None = None,
    ) -> AsyncGenerator[Job, None]:
        """Every job matching the filters, fetching page after page."""
        while True:
            page = await self.list(
                page_size=page_size, page_token=page_token, state=state, type=type
            )
            for job in page.jobs:
                yield job
            if not page.next_page_token:
                return
            page_token = page.next_page_token

    async def cancel(self, name: str | Job, reason: str = "") -> Job:
        """Cancel a queued job, or ask a running one to stop.

        A running job comes back with ``cancel_requested`` set; it becomes
        CANCELLED when its handler stops.
        """
        request = jobs_pb2.CancelJobRequest(name=job_name_of(name), reason=reason)
        return job_from_pb(await self._call(self._get_stub().CancelJob, request))

    async def retry(self, name: str | Job, *, from_stage: str = "") -> Job:
        """Start a new attempt of a FAILED or CANCELLED job.

        A pipeline job resumes at the stage that failed or was cancelled, or
        at ``from_stage`` (that stage and every later one run again).
        """
        request = jobs_pb2.RetryJobRequest(name=job_name_of(name), from_stage=from_stage)
        return job_from_pb(await self._call(self._get_stub().RetryJob, request))

    def _open_watch(
        self, name: str, after_seq: int
    ) -> grpc.aio.UnaryStreamCall[jobs_pb2.WatchJobRequest, jobs_pb2.WatchJobResponse]:
        return self._get_stub().WatchJob(
            jobs_pb2.WatchJobRequest(name=name, after_seq=after_seq), metadata=self._metadata
        )

    async def watch(self, name: str | Job, after_seq: int = 0) -> AsyncGenerator[JobEvent, None]:
        """The job's events with seq > ``after_seq``, then live ones, in seq order.

        The iterator ends when the server ends the stream, which it does after
        the job's terminal event (at once if that is at or before
        ``after_seq``). When the connection is lost (e.g. the server restarts)
        it reconnects as :attr:`watch_retry` says and resumes after the last
        event it yielded, so no event is repeated or skipped; it raises
        :class:`~jobplane.errors.Unavailable` when it cannot reconnect in time.
        A server that refuses the stream because the tenant holds its limit of
        streams there is asked again after the delay it names (at least the
        backoff's), within the same budget; past it the watch raises
        :class:`~jobplane.errors.TenantLimitExceeded` with that delay.
        Events the server resends are dropped; a missing seq raises
        :class:`WatchSequenceError`.
        """
        job_name = job_name_of(name)
        cursor = EventCursor(after_seq)
        backoff = Backoff(self._watch_retry)
        loop = asyncio.get_running_loop()
        while True:
            failure: BaseException | None = None
            limited: TenantLimitExceeded | None = None
            opened = loop.time()
            call = self._open_watch(job_name, cursor.last)
            try:
                async for message in call:
                    event = event_from_pb(message)
                    if cursor.accept(event.seq, terminal=event.terminal):
                        # Only a new event counts as recovery: a server that
                        # resends old ones and fails again is still failing.
                        backoff.reset()
                        yield event
            except grpc.aio.AioRpcError as exc:
                limited = stream_failure(exc, closed=self._closed)
                failure = exc
            else:
                if cursor.at_terminal:
                    return
                # The stream ended without a terminal event: fine if the job
                # ended at or before after_seq, otherwise resume.
                try:
                    job = await self.get(job_name)
                except Unavailable as exc:
                    failure = exc
                else:
                    if job.state.terminal and job.last_seq <= cursor.last:
                        return
            finally:
                call.cancel()
            delay = stream_retry_delay(
                backoff, open_for=loop.time() - opened, limited=limited, failure=failure
            )
            if delay is None:
                raise Unavailable(
                    f"lost the event stream of {job_name} after seq {cursor.last} and "
                    f"could not resume it within {self._watch_retry.max_elapsed:g}s"
                ) from failure
            await asyncio.sleep(delay)

    async def wait(
        self, name: str | Job, timeout: float | None = None, *, resolve_blobs: bool = True
    ) -> Job:
        """Wait until the job ends and return it (``resolve_blobs`` as for :meth:`get`).

        Raises :class:`TimeoutError` when it has not ended after ``timeout``
        seconds (None waits for ever).
        """
        job_name = job_name_of(name)
        async with asyncio.timeout(timeout):
            # Blobs are read once, from the job as it ended.
            job = await self.get(job_name, resolve_blobs=False)
            if not job.state.terminal:
                async with contextlib.aclosing(self.watch(job_name, job.last_seq)) as events:
                    async for _ in events:
                        pass
                job = await self.get(job_name, resolve_blobs=False)
            return await self.resolve_blobs(job) if resolve_blobs else job

    # -- blobs ---------------------------------------------------------------

    async def upload(self, source: Source, *, content_type: str | None = None) -> Blob:
        """Store a file (a path), a readable binary stream or bytes as a blob; its name.

        Streams in chunks of 1 MiB. The same bytes give the same blob, stored
        once. A path's sha256 is computed first and checked by the server.
        A path or bytes are sent again while the server cannot be reached (for
        the client's ``timeout`` at most); a stream, read once, is not.
        """
        again = not hasattr(source, "read")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self._timeout or _UNBOUNDED_CALL_BUDGET)
        backoff = Backoff(_UNARY_RETRY)
        while True:
            try:
                reply = await self._get_blob_stub().UploadBlob(
                    upload_requests(source, content_type), metadata=self._metadata
                )
                return blob_from_pb(reply)
            except grpc.aio.AioRpcError as exc:
                delay = backoff.failure()
                if not (again and is_retryable(exc)) or self._closed:
                    raise error_from_rpc(exc) from exc
                if delay is None or loop.time() + delay >= deadline:
                    raise error_from_rpc(exc) from exc
            await asyncio.sleep(delay)

    async def get_blob(self, name: str) -> Blob:
        """One blob's metadata."""
        request = blobs_pb2.GetBlobRequest(name=name)
        reply = await self._call(self._get_blob_stub().GetBlob, request, repeatable=True)
        return blob_from_pb(reply)

    async def download(self, name: str, dest: str | os.PathLike[str] | IO[bytes]) -> Blob:
        """Write the blob's bytes to ``dest``: a path (written whole or not at all) or a
        writable binary stream. The bytes are checked against the name's sha256."""
        blob, _ = await self._download(name, Download(name, dest))
        return blob

    async def read_blob(self, name: str) -> bytes:
        """The blob's bytes, in memory."""
        _, data = await self._download(name, Download(name, None))
        return data

    async def _download(self, name: str, sink: Download) -> tuple[Blob, bytes]:
        blob: Blob | None = None
        try:
            await sink.open()
            call = self._get_blob_stub().DownloadBlob(
                blobs_pb2.DownloadBlobRequest(name=name), metadata=self._metadata
            )
            async for message in call:
                if message.HasField("blob"):
                    blob = blob_from_pb(message.blob)
                if message.chunk:
                    await sink.write(message.chunk)
            data = await sink.finish()
        except grpc.aio.AioRpcError as exc:
            sink.discard()
            raise error_from_rpc(exc) from exc
        except BaseException:
            sink.discard()
            raise
        if blob is None:
            raise Unavailable("the download ended before the blob's metadata")
        return blob, data

    async def list_blobs(self, *, page_size: int = 0, page_token: str = "") -> BlobPage:
        """One page of the caller's blobs by name; ``page_size`` 0 means 100."""
        request = blobs_pb2.ListBlobsRequest(page_size=page_size, page_token=page_token)
        reply = await self._call(self._get_blob_stub().ListBlobs, request, repeatable=True)
        return BlobPage([blob_from_pb(b) for b in reply.blobs], reply.next_page_token)

    async def iter_blobs(self, *, page_size: int = 0) -> AsyncGenerator[Blob, None]:
        """Every blob of the caller, page by page."""
        token = ""
        while True:
            page = await self.list_blobs(page_size=page_size, page_token=token)
            for blob in page.blobs:
                yield blob
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def delete_blob(self, name: str) -> None:
        """Delete a blob; :class:`~jobplane.errors.BlobInUse` while a job references it."""
        request = blobs_pb2.DeleteBlobRequest(name=name)
        await self._call(self._get_blob_stub().DeleteBlob, request, repeatable=True)

    # -- domain events -------------------------------------------------------

    async def publish(
        self,
        event_type: str,
        payload: dict[str, Any] | None = None,
        *,
        event_id: uuid.UUID | str | None = None,
        timestamp: datetime | None = None,
        project_id: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        timeout: float | None = None,
    ) -> Event:
        """Publish a domain event for the caller's tenant and return it as stored.

        ``event_id`` is the idempotency key: when None, a fresh UUID is made
        once and kept across the call's own retries, so a publish repeated
        after a lost reply stores the event once. Publishing an event_id again
        with the same event returns the stored one and writes nothing; with a
        different event it raises :class:`~jobplane.errors.EventIdReused`.

        ``timestamp`` (timezone-aware) is when the fact happened; None means
        when the server accepts it. ``correlation_id`` None starts a chain
        (the server uses the event's own id). ``timeout``, else the client's,
        bounds the call with its retries.
        """
        request = events_pb2.PublishEventRequest(
            event_id=_event_id_text(event_id),
            event_type=event_type,
            correlation_id=correlation_id or "",
            payload=struct_from_dict(payload),
        )
        if timestamp is not None:
            if timestamp.utcoffset() is None:
                raise InvalidArgument(
                    "timestamp must be a timezone-aware datetime", field="timestamp"
                )
            request.timestamp.FromDatetime(timestamp)
        if project_id is not None:
            request.project_id = project_id
        if causation_id is not None:
            request.causation_id = causation_id
        stored = await self._call(
            self._get_event_stub().PublishEvent, request, repeatable=True, timeout=timeout
        )
        return domain_event_of(stored)

    def subscribe(
        self,
        patterns: str | Iterable[str],
        *,
        after_cursor: str | None = None,
        start: SubscribeStart = "earliest",
    ) -> EventSubscription:
        """The caller's events whose type matches any of ``patterns``, in commit order.

        Patterns are in AMQP topic syntax (``job.*``, ``artifact.#``, ``#``).
        The subscription yields ``(event, cursor)`` items (
        :class:`~jobplane.client.SubscribedEvent`): first the stored events
        after ``after_cursor`` — or, without one, from ``start``:
        ``"earliest"`` (every event the server keeps) or ``"latest"`` (those
        committed after the call) — then live ones; it does not end by itself.
        It resumes by itself after a lost stream, from the last cursor it
        delivered, with no gap and no repeat, within :attr:`watch_retry`; its
        ``cursor`` attribute is that cursor, to store and resume from later.

        With ``start="latest"``, a stream lost before its first event is
        opened again at the latest event, and events committed in between are
        not seen: to never miss one, resume from a stored cursor.
        """
        chosen = [patterns] if isinstance(patterns, str) else list(patterns)
        return EventSubscription(
            self._open_subscription,
            chosen,
            after_cursor=after_cursor,
            start=start,
            retry=self._watch_retry,
            closed=lambda: self._closed,
        )

    def _open_subscription(
        self, request: events_pb2.SubscribeEventsRequest
    ) -> grpc.aio.UnaryStreamCall[
        events_pb2.SubscribeEventsRequest, events_pb2.SubscribeEventsResponse
    ]:
        return self._get_event_stub().SubscribeEvents(request, metadata=self._metadata)


def _event_id_text(event_id: uuid.UUID | str | None) -> str:
    """The event_id of a request: a new UUID, or the one given in canonical form.

    A string that is no UUID is sent as it is, for the server to refuse by name.
    """
    if event_id is None:
        return str(uuid.uuid4())
    if isinstance(event_id, uuid.UUID):
        return str(event_id)
    try:
        return str(uuid.UUID(event_id))
    except ValueError:
        return event_id


__all__ = [
    "DEFAULT_ADDRESS",
    "MAX_RECEIVE_BYTES",
    "AsyncClient",
    "ClientTLS",
    "JobSpec",
    "job_name_of",
]
