"""The job service: request validation and the rules of each call.

Servicers translate protobuf to these calls and back; nothing here knows gRPC.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import math
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from jobplane.batcher import Batcher
from jobplane.blobs.names import parse_blob_name, referenced_digests
from jobplane.config import MAX_OFFLOADED_JSON_BYTES
from jobplane.errors import (
    BlobNotFound,
    BlobReferenceNotFound,
    BlobsDisabled,
    InvalidArgument,
    JobplaneError,
    PayloadTooLarge,
    UnroutableJobType,
    at_item,
    shown,
)
from jobplane.names import parse_job_name, validate_job_type
from jobplane.observe.metrics import NO_METRICS, Metrics
from jobplane.server.feeds import FeedHub
from jobplane.store.jobs import JobStore, ListCursor, NewJob, pipeline_stages
from jobplane.store.listen import Listener
from jobplane.store.rows import check_payload_size
from jobplane.topology import PipelineSpec, Topology
from jobplane.types import BlobRef, Job, JobEvent, JobPage, JobState

if TYPE_CHECKING:
    from jobplane.blobs.store import BlobStore

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
MAX_ATTEMPTS_LIMIT = 100
#: The most requests one BatchSubmitJobs call may hold (AIP-233's usual bound).
MAX_BATCH_SUBMIT = 1000
#: The largest BatchSubmitJobs body the server reads (the SDK splits its
#: batches below half of it): 1,000 jobs of 8 KiB payloads fit.
MAX_BATCH_REQUEST_BYTES = 16 * 1024 * 1024
MAX_REQUEST_ID_LENGTH = 256
# The relay sends correlation_id as the AMQP correlation-id property, a short
# string of at most 255 bytes: a longer one could never be published.
MAX_CORRELATION_ID_BYTES = 255
MAX_LABELS = 64
_LABEL_KEY = re.compile(r"[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?")
# What an id may not hold: the C0 control characters.
_CONTROL = re.compile(r"[\x00-\x1f]")
MAX_LABEL_VALUE = 256
MAX_BLOB_REFERENCES = 10_000
MAX_REASON_LENGTH = 1024
# A job's timeout is read back in whole milliseconds or finer; anything
# shorter would read back as no time at all.
MIN_TIMEOUT_SECONDS = 0.001
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0
# Objects and arrays on the deepest path of a payload, the payload itself
# counted. protobuf refuses to decode messages nested more than 100 deep, and
# every object level of a Struct costs three of those (Struct, map entry,
# Value): a Job inside a ListJobsResponse holds 33 object levels at most, so
# 32 leaves one to spare, for the client that decodes the list.
MAX_PAYLOAD_DEPTH = 32
# Tokens this server issues are about 150 characters.
MAX_PAGE_TOKEN_LENGTH = 512
#: Concurrent SubmitJob calls share a statement (ADR-0030): at most this many
#: in one, and at most SUBMIT_GROUPS_RUNNING such statements at once; calls
#: that arrive meanwhile wait for it to end and go out together. One at a
#: time: a statement takes a millisecond or two, far less than the call
#: around it, and the calls that arrive meanwhile are what makes a group.
SUBMIT_GROUP_MAX = 256
SUBMIT_GROUPS_RUNNING = 1

# The Struct encoding of a payload is at most 5.5 times its JSON: a list of
# one-digit numbers costs 2 bytes a number in JSON ("0,") and 11 in a Struct
# (a Value of a tag and 8 bytes, framed as a list element). Everything else a
# SubmitJobRequest holds at its limits (64 labels of 256 four-byte characters,
# the ids, the type) takes less than 72 KiB.
STRUCT_BYTES_PER_JSON_BYTE = 5.5
REQUEST_OVERHEAD_BYTES = 128 * 1024


def max_request_bytes(max_payload_bytes: int) -> int:
    """The largest body a valid request can need, for the server's receive limit."""
    return math.ceil(max_payload_bytes * STRUCT_BYTES_PER_JSON_BYTE) + REQUEST_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """A SubmitJob call, as plain values."""

    type: str
    payload: dict[str, Any]
    request_id: str = ""
    correlation_id: str = ""
    max_attempts: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    timeout_seconds: float | None = None
    #: ``blobs/{sha256}`` of the caller's blob holding the payload; ``payload`` empty.
    payload_blob: str = ""
    #: Names of blobs the job uses that the payload does not show.
    blob_references: tuple[str, ...] = ()


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
    ) -> None:
        self._store = store
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
        check_payload_size(request.payload, self._max_payload_bytes)
        check_payload(request.payload)
        if request.max_attempts < 0 or request.max_attempts > MAX_ATTEMPTS_LIMIT:
            raise InvalidArgument(
                f"max_attempts must be 0 (queue default) .. {MAX_ATTEMPTS_LIMIT}",
                field="max_attempts",
            )
        _check_id(request.request_id, "request_id", max_chars=MAX_REQUEST_ID_LENGTH)
        _check_id(request.correlation_id, "correlation_id", max_bytes=MAX_CORRELATION_ID_BYTES)
        _check_labels(request.labels)
        timeout = queue.timeout_seconds
        if request.timeout_seconds is not None:
            if not MIN_TIMEOUT_SECONDS <= request.timeout_seconds <= MAX_TIMEOUT_SECONDS:
                raise InvalidArgument(
                    f"timeout must be at least {MIN_TIMEOUT_SECONDS:g} and at most "
                    f"{MAX_TIMEOUT_SECONDS:g} seconds",
                    field="timeout",
                )
            timeout = request.timeout_seconds
        payload_blob, references = await self._check_blobs(tenant, request)
        if pipeline is not None:
            return _pipeline_job(request, pipeline, payload_blob, references)
        return NewJob(
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
        )

    async def _check_blobs(
        self, tenant: uuid.UUID, request: SubmitRequest
    ) -> tuple[BlobRef | None, tuple[str, ...]]:
        """Refuse references to blobs the tenant does not have; the payload's blob, if
        any, and the digests of ``blob_references``.

        The references are recorded with the job, in the statement that inserts
        it: the payload's names by the table's trigger (migration 0013), the
        others by the machine's BlobReferences hook.
        """
        digests = referenced_digests(request.payload)
        if request.payload_blob and request.payload:
            raise InvalidArgument(
                "payload_blob replaces payload: send one of them", field="payload_blob"
            )
        if len(request.blob_references) > MAX_BLOB_REFERENCES:
            raise InvalidArgument(
                f"at most {MAX_BLOB_REFERENCES} blob_references", field="blob_references"
            )
        extra: set[str] = set()
        for name in request.blob_references:
            try:
                extra.add(parse_blob_name(name))
            except ValueError as exc:
                raise InvalidArgument(str(exc), field="blob_references") from None
        references = tuple(sorted(extra - digests))
        if not digests and not extra and not request.payload_blob:
            return None, ()
        if self._blobs is None:
            raise BlobsDisabled(
                "this server has no object store: a payload cannot reference blobs",
                field="payload_blob" if request.payload_blob else "payload",
            )
        missing = (digests | extra) - await self._blobs.owned(tenant, digests | extra)
        if missing:
            raise BlobReferenceNotFound(
                f"the job references blobs/{min(missing)}, which does not exist",
                field="payload" if missing & digests else "blob_references",
            )
        if not request.payload_blob:
            return None, references
        try:
            parse_blob_name(request.payload_blob)
            info = await self._blobs.stat(tenant, request.payload_blob)
        except (ValueError, BlobNotFound) as exc:
            raise BlobReferenceNotFound(
                f"payload_blob: {exc}"
                if isinstance(exc, ValueError)
                else f"payload_blob {shown(request.payload_blob)} does not exist",
                field="payload_blob",
            ) from None
        if info.size > MAX_OFFLOADED_JSON_BYTES:
            raise PayloadTooLarge(
                f"a payload by reference may have at most {MAX_OFFLOADED_JSON_BYTES} bytes "
                f"(the worker reads it whole), not {info.size}",
                field="payload_blob",
            )
        return BlobRef(info.name, info.digest, info.size), references

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
    ) -> JobPage:
        """A page of jobs, newest first, with an opaque keyset token.

        ``labels`` (jobs carrying all of them) and the create-time bounds are
        the dashboard's filters; a token holds to the filters it was made for.
        """
        if page_size < 0:
            raise InvalidArgument("page_size must not be negative", field="page_size")
        limit = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        if job_type:
            validate_job_type(job_type)
        if labels:
            _check_labels(labels)
        extra = _extra_filters(labels, created_after, created_before)
        filters = _filter_key(state, job_type, extra)
        cursor = _decode_token(page_token, filters) if page_token else None
        jobs = await self._store.list_jobs(
            tenant,
            limit=limit + 1,
            after=cursor,
            state=state,
            job_type=job_type or None,
            labels=labels or None,
            created_after=created_after,
            created_before=created_before,
        )
        next_token = ""
        if len(jobs) > limit:
            jobs = jobs[:limit]
            cursor = ListCursor(jobs[-1].create_time, uuid.UUID(jobs[-1].id))
            next_token = _encode_token(cursor, filters)
        return JobPage(jobs=jobs, next_page_token=next_token)

    def page_token_after(self, job: Job, *, state: JobState | None, job_type: str) -> str:
        """The token of the page that follows ``job`` in a list with these filters.

        For a caller that sends fewer jobs than a page held (e.g. to keep a
        reply under a size), and lets the client continue after the last one.
        """
        cursor = ListCursor(job.create_time, uuid.UUID(job.id))
        return _encode_token(cursor, _filter_key(state, job_type))

    async def count_states(self, tenant: uuid.UUID, *, cap: int = 10_000) -> dict[JobState, int]:
        """The tenant's jobs in each state, each count stopping at ``cap``."""
        return await self._store.count_states(tenant, cap=cap)

    async def milestones(
        self, tenant: uuid.UUID, name: str, limit: int = 1000
    ) -> Sequence[JobEvent]:
        """The job's events other than progress, oldest first: its attempts and outcomes."""
        return await self._store.milestones(tenant, parse_job_name(name), limit)

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


