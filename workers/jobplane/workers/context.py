"""The context an ``async def`` handler gets: :class:`JobContext`.

It reads the job from the claimed :class:`~jobplane.store.attempts.Attempt`,
hands progress reports to the worker's writer (:class:`ProgressSink`), keeps
emitted events until the outcome is written, and reaches the tenant's blobs
through :class:`BlobAccess`. Handlers import it from
:mod:`jobplane.workers.handlers`; the worker builds one per attempt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Executor
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import Any, Protocol

from jobplane.blobs.payloads import payload_from_blob
from jobplane.blobs.reader import BlobInfo, BlobReader
from jobplane.errors import (
    BlobNotFound,
    BlobsDisabled,
    BlobStoreUnavailable,
    BlobTooLarge,
    JobplaneError,
    PayloadTooLarge,
)
from jobplane.events.envelope import Event, EventError
from jobplane.fanout import FAN_OUT_REFUSED, MAX_FAN_OUT, ItemResult
from jobplane.names import job_name
from jobplane.store.attempts import Attempt, ProgressUpdate
from jobplane.store.events import emitted
from jobplane.store.machine import MAX_EMITTED_BYTES, MAX_EMITTED_EVENTS, Emitted
from jobplane.store.rows import check_payload_size, dumps
from jobplane.workers.children import ChildRequest
from jobplane.workers.errors import EmitError, PermanentError, RetryableError, SubmitError
from jobplane.workers.values import clean_text, json_problem, json_size, safe_str

#: Bytes of an emitted event's payload when the worker does not say (its
#: payload limit, JOBPLANE_MAX_PAYLOAD_BYTES, as for results).
DEFAULT_EVENT_PAYLOAD_BYTES = 256 * 1024
#: Bytes of one progress report's ``data``, as stored.
MAX_PROGRESS_DATA_BYTES = 64 * 1024
MAX_PROGRESS_MESSAGE = 4096


class ProgressSink(Protocol):
    """Where a context's progress reports go (the worker's coalescing writer)."""

    async def add(self, update: ProgressUpdate) -> None:
        """Queue one update for writing."""


class BlobAccess(Protocol):
    """What a context needs of an object store: :class:`jobplane.blobs.BlobStore`
    in a worker, an in-memory one in :mod:`jobplane.testing`."""

    def open(self, tenant_id: uuid.UUID, name: str) -> AbstractAsyncContextManager[BlobReader]:
        """The tenant's blob, streamed."""
        ...

    async def read_bytes(
        self, tenant_id: uuid.UUID, name: str, *, limit: int | None = None
    ) -> bytes:
        """The tenant's whole blob."""
        ...

    async def put_bytes(
        self, tenant_id: uuid.UUID, data: bytes, *, content_type: str | None = None
    ) -> BlobInfo:
        """Store ``data`` as a blob of the tenant."""
        ...

    async def put_stream(
        self,
        tenant_id: uuid.UUID,
        chunks: AsyncIterable[bytes],
        *,
        content_type: str | None = None,
    ) -> BlobInfo:
        """Store the bytes of ``chunks`` as a blob of the tenant."""
        ...

    async def reference(
        self, tenant_id: uuid.UUID, job_id: uuid.UUID, digest: str, role: str
    ) -> None:
        """Record that the job references the blob."""
        ...


class ChildSubmitter(Protocol):
    """Where ``ctx.submit`` goes: :class:`jobplane.workers.children.WorkerChildren`
    in a worker, a recorder in :mod:`jobplane.testing`."""

    async def submit(self, attempt: Attempt, request: ChildRequest) -> tuple[str, bool]:
        """The child's name, and whether it was created now."""
        ...


