"""The job calls of :class:`~jobplane.client.AsyncClient`: submit, read, list, cancel,
retry, watch and wait.

A payload too large to go inline is uploaded as a blob first (through the
blob calls this part is built on), and read back from it by :meth:`get`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import grpc

from jobplane.blobs.names import referenced_digests
from jobplane.client._blob_calls import BlobCalls
from jobplane.client._retry import Backoff, EventCursor, stream_failure, stream_retry_delay
from jobplane.client._schedule import set_deadline, set_schedule
from jobplane.client.batch import (
    MAX_BATCH_SIZE,
    JobSpec,
    batches,
    shifted,
    with_after,
    with_concurrency,
)
from jobplane.convert import event_from_pb, job_from_pb, state_to_pb, struct_from_dict
from jobplane.errors import (
    BlobsDisabled,
    BlobTooLarge,
    InvalidArgument,
    JobplaneError,
    TenantLimitExceeded,
    Unavailable,
)
from jobplane.types import (
    BlobRef,
    ConcurrencyMode,
    DependencyFailurePolicy,
    Job,
    JobEvent,
    JobPage,
    JobState,
    WaitingCode,
)
from jobplane.v1 import jobs_pb2

#: The largest payload or result by reference the SDK reads back whole.
MAX_BLOB_JSON_BYTES = 64 * 1024 * 1024


def job_name_of(job: str | Job) -> str:
    """The resource name of a job given as a name or a :class:`Job`."""
    return job.name if isinstance(job, Job) else job


def _compact(payload: Mapping[str, Any]) -> bytes:
    """The payload as the server measures it: compact JSON."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


class JobCalls(BlobCalls):
    """The JobService calls."""

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
        schedule_time: datetime | None = None,
        schedule_delay: float | timedelta | None = None,
        concurrency_key: str = "",
        concurrency_limit: int = 0,
        concurrency_mode: ConcurrencyMode | str | None = None,
        deadline: datetime | float | timedelta | None = None,
        after: Sequence[Job | str] = (),
        after_failure: DependencyFailurePolicy | str | None = None,
    ) -> Job:
        """Create a job of ``type`` and return it (normally QUEUED).

        ``request_id`` is the idempotency key: submitting again with the same
        one returns the original job. When None, a fresh UUID is used, which
        still makes the call's own retries safe. ``max_attempts`` 0 means the
        queue's default. ``attempt_timeout`` (seconds or a timedelta) bounds
        each attempt's run time; None means the queue's default.

        ``schedule_time`` (a timezone-aware datetime) or ``schedule_delay``
        (seconds or a timedelta, counted from when the server accepts the
        call) delays the job's start: it is QUEUED, ``waiting_code``
        ``SCHEDULED``, until then (docs/scheduling.md). A repeated call with
        the same request_id returns the job first created, at its first time.

        ``concurrency_key``: at most ``concurrency_limit`` (0: 1) of the
        tenant's jobs with this key run at once; ``concurrency_mode`` says
        what a job of a full key does: wait (``"queue"``, the default) or be
        refused (``"reject"``: :class:`~jobplane.errors.ConcurrencyLimitReached`,
        whose ``holders`` name the jobs in flight). See docs/flow-control.md.

        ``deadline``: the time (a timezone-aware datetime) by which the job
        must have ended, or how long after the server accepts the call
        (seconds or a timedelta). Past it, a job not ended ends FAILED with
        error code ``DEADLINE_EXCEEDED``, whatever its stage or attempt; a
        running attempt is stopped (docs/scheduling.md#deadlines).
        ``after``: jobs of the tenant (or their names, ``jobs/{id}``) this one
        runs after: it waits QUEUED, ``waiting_code`` ``DEPENDENCIES``, until
        they have all succeeded. ``after_failure`` says what it does when one
        of them does not: end FAILED (``"fail"``, the default, error code
        DEPENDENCY_FAILED), end CANCELLED (``"cancel"``) or run once all have
        ended (``"run_anyway"``). See docs/workflows.md.
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
                schedule_time=schedule_time,
                schedule_delay=schedule_delay,
                concurrency_key=concurrency_key,
                concurrency_limit=concurrency_limit,
                concurrency_mode=concurrency_mode,
                deadline=deadline,
                after=after,
                after_failure=after_failure,
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
        set_schedule(request, spec.schedule_time, spec.schedule_delay)
        set_deadline(request, spec.deadline)
        with_concurrency(request, spec)
        with_after(request, spec)
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
        waiting_code: str | WaitingCode = "",
        parent: str | Job = "",
    ) -> JobPage:
        """One page of the caller's jobs, newest first.

        ``page_size`` 0 means the server default (50). Pass the page's
        ``next_page_token`` with the same filters to get the next page.
        ``waiting_code``: only QUEUED jobs waiting for that reason, as
        :meth:`get` shows them (``WaitingCode.SCHEDULED``: the delayed jobs
        whose time has not come). ``parent``: only the children of that job
        (``jobs/{id}`` or the job), the jobs its handler submitted.
        """
        request = jobs_pb2.ListJobsRequest(
            page_size=page_size,
            page_token=page_token,
            state=state_to_pb(state) if state is not None else jobs_pb2.Job.STATE_UNSPECIFIED,
            type=type or "",
            waiting_code=str(waiting_code),
            parent=parent if isinstance(parent, str) else parent.name,
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
        waiting_code: str | WaitingCode = "",
        parent: str | Job = "",
    ) -> AsyncGenerator[Job, None]:
        """Every job matching the filters, fetching page after page."""
        while True:
            page = await self.list(
                page_size=page_size,
                page_token=page_token,
                state=state,
                type=type,
                waiting_code=waiting_code,
                parent=parent,
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