def _pipeline_job(
    request: SubmitRequest,
    pipeline: PipelineSpec,
    payload_blob: BlobRef | None = None,
    references: tuple[str, ...] = (),
) -> NewJob:
    """A pipeline job: its stages, as the topology declares them now, go with it.

    A request's max_attempts or timeout, when set, is every stage's.
    """
    stages = pipeline_stages(
        pipeline, max_attempts=request.max_attempts, timeout_seconds=request.timeout_seconds
    )
    return NewJob(
        type=pipeline.name,
        queue=stages[0].queue,
        payload=request.payload,
        request_id=request.request_id or str(uuid.uuid4()),
        max_attempts=request.max_attempts,
        correlation_id=request.correlation_id,
        labels=dict(request.labels),
        timeout_seconds=request.timeout_seconds or 0.0,
        pipeline_version=pipeline.version,
        stages=stages,
        payload_blob=payload_blob,
        blob_references=references,
    )


def _check_id(
    value: str, field_name: str, *, max_chars: int | None = None, max_bytes: int | None = None
) -> None:
    if max_chars is not None and len(value) > max_chars:
        raise InvalidArgument(
            f"{field_name} is longer than {max_chars} characters", field=field_name
        )
    if max_bytes is not None and len(value.encode()) > max_bytes:
        raise InvalidArgument(
            f"{field_name} is longer than {max_bytes} bytes in UTF-8", field=field_name
        )
    if _CONTROL.search(value):
        raise InvalidArgument(f"{field_name} has control characters", field=field_name)