class JobContext:
    """What a handler gets: the job, and ways to report progress and emit events."""

    def __init__(
        self,
        attempt: Attempt,
        sink: ProgressSink,
        *,
        max_event_payload_bytes: int = DEFAULT_EVENT_PAYLOAD_BYTES,
        blobs: BlobAccess | None = None,
        payload: dict[str, Any] | None = None,
        threads: Executor | None = None,
        children: ChildSubmitter | None = None,
    ) -> None:
        self._attempt = attempt
        self._children = children
        self._sink = sink
        self._blobs = blobs
        # Where a plain ``def`` handler runs (None: the event loop's default executor).
        self._threads = threads
        # Set by the worker when it stops the attempt; read from a handler's thread.
        self._stopped = False
        # An offloaded payload, read from its blob by the worker.
        self._payload = payload
        self._max_event_payload_bytes = max_event_payload_bytes
        self._emitted: list[Emitted] = []
        self._emitted_bytes = 0
        self._spawned: list[dict[str, Any]] = []

    @property
    def name(self) -> str:
        """``jobs/{id}``"""
        return job_name(self._attempt.job_id)

    @property
    def id(self) -> str:
        """The job id."""
        return str(self._attempt.job_id)

    @property
    def type(self) -> str:
        """The job type."""
        return self._attempt.type

    @property
    def payload(self) -> dict[str, Any]:
        """The submitted payload (a fresh copy is not made: do not mutate it).

        An offloaded payload (submitted by reference) is here whole: the
        worker reads it from its blob before the handler runs.
        """
        return self._payload if self._payload is not None else self._attempt.payload

    @property
    def tenant_id(self) -> str:
        """The job's tenant (from the job row): the only tenant whose blobs it can read."""
        return str(self._attempt.tenant_id)

    def open_blob(self, name: str) -> AbstractAsyncContextManager[BlobReader]:
        """``async with ctx.open_blob("blobs/…") as reader``: one of the tenant's blobs, streamed.

        ``reader.info`` has its name, digest, size and content type;
        ``await reader.read(n)`` and ``async for chunk in reader.iter_chunks(size)``
        read it. A name the job's tenant has no blob of (another tenant's is
        one) raises :class:`PermanentError` ``BLOB_NOT_FOUND``; an object store
        outage :class:`RetryableError` ``BLOB_STORE_UNAVAILABLE``, while opening
        or reading.
        """
        return self._open_blob(name)

    @contextlib.asynccontextmanager
    async def _open_blob(self, name: str) -> AsyncIterator[BlobReader]:
        store = self._blob_store()
        with _blob_errors():
            async with store.open(self._attempt.tenant_id, name) as reader:
                yield reader

    async def read_blob(self, name: str, *, limit: int | None = None) -> bytes:
        """The whole blob (see :meth:`open_blob`); larger than ``limit`` bytes:
        :class:`PermanentError` ``BLOB_TOO_LARGE``."""
        store = self._blob_store()
        with _blob_errors():
            return await store.read_bytes(self._attempt.tenant_id, name, limit=limit)

    async def put_blob(
        self, data: bytes | AsyncIterable[bytes], *, content_type: str | None = None
    ) -> str:
        """Store ``data`` as a blob of the job's tenant; returns its name (``blobs/…``).

        The job references it (role ``output``), so deleting the job frees it.
        The same bytes give the same name.
        """
        store = self._blob_store()
        tenant = self._attempt.tenant_id
        with _blob_errors():
            if isinstance(data, bytes | bytearray | memoryview):
                info = await store.put_bytes(tenant, bytes(data), content_type=content_type)
            else:
                info = await store.put_stream(tenant, data, content_type=content_type)
            await store.reference(tenant, self._attempt.job_id, info.digest, "output")
        return info.name

    def _blob_store(self) -> BlobAccess:
        if self._blobs is None:
            raise PermanentError(
                "this worker has no object store (JOBPLANE_S3_URL is not set): "
                "a job that uses blobs cannot run here",
                code=BlobsDisabled.reason,
            )
        return self._blobs

    @property
    def cancelled(self) -> bool:
        """True once the worker stopped this attempt (see :class:`AttemptStopped`).

        A plain ``def`` handler that computes without calling the context checks
        it to stop early; an ``async def`` handler is cancelled at its next
        ``await`` anyway.
        """
        return self._stopped

    def _stop(self) -> None:
        """The worker stopped the attempt: from now on :attr:`cancelled` is True."""
        self._stopped = True

    @property
    def attempt(self) -> int:
        """This attempt's number, from 1."""
        return self._attempt.attempt

    @property
    def max_attempts(self) -> int:
        """Attempts the job may use."""
        return self._attempt.max_attempts

    @property
    def correlation_id(self) -> str:
        """The caller's correlation id."""
        return self._attempt.correlation_id

    @property
    def request_id(self) -> str:
        """The idempotency key the job was submitted with."""
        return self._attempt.request_id

    @property
    def pipeline(self) -> str:
        """The pipeline this job runs ("" for a plain job); ``type`` is then its stage's."""
        stage = self._attempt.stage
        return stage.pipeline if stage is not None else ""

    @property
    def pipeline_version(self) -> str:
        """The version of the pipeline as submitted ("" for a plain job or an unversioned one)."""
        stage = self._attempt.stage
        return stage.pipeline_version if stage is not None else ""

    @property
    def stage(self) -> str:
        """The name of the pipeline stage this attempt runs ("" for a plain job)."""
        stage = self._attempt.stage
        return stage.name if stage is not None else ""

    @property
    def stage_version(self) -> str:
        """The version the topology gives this stage (its algorithm, model or configuration)."""
        stage = self._attempt.stage
        return stage.version if stage is not None else ""

    @property
    def inputs(self) -> Mapping[str, dict[str, Any]]:
        """The results of the pipeline's earlier stages, by stage name, in order.

        ``payload`` is the pipeline's input; a plain job has no inputs.
        """
        stage = self._attempt.stage
        return stage.inputs if stage is not None else {}

    @property
    def previous(self) -> dict[str, Any] | None:
        """The result of the stage just before this one, or None (first stage, plain job)."""
        inputs = self.inputs
        return list(inputs.values())[-1] if inputs else None

    @property
    def fans_out(self) -> bool:
        """Whether the next stage is a fan-out stage: this one's result (a list, or
        what :meth:`spawn` gathered) becomes one child job per item (ADR-0047)."""
        stage = self._attempt.stage
        return stage is not None and stage.fans_out

    @property
    def results(self) -> tuple[ItemResult, ...]:
        """In the stage after a fan-out stage (its join): the children's results, in
        item order, each with its state and, when it did not succeed, its error.
        Empty for any other stage."""
        stage = self._attempt.stage
        return stage.results or () if stage is not None else ()

    def spawn(self, payload: Mapping[str, Any]) -> None:
        """Add an item to this stage's fan-out: a child job running the next
        stage with ``payload``. Items come before those of a returned list.
        Only in a stage before a fan-out stage; nothing is written until the
        stage succeeds (the children commit with its success, or not at all).
        Anywhere else, with an item that is not an object, or past
        :data:`~jobplane.fanout.MAX_FAN_OUT` items, it raises
        :class:`PermanentError` (``FAN_OUT_REFUSED``)."""
        # Each a mistake no other attempt would undo: the stage fails for good.
        if not self.fans_out:
            raise PermanentError(
                "spawn() is for a stage before a fan-out stage", code=FAN_OUT_REFUSED
            )
        if not isinstance(payload, Mapping):
            raise PermanentError(
                "a spawned item must be an object (the child's payload)", code=FAN_OUT_REFUSED
            )
        if len(self._spawned) >= MAX_FAN_OUT:
            raise PermanentError(
                f"at most {MAX_FAN_OUT} items may be spawned", code=FAN_OUT_REFUSED
            )
        self._spawned.append(dict(payload))

    async def progress(
        self, fraction: float, message: str = "", data: dict[str, Any] | None = None
    ) -> None:
        """Report progress (0..1) with a message and optional JSON data.

        Reports are written in order, a few milliseconds later, many in one
        transaction. The message is cut at 4096 characters; ``data`` must be
        JSON (finite numbers, no NUL characters, at most 64 KiB), else
        :class:`ValueError`. Raises :class:`~jobplane.store.attempts.LeaseLost`
        when this attempt no longer owns the job.
        """
        if not isinstance(fraction, int | float) or not math.isfinite(fraction):
            raise ValueError(f"progress fraction must be a finite number, got {fraction!r}")
        if data is not None and not isinstance(data, dict):
            raise TypeError(f"progress data must be a dict, got {type(data).__name__}")
        data = dict(data or {})
        problem = json_problem(data, max_bytes=MAX_PROGRESS_DATA_BYTES)
        if problem is None and json_size(data) > MAX_PROGRESS_DATA_BYTES:
            problem = f"larger than {MAX_PROGRESS_DATA_BYTES} bytes"
        if problem is not None:
            raise ValueError(f"progress data cannot be stored: {problem}")
        await self._sink.add(
            ProgressUpdate(
                progress=min(1.0, max(0.0, float(fraction))),
                message=clean_text(safe_str(message), MAX_PROGRESS_MESSAGE),
                data=data,
            )
        )

    def emit(
        self,
        event_type: str,
        payload: dict[str, Any] | None = None,
        *,
        causation_id: str | None = None,
        project_id: str | None = None,
        event_id: uuid.UUID | None = None,
    ) -> uuid.UUID:
        """Emit a domain event, published only if this attempt succeeds; returns its id.

        The event is kept in the attempt and written with its SUCCEEDED
        outcome, in the same statement, only if this attempt still owns the
        job then: an attempt that fails, is retried, cancelled or fenced out
        (its lease lost) publishes none of its events. Its correlation id is
        the job's (the job id when it has none), its causation id the
        attempt's ``job.started`` event unless ``causation_id`` says
        otherwise, its time now. The event is checked now, as PublishEvent
        checks one: a bad type, id or payload, a payload over the payload
        limit, more than 100 events or 1 MiB of them in one attempt raise
        :class:`EmitError`. ``payload`` is copied: changing it later changes
        nothing.
        """
        attempt = self._attempt
        if len(self._emitted) >= MAX_EMITTED_EVENTS:
            raise EmitError(
                f"an attempt may emit at most {MAX_EMITTED_EVENTS} events", field="event_type"
            )
        if payload is None:
            payload = {}
        if not isinstance(payload, dict):
            raise EmitError(
                f"payload must be a dict (a JSON object), got {type(payload).__name__}",
                field="payload",
            )
        if event_id is not None and not isinstance(event_id, uuid.UUID):
            raise EmitError("event_id must be a uuid.UUID", field="event_id")
        started = attempt.started_event_id
        try:
            # Checks the type, ids and payload (JSON values only, finite
            # numbers, no NUL, not too deep) as PublishEvent does.
            event = Event.new(
                event_type,
                payload,
                tenant_id=attempt.tenant_id,
                project_id=project_id,
                correlation_id=_correlation(attempt),
                causation_id=causation_id or (None if started is None else str(started)),
                event_id=event_id,
            )
            check_payload_size(event.payload, self._max_event_payload_bytes)
            # A copy, so that the body and the stored payload are the event as emitted.
            event = dataclasses.replace(event, payload=json.loads(dumps(event.payload)))
            made = emitted(event, attempt.job_id)
        except (EventError, PayloadTooLarge) as exc:
            raise EmitError(str(exc), field=exc.field) from None
        if self._emitted_bytes + len(made.body) > MAX_EMITTED_BYTES:
            raise EmitError(
                f"an attempt may emit at most {MAX_EMITTED_BYTES} bytes of events",
                field="payload",
            )
        self._emitted.append(made)
        self._emitted_bytes += len(made.body)
        return event.event_id

    async def submit(
        self,
        job_type: str,
        payload: dict[str, Any] | None = None,
        *,
        key: str,
        max_attempts: int = 0,
        timeout: float | None = None,
        correlation_id: str | None = None,
        schedule_time: datetime | None = None,
        schedule_delay: float | None = None,
    ) -> str:
        """Submit a child job of this job; returns its name (``jobs/…``).

        ``key`` (1..200 characters) names the child among this job's: the
        same key is the same child, for this attempt and every later one, so
        a handler that runs again after a crash or a retry gets the child it
        submitted before, never a second one (a different request under the
        same key is refused). The child is written now, committed before this
        returns, and only while this attempt owns the job: a lost lease
        raises :class:`~jobplane.store.attempts.LeaseLost`. It is a job like
        any other (its own attempts, progress, events), with ``parent`` this
        job; CancelJob of this job cancels it while it has not ended.
        ``correlation_id`` defaults to this job's. A bad request, a job asked
        to cancel, or more than 10,000 children raise :class:`SubmitError`
        naming the field.
        """
        if self._children is None:
            raise SubmitError("this context cannot submit child jobs", field="type")
        request = ChildRequest(
            key=key,
            type=job_type,
            payload={} if payload is None else payload,
            max_attempts=max_attempts,
            timeout_seconds=timeout,
            correlation_id=correlation_id,
            schedule_time=schedule_time,
            schedule_delay_seconds=schedule_delay,
        )
        try:
            name, _ = await self._children.submit(self._attempt, request)
        except JobplaneError as exc:
            raise SubmitError(exc.message, field=exc.field) from None
        return name

    @property
    def emitted(self) -> tuple[Emitted, ...]:
        """The events emitted so far, in order (written only with a success)."""
        return tuple(self._emitted)


