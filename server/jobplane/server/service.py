"""The job service: the rules of each call.

Servicers translate protobuf to these calls and back; nothing here knows gRPC.
A submit request's checks are :mod:`jobplane.server.job_requests`, the list's
page tokens :mod:`jobplane.server.page_tokens`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from jobplane.batcher import Batcher
from jobplane.errors import (
    BlobReferenceNotFound,
    InvalidArgument,
    JobNotFound,
    JobplaneError,
    UnroutableJobType,
    at_item,
    shown,
)
from jobplane.names import parse_job_name, validate_job_type
from jobplane.observe.metrics import NO_METRICS, Metrics
from jobplane.scheduling import DEFAULT_MAX_SCHEDULE_SECONDS, deadline_of, schedule_time_of
from jobplane.server.after_requests import with_after
from jobplane.server.feeds import FeedHub
from jobplane.server.job_requests import (
    MAX_BATCH_REQUEST_BYTES,
    MAX_BATCH_SUBMIT,
    MAX_PAYLOAD_DEPTH,
    MAX_REQUEST_ID_LENGTH,
    STRUCT_BYTES_PER_JSON_BYTE,
    SubmitRequest,
    check_blobs,
    check_id,
    check_labels,
    check_payload,
    check_request_id,
    check_waiting_code,
    max_request_bytes,
    pipeline_job,
)
from jobplane.server.key_requests import with_concurrency
from jobplane.server.page_tokens import decode_token, encode_token, extra_filters, filter_key
from jobplane.store.job_submit import (
    MAX_ATTEMPTS_LIMIT,
    MAX_CORRELATION_ID_BYTES,
    MAX_TIMEOUT_SECONDS,
    MIN_TIMEOUT_SECONDS,
)
from jobplane.store.job_tree import JobTree
from jobplane.store.jobs import JobStore, ListCursor, NewJob
from jobplane.store.listen import Listener
from jobplane.store.rows import sized_json
from jobplane.topology import Topology
from jobplane.types import Job, JobEvent, JobPage, JobState

if TYPE_CHECKING:
    from jobplane.blobs.store import BlobStore

# Named here by the servicers, the server and the tests, wherever defined.
__all__ = [
    "DEFAULT_PAGE_SIZE",
    "MAX_BATCH_REQUEST_BYTES",
    "MAX_BATCH_SUBMIT",
    "MAX_CORRELATION_ID_BYTES",
    "MAX_PAGE_SIZE",
    "MAX_PAYLOAD_DEPTH",
    "MAX_REASON_LENGTH",
    "STRUCT_BYTES_PER_JSON_BYTE",
    "SUBMIT_GROUPS_RUNNING",
    "SUBMIT_GROUP_MAX",
    "JobService",
    "SubmitRequest",
    "check_payload",
    "max_request_bytes",
]

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
MAX_REASON_LENGTH = 1024
#: Concurrent SubmitJob calls share a statement (ADR-0030): at most this many
#: in one, and at most SUBMIT_GROUPS_RUNNING such statements at once; calls
#: that arrive meanwhile wait for it to end and go out together. One at a
#: time: a statement takes a millisecond or two, far less than the call
#: around it, and the calls that arrive meanwhile are what makes a group.
SUBMIT_GROUP_MAX = 256
SUBMIT_GROUPS_RUNNING = 1


class JobService:
    """Every JobService call, for one tenant at a time."""

    def __init__(
        self,
        store: JobStore,
        hub: Listener,
        topology: Topology,
        *,
        max_payload_bytes: int = 256 * 1024,
        recheck_seconds: float = 30.0,
        blobs: BlobStore | None = None,
        max_schedule_seconds: float = DEFAULT_MAX_SCHEDULE_SECONDS,
    ) -> None:
        self._store = store
        #: How far ahead a job may be scheduled (docs/scheduling.md).
        self.max_schedule_seconds = max_schedule_seconds
        self._blobs = blobs
        self._topology = topology
        #: Where submits are counted (the server's; nothing by default).
        self.metrics: Metrics = NO_METRICS
        self._max_payload_bytes = max_payload_bytes
        self.feeds = FeedHub(store.read_streams, hub, recheck_seconds=recheck_seconds)
        self._submits: Batcher[tuple[uuid.UUID, NewJob], tuple[Job, bool]] = Batcher(
            self._submit_group,
            window=0.0,
            max_size=SUBMIT_GROUP_MAX,
            max_running=SUBMIT_GROUPS_RUNNING,
            on_group=self._counted,
        )

    def open(self) -> None:
        """Accept watch streams (again)."""
        self.feeds.open()

    def close_streams(self) -> None:
        """End every watch stream with UNAVAILABLE, so clients resume elsewhere."""
        self.feeds.close()

    def _counted(self, size: int) -> None:
        # Through self.metrics as it is then: the server sets it after __init__.
        self.metrics.submit_grouped(size)

    async def close(self) -> None:
        """Write the submits still waiting for a statement, and wait for them (10 s at most)."""
        await self._submits.stop(timeout=10)

    async def submit(self, tenant: uuid.UUID, request: SubmitRequest) -> Job:
        """Validate whole, then write job + first event + outbox row at once."""
        new = await self._validated(tenant, request)
        job, created = await self._submits.submit((tenant, new))
        if created:
            self.metrics.submitted(new.type, new.queue)
        return job

    async def _submit_group(
        self, items: list[tuple[uuid.UUID, NewJob]]
    ) -> list[tuple[Job, bool] | BaseException]:
        """Concurrent submits: one statement per tenant, each request with its own result.

        A request_id that comes twice (a caller's retry racing its first
        call) goes in a later statement, so it finds the first one's job.
        """
        results: list[tuple[Job, bool] | BaseException | None] = [None] * len(items)
        rounds: list[dict[uuid.UUID, list[int]]] = []
        seen: dict[tuple[uuid.UUID, str], int] = {}
        for i, (tenant, new) in enumerate(items):
            n = seen[tenant, new.request_id] = seen.get((tenant, new.request_id), -1) + 1
            if n == len(rounds):
                rounds.append({})
            rounds[n].setdefault(tenant, []).append(i)
        for by_tenant in rounds:
            await asyncio.gather(
                *(
                    self._submit_tenant(t, indexes, items, results)
                    for t, indexes in by_tenant.items()
                )
            )
        return [r if r is not None else RuntimeError("not submitted") for r in results]

    async def _submit_tenant(
        self,
        tenant: uuid.UUID,
        indexes: list[int],
        items: list[tuple[uuid.UUID, NewJob]],
        results: list[tuple[Job, bool] | BaseException | None],
    ) -> None:
        news = [items[i][1] for i in indexes]
        outcome: Sequence[tuple[Job, bool] | BaseException]
        try:
            outcome = await self._store.submit_each(tenant, news)
        except BlobReferenceNotFound as exc:
            # One of them references a blob deleted since its check: whose,
            # each alone says; the others go in.
            outcome = [exc] if len(news) == 1 else [await self._alone(tenant, n) for n in news]
        except Exception as exc:
            outcome = [exc] * len(news)
        for i, result in zip(indexes, outcome, strict=True):
            results[i] = result

    async def _alone(self, tenant: uuid.UUID, new: NewJob) -> tuple[Job, bool] | BaseException:
        try:
            return await self._store.submit(tenant, new)
        except Exception as exc:
            return exc

    async def submit_many(self, tenant: uuid.UUID, requests: Sequence[SubmitRequest]) -> list[Job]:
        """:meth:`submit` for 1 to :data:`MAX_BATCH_SUBMIT` jobs, all in one transaction.

        Every request is validated as :meth:`submit` validates it, in order;
        the first refusal is raised at its index (``requests[i].field``) and
        nothing is written. A request whose request_id the tenant has used
        is the stored job; two requests may not share one.
        """
        if not requests:
            raise InvalidArgument(
                f"requests is empty: send 1 to {MAX_BATCH_SUBMIT}", field="requests"
            )
        if len(requests) > MAX_BATCH_SUBMIT:
            raise InvalidArgument(
                f"at most {MAX_BATCH_SUBMIT} requests in one call, not {len(requests)}",
                field="requests",
                metadata={"limit": str(MAX_BATCH_SUBMIT)},
            )
        news: list[NewJob] = []
        first_of: dict[str, int] = {}
        for i, request in enumerate(requests):
            try:
                news.append(await self._validated(tenant, request))
            except JobplaneError as exc:
                raise at_item(exc, i) from None
            if request.request_id:
                first = first_of.setdefault(request.request_id, i)
                if first != i:
                    raise at_item(
                        InvalidArgument(
                            f"request_id {shown(request.request_id)} is also that of "
                            f"requests[{first}]: each request of a batch needs its own",
                            field="request_id",
                        ),
                        i,
                    )
        submitted = await self._store.submit_many(tenant, news)
        for new, (_, created) in zip(news, submitted, strict=True):
            if created:
                self.metrics.submitted(new.type, new.queue)
        return [job for job, _ in submitted]

    async def _validated(self, tenant: uuid.UUID, request: SubmitRequest) -> NewJob:
        """The job ``request`` asks for, checked whole; the first refusal raised."""
        job_type = validate_job_type(request.type)
        pipeline = self._topology.pipeline(job_type)
        queue = self._topology.route(job_type)
        if pipeline is not None:
            queue = self._topology.queue(pipeline.stages[0].queue)
        if queue is None:
            raise UnroutableJobType(
                f"no queue of the topology takes job type {job_type!r}", field="type"
            )
        payload_json = sized_json(request.payload, self._max_payload_bytes)
        check_payload(request.payload)
        if request.max_attempts < 0 or request.max_attempts > MAX_ATTEMPTS_LIMIT:
            raise InvalidArgument(
                f"max_attempts must be 0 (queue default) .. {MAX_ATTEMPTS_LIMIT}",
                field="max_attempts",
            )
        check_request_id(request.request_id, MAX_REQUEST_ID_LENGTH)
        check_id(request.correlation_id, "correlation_id", max_bytes=MAX_CORRELATION_ID_BYTES)
        check_labels(request.labels)
        timeout = queue.timeout_seconds
        if request.timeout_seconds is not None:
            if not MIN_TIMEOUT_SECONDS <= request.timeout_seconds <= MAX_TIMEOUT_SECONDS:
                raise InvalidArgument(
                    f"timeout must be at least {MIN_TIMEOUT_SECONDS:g} and at most "
                    f"{MAX_TIMEOUT_SECONDS:g} seconds",
                    field="timeout",
                )
            timeout = request.timeout_seconds
        now = datetime.now(UTC)
        schedule = schedule_time_of(
            request.schedule_time,
            request.schedule_delay_seconds,
            now=now,
            horizon_seconds=self.max_schedule_seconds,
        )
        deadline = deadline_of(
            request.deadline,
            request.deadline_after_seconds,
            now=now,
            horizon_seconds=self.max_schedule_seconds,
            schedule_time=schedule,
        )
        payload_blob, references = await check_blobs(self._blobs, tenant, request)
        if pipeline is not None:
            new = pipeline_job(request, pipeline, payload_blob, references)
            new = replace(new, schedule_time=schedule, deadline=deadline, payload_json=payload_json)
        else:
            new = NewJob(
                type=job_type,
                queue=queue.name,
                payload=request.payload,
                request_id=request.request_id or str(uuid.uuid4()),
                max_attempts=request.max_attempts or queue.max_attempts,
                correlation_id=request.correlation_id,
                labels=dict(request.labels),
                timeout_seconds=timeout,
                payload_blob=payload_blob,
                blob_references=references,
                schedule_time=schedule,
                deadline=deadline,
                payload_json=payload_json,
            )
        new = with_concurrency(
            new,
            request.concurrency_key,
            request.concurrency_limit,
            request.concurrency_mode,
        )
        return with_after(new, request.after, request.after_failure)

    async def get(self, tenant: uuid.UUID, name: str) -> Job:
        """One job by name."""
        return await self._store.get(tenant, parse_job_name(name))

    async def list(
        self,
        tenant: uuid.UUID,
        *,
        page_size: int,
        page_token: str,
        state: JobState | None,
        job_type: str,
        labels: dict[str, str] | None = None,
        created_after: datetime | None = None,
        created_before: datetime | None = None,
        waiting_code: str = "",
        parent: str = "",
    ) -> JobPage:
        """A page of jobs, newest first, with an opaque keyset token.

        ``labels`` (jobs carrying all of them) and the create-time bounds are
        the dashboard's filters; ``waiting_code``: QUEUED jobs waiting for
        that reason, as GetJob reads them. A token holds to the filters it
        was made for.
        """
        if page_size < 0:
            raise InvalidArgument("page_size must not be negative", field="page_size")
        limit = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        if job_type:
            validate_job_type(job_type)
        if labels:
            check_labels(labels)
        check_waiting_code(waiting_code, state)
        parent_id = parse_job_name(parent, field="parent") if parent else None
        extra = extra_filters(labels, created_after, created_before, waiting_code, parent)
        filters = filter_key(state, job_type, extra)
        cursor = decode_token(page_token, filters) if page_token else None
        jobs = await self._store.list_jobs(
            tenant,
            limit=limit + 1,
            after=cursor,
            state=state,
            job_type=job_type or None,
            labels=labels or None,
            created_after=created_after,
            created_before=created_before,
            waiting_code=waiting_code,
            parent=parent_id,
        )
        next_token = ""
        if len(jobs) > limit:
            jobs = jobs[:limit]
            cursor = ListCursor(jobs[-1].create_time, uuid.UUID(jobs[-1].id))
            next_token = encode_token(cursor, filters)
        return JobPage(jobs=jobs, next_page_token=next_token)

    def page_token_after(
        self,
        job: Job,
        *,
        state: JobState | None,
        job_type: str,
        waiting_code: str = "",
        parent: str = "",
    ) -> str:
        """The token of the page that follows ``job`` in a list with these filters.

        For a caller that sends fewer jobs than a page held (e.g. to keep a
        reply under a size), and lets the client continue after the last one.
        """
        cursor = ListCursor(job.create_time, uuid.UUID(job.id))
        extra = extra_filters(None, None, None, waiting_code, parent)
        return encode_token(cursor, filter_key(state, job_type, extra))

    async def count_states(self, tenant: uuid.UUID, *, cap: int = 10_000) -> dict[JobState, int]:
        """The tenant's jobs in each state, each count stopping at ``cap``."""
        return await self._store.count_states(tenant, cap=cap)

    async def milestones(
        self, tenant: uuid.UUID, name: str, limit: int = 1000
    ) -> Sequence[JobEvent]:
        """The job's events other than progress, oldest first: its attempts and outcomes."""
        return await self._store.milestones(tenant, parse_job_name(name), limit)

    async def tree(self, tenant: uuid.UUID, name: str) -> JobTree:
        """The tree the job belongs to: its root and the root's descendants, bounded."""
        tree = await self._store.tree(tenant, parse_job_name(name))
        if tree is None:
            raise JobNotFound(f"{name} not found")
        return tree

    async def recent_events(
        self, tenant: uuid.UUID, job: Job, limit: int = 200
    ) -> Sequence[JobEvent]:
        """The job's last ``limit`` events (up to ``job.last_seq``), oldest first."""
        read = await self._store.read_stream(
            tenant, uuid.UUID(job.id), max(0, job.last_seq - limit), limit
        )
        return read.events

    async def queue_rates(
        self, tenant: uuid.UUID, *, window_seconds: float = 300.0
    ) -> dict[str, tuple[int, int, int]]:
        """Per queue: the tenant's jobs submitted, succeeded, failed in the window."""
        return await self._store.queue_rates(tenant, window_seconds=window_seconds, scan=100_000)

    async def cancel(self, tenant: uuid.UUID, name: str, reason: str) -> Job:
        """Cancel a queued job, or ask a running one to stop."""
        if len(reason) > MAX_REASON_LENGTH:
            raise InvalidArgument(
                f"reason is longer than {MAX_REASON_LENGTH} characters", field="reason"
            )
        if "\x00" in reason:
            raise InvalidArgument("reason has a NUL character", field="reason")
        return await self._store.cancel(tenant, parse_job_name(name), reason)

    async def retry(self, tenant: uuid.UUID, name: str, from_stage: str = "") -> Job:
        """A new attempt of a FAILED or CANCELLED job.

        A pipeline job resumes at the stage that failed (or was cancelled),
        or at ``from_stage``, running it and every later stage again.
        """
        if len(from_stage) > 64 or "\x00" in from_stage:
            raise InvalidArgument("from_stage is not a stage name", field="from_stage")
        return await self._store.retry(tenant, parse_job_name(name), from_stage=from_stage)

    async def watch(self, tenant: uuid.UUID, name: str, after_seq: int) -> AsyncIterator[JobEvent]:
        """Events with seq > after_seq in order, then live ones, until the end.

        The stream ends after the terminal event, or at once when that event is
        at or before ``after_seq``.
        """
        job_id = parse_job_name(name)
        if after_seq < 0:
            raise InvalidArgument("after_seq must not be negative", field="after_seq")
        async for event in self.feeds.watch(tenant, job_id, after_seq):
            yield event