def _check_labels(labels: dict[str, str]) -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"at most {MAX_LABELS} labels", field="labels")
    for key, value in labels.items():
        if not _LABEL_KEY.fullmatch(key):
            # The field names the map, not the key: the key is what is wrong,
            # and it may be of any length.
            raise InvalidArgument(
                f"label key {shown(key)} must be 1..63 lowercase letters, digits, "
                "'.', '_', '-', '/'",
                field="labels",
            )
        if len(value) > MAX_LABEL_VALUE:
            raise InvalidArgument(
                f"label {key!r} is longer than {MAX_LABEL_VALUE} characters",
                field=f"labels[{key}]",
            )
        if "\x00" in value:
            raise InvalidArgument(f"label {key!r} has a NUL character", field=f"labels[{key}]")


def check_payload(payload: dict[str, Any]) -> None:
    """Refuse what JSON, Postgres' jsonb or a client's decoder cannot carry.

    Postgres refuses NUL in jsonb strings and keys, JSON has no NaN or
    Infinity, and a payload nested deeper than :data:`MAX_PAYLOAD_DEPTH` could
    be stored and read alone but not inside a list of jobs.
    """
    # Iterative, so no payload can exhaust the interpreter's stack here; each
    # entry keeps its parent's trail rather than a path string, which would
    # copy every ancestor's key for every value.
    pending: list[tuple[Any, int, _Trail]] = [(payload, 1, None)]
    while pending:
        value, depth, trail = pending.pop()
        if isinstance(value, dict | list) and depth > MAX_PAYLOAD_DEPTH:
            raise InvalidArgument(
                f"payload is nested more than {MAX_PAYLOAD_DEPTH} objects or arrays deep "
                f"at {_path(trail)}",
                field="payload",
                metadata={"limit": str(MAX_PAYLOAD_DEPTH)},
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if "\x00" in key:
                    raise InvalidArgument(
                        f"payload has a key with a NUL character at {_path((trail, key))}",
                        field="payload",
                    )
                pending.append((item, depth + 1, (trail, key)))
        elif isinstance(value, list):
            pending.extend((item, depth + 1, (trail, i)) for i, item in enumerate(value))
        elif isinstance(value, str) and "\x00" in value:
            raise InvalidArgument(f"payload has a NUL character at {_path(trail)}", field="payload")
        elif isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgument(
                f"payload has {value} at {_path(trail)}; JSON numbers are finite",
                field="payload",
            )


# Where a value sits in a payload: (the parent's trail, key or index), None at the top.
_Trail = tuple[Any, str | int] | None


def _path(trail: _Trail) -> str:
    steps: list[str] = []
    while trail is not None:
        trail, step = trail
        steps.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    return shown("payload" + "".join(reversed(steps)))


def _extra_filters(
    labels: dict[str, str] | None, after: datetime | None, before: datetime | None
) -> str:
    """The filters past state and type, as text for the token's filter key ("" for none)."""
    if not labels and after is None and before is None:
        return ""
    return json.dumps(
        [
            sorted((labels or {}).items()),
            after.isoformat() if after else "",
            before.isoformat() if before else "",
        ]
    )


def _filter_key(state: JobState | None, job_type: str, extra: str = "") -> str:
    raw = f"{state.value if state else ''}|{job_type}"
    if extra:
        raw += f"|{extra}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _encode_token(cursor: ListCursor, filters: str) -> str:
    raw = json.dumps(
        {"t": cursor.create_time.isoformat(), "i": str(cursor.job_id), "f": filters},
        separators=(",", ":"),
    )
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_token(token: str, filters: str) -> ListCursor:
    bad = InvalidArgument("page_token is not a token this server created", field="page_token")
    if len(token) > MAX_PAGE_TOKEN_LENGTH:
        raise bad
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (ValueError, binascii.Error, RecursionError):
        raise bad from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("t", "i", "f")):
        raise bad
    try:
        create_time = datetime.fromisoformat(data["t"])
        job_id = uuid.UUID(data["i"])
        if create_time.tzinfo is None:
            raise bad
        # Postgres compares in UTC; a time with no UTC equivalent is no cursor.
        utc_time = create_time.astimezone(UTC)
    except (ValueError, OverflowError):
        raise bad from None
    if data["f"] != filters:
        raise InvalidArgument(
            "page_token was created for other filters; keep state and type the same",
            field="page_token",
        )
    return ListCursor(utc_time, job_id)