@contextlib.contextmanager
def _blob_errors() -> Iterator[None]:
    """The blob store's errors as the handler errors the contract names."""
    try:
        yield
    except BlobNotFound as exc:
        raise PermanentError(exc.message, code=BlobNotFound.reason) from None
    except BlobTooLarge as exc:
        raise PermanentError(exc.message, code=BlobTooLarge.reason) from None
    except BlobStoreUnavailable as exc:
        raise RetryableError(exc.message, code=BlobStoreUnavailable.reason) from None


def _correlation(attempt: Attempt) -> str:
    """The job's correlation id, or its id when it has none an envelope can carry
    (as its lifecycle events have)."""
    value = attempt.correlation_id
    if value and len(value.encode()) <= 255 and not any(c < " " or c == "\x7f" for c in value):
        return value
    return str(attempt.job_id)


#: An ``async def`` handler: its result, or a stage's items before a fan-out stage.
Handler = Callable[[JobContext], Coroutine[Any, Any, "dict[str, Any] | list[dict[str, Any]]"]]


def with_offloaded_payload(handler: Handler, *, max_bytes: int) -> Handler:
    """``handler``, run after the job's payload is read from its blob into ``ctx.payload``.

    For a job submitted by reference. A payload blob that is not a JSON
    object (or larger than ``max_bytes``) fails the job (``PAYLOAD_INVALID``,
    ``BLOB_TOO_LARGE``); an object store outage retries it.
    """

    async def run(ctx: JobContext) -> dict[str, Any] | list[dict[str, Any]]:
        ref = ctx._attempt.payload_blob
        if ref is not None and ctx._payload is None:
            data = await ctx.read_blob(ref.name, limit=max_bytes)
            try:
                ctx._payload = payload_from_blob(data, ref.name)
            except ValueError as exc:
                raise PermanentError(str(exc), code="PAYLOAD_INVALID") from None
        return await handler(ctx)

    return run
