"""The handler API: a registry of async functions taking a :class:`JobContext`.

::

    registry = Registry()

    @registry.handler("reports.render")
    async def render(ctx: JobContext) -> dict[str, Any]:
        await ctx.progress(0.5, "half way")
        return {"url": "..."}

A handler is an ``async def`` taking a :class:`JobContext`, or a plain
``def`` taking a :class:`SyncJobContext`: the worker runs a plain one in a
bounded pool of threads (``JOBPLANE_SYNC_THREADS``, default its concurrency),
with the same context whose methods it may call from its thread. It returns a
JSON object (the result; None means ``{}``) or raises. :class:`PermanentError`
fails the job at once; :class:`RetryableError` (or any other exception) uses
another attempt while the job has any left. docs/handlers.md is the reference.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import importlib
import inspect
import json
import math
import os
import sys
import traceback
import uuid
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
)
from concurrent.futures import Executor
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar, cast

from jobplane.blobs.payloads import payload_from_blob
from jobplane.blobs.reader import BlobInfo, BlobReader
from jobplane.errors import (
    BlobNotFound,
    BlobsDisabled,
    BlobStoreUnavailable,
    BlobTooLarge,
    PayloadTooLarge,
)
from jobplane.events.envelope import Event, EventError
from jobplane.names import job_name, validate_job_type
from jobplane.store.attempts import Attempt, ProgressUpdate
from jobplane.store.events import emitted
from jobplane.store.machine import MAX_EMITTED_BYTES, MAX_EMITTED_EVENTS, Emitted
from jobplane.store.rows import check_payload_size, dumps
from jobplane.workers.threads import HandlerThreads
from jobplane.workers.values import clean_text, json_problem, json_size, safe_str

T = TypeVar("T")

#: Bytes of an emitted event's payload when the worker does not say (its
#: payload limit, JOBPLANE_MAX_PAYLOAD_BYTES, as for results).
DEFAULT_EVENT_PAYLOAD_BYTES = 256 * 1024
#: Bytes of one progress report's ``data``, as stored.
MAX_PROGRESS_DATA_BYTES = 64 * 1024
MAX_PROGRESS_MESSAGE = 4096


class PermanentError(Exception):
    """The job cannot succeed; do not try again."""

    code = "HANDLER_FAILED"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code:
            self.code = code


class RetryableError(Exception):
    """This attempt failed, a later one may succeed; ``delay`` overrides the backoff."""

    code = "HANDLER_RETRYABLE"

    def __init__(self, message: str, *, delay: float | None = None, code: str | None = None):
        super().__init__(message)
        self.delay = delay
        if code:
            self.code = code


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


class AttemptStopped(asyncio.CancelledError):
    """The worker stopped this attempt (its job was cancelled, it ran past its
    timeout, the worker is shutting down or lost the lease).

    Raised in a plain ``def`` handler at its next call of a context method; an
    ``async def`` handler gets the :class:`asyncio.CancelledError` of its task
    instead. A cancellation, not an error: catch it only to clean up, then
    let it go on.
    """


class EmitError(ValueError):
    """``ctx.emit`` refused an event; ``field`` names what is wrong with it."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


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
    ) -> None:
        self._attempt = attempt
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


class SyncJobContext:
    """What a plain ``def`` handler gets: :class:`JobContext` with methods it calls
    from its thread.

    The attributes are the job's, as on :class:`JobContext`. ``progress``,
    ``read_blob`` and ``put_blob`` run on the worker's event loop and return
    when done there; ``emit`` is :meth:`JobContext.emit`. Once the worker stops
    the attempt, :attr:`cancelled` is True and every method raises
    :class:`AttemptStopped`. Streaming a blob (``open_blob``) is for async
    handlers only.
    """

    def __init__(
        self, ctx: JobContext, loop: asyncio.AbstractEventLoop, context: contextvars.Context
    ) -> None:
        self._ctx = ctx
        self._loop = loop
        # The handler task's context variables (its trace span, its log
        # fields), for what runs on the loop on the thread's behalf.
        self._context = context

    @property
    def async_context(self) -> JobContext:
        """The :class:`JobContext` of this attempt (for code that is given one)."""
        return self._ctx

    @property
    def name(self) -> str:
        """``jobs/{id}``"""
        return self._ctx.name

    @property
    def id(self) -> str:
        """The job id."""
        return self._ctx.id

    @property
    def type(self) -> str:
        """The job type."""
        return self._ctx.type

    @property
    def payload(self) -> dict[str, Any]:
        """The submitted payload (do not mutate it); an offloaded one, read whole."""
        return self._ctx.payload

    @property
    def tenant_id(self) -> str:
        """The job's tenant."""
        return self._ctx.tenant_id

    @property
    def attempt(self) -> int:
        """This attempt's number, from 1."""
        return self._ctx.attempt

    @property
    def max_attempts(self) -> int:
        """Attempts the job may use."""
        return self._ctx.max_attempts

    @property
    def correlation_id(self) -> str:
        """The caller's correlation id."""
        return self._ctx.correlation_id

    @property
    def request_id(self) -> str:
        """The idempotency key the job was submitted with."""
        return self._ctx.request_id

    @property
    def pipeline(self) -> str:
        """The pipeline this job runs ("" for a plain job)."""
        return self._ctx.pipeline

    @property
    def pipeline_version(self) -> str:
        """The version of the pipeline as submitted."""
        return self._ctx.pipeline_version

    @property
    def stage(self) -> str:
        """The pipeline stage this attempt runs ("" for a plain job)."""
        return self._ctx.stage

    @property
    def stage_version(self) -> str:
        """The version the topology gives this stage."""
        return self._ctx.stage_version

    @property
    def inputs(self) -> Mapping[str, dict[str, Any]]:
        """The results of the pipeline's earlier stages, by stage name, in order."""
        return self._ctx.inputs

    @property
    def previous(self) -> dict[str, Any] | None:
        """The result of the stage just before this one, or None."""
        return self._ctx.previous

    @property
    def emitted(self) -> tuple[Emitted, ...]:
        """The events emitted so far, in order."""
        return self._ctx.emitted

    @property
    def cancelled(self) -> bool:
        """True once the worker stopped this attempt: return, or call any method
        (it raises :class:`AttemptStopped`)."""
        return self._ctx.cancelled

    def progress(
        self, fraction: float, message: str = "", data: dict[str, Any] | None = None
    ) -> None:
        """:meth:`JobContext.progress`, from the handler's thread."""
        self._on_loop(lambda: self._ctx.progress(fraction, message, data))

    def emit(self, *args: Any, **kwargs: Any) -> uuid.UUID:
        """:meth:`JobContext.emit` (the same arguments); returns the event's id."""
        self._check()
        # Kept in the context's list, which the worker reads only after the
        # handler's thread has ended: no need to go through the loop.
        return self._ctx.emit(*args, **kwargs)

    def read_blob(self, name: str, *, limit: int | None = None) -> bytes:
        """:meth:`JobContext.read_blob`, from the handler's thread."""
        return self._on_loop(lambda: self._ctx.read_blob(name, limit=limit))

    def put_blob(self, data: bytes, *, content_type: str | None = None) -> str:
        """:meth:`JobContext.put_blob` of ``data``, from the handler's thread; its name."""
        return self._on_loop(lambda: self._ctx.put_blob(data, content_type=content_type))

    def _check(self) -> None:
        if self._ctx.cancelled:
            raise AttemptStopped(f"{self._ctx.name} attempt {self._ctx.attempt} was stopped")

    def _on_loop(self, make: Callable[[], Awaitable[T]]) -> T:
        """Run ``make()`` as a task of the worker's loop and wait for its answer."""
        self._check()
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # no loop running here: a thread's call, as meant
            running = None
        if running is self._loop:
            # Waiting here for a task of this loop would block the only thread
            # that can run it, for ever.
            raise RuntimeError(
                "a SyncJobContext is called from the event loop's own thread: an async "
                "handler uses its JobContext (ctx.async_context) and awaits it"
            )
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def run() -> T:
            return await make()

        def start() -> None:
            if not done.set_running_or_notify_cancel():
                return
            task = self._loop.create_task(run(), context=self._context)

            def finish(task: asyncio.Task[T]) -> None:
                if task.cancelled():
                    done.set_exception(AttemptStopped("the worker stopped the call"))
                elif (error := task.exception()) is not None:
                    done.set_exception(error)
                else:
                    done.set_result(task.result())

            task.add_done_callback(finish)

        try:
            self._loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop is closed: the worker is gone
            raise AttemptStopped("the worker has stopped") from None
        while True:
            try:
                return done.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                # A worker that gave up on this thread may close its loop:
                # never wait on a loop that will not answer.
                if self._loop.is_closed():
                    done.cancel()
                    raise AttemptStopped("the worker has stopped") from None


#: An ``async def`` handler.
Handler = Callable[[JobContext], Coroutine[Any, Any, dict[str, Any]]]
#: A plain ``def`` handler, run in a thread.
SyncHandler = Callable[[SyncJobContext], "dict[str, Any] | None"]


class Threaded:
    """A plain ``def`` handler as an async one: it runs in the context's threads.

    The thread cannot be interrupted: a stop (the task's cancellation) marks
    the context stopped, and the task waits for the thread to see it, return
    or raise, so that its slot is not given to another job while it runs (the
    worker gives up on it after its grace period, as on an async handler
    that ignores its cancellation). A handler still waiting for a free thread
    when stopped never runs. A plain function that returns an awaitable (a
    wrapper of an async function) fails the job: ``BAD_HANDLER``.
    """

    def __init__(self, fn: SyncHandler) -> None:
        self.fn = fn
        self.__qualname__ = _qualname(fn)

    async def __call__(self, ctx: JobContext) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        sync_ctx = SyncJobContext(ctx, loop, contextvars.copy_context())
        # A copy of its own for the thread: a context is entered by one at a time.
        run = contextvars.copy_context().run
        # A context without the worker's threads (a test's) gets one of its own.
        threads = ctx._threads if ctx._threads is not None else HandlerThreads(1)
        try:
            work = threads.submit(run, self.fn, sync_ctx)
            thread = asyncio.wrap_future(work)
            while True:
                try:
                    returned = await asyncio.shield(thread)
                    break
                except asyncio.CancelledError:
                    if thread.done():
                        raise  # the thread's own AttemptStopped: the stop ends the task
                    if isinstance(threads, HandlerThreads) and threads.closed:
                        # The worker closed its threads, given up on this one:
                        # nothing is left to wait for (a process that ends
                        # cancels its last tasks, and must not wait on a thread).
                        thread.cancel()
                        raise
                    ctx._stop()
                    if work.cancel():
                        # Still waiting for a thread: it never runs for a job it
                        # no longer owns.
                        raise AttemptStopped(
                            f"{ctx.name} attempt {ctx.attempt} was stopped before a thread took it"
                        ) from None
        finally:
            if threads is not ctx._threads:
                threads.shutdown(wait=False)
        if inspect.isawaitable(returned):
            # Its coroutine was made in the thread, with the thread's context:
            # awaited on the loop, a context call in it would block the loop
            # waiting for the loop. Such a wrapper (a lambda, a decorator
            # without functools.wraps) hides the async function it calls.
            if inspect.iscoroutine(returned):
                returned.close()
            raise PermanentError(
                f"the handler {self.__qualname__} is a plain function that returned "
                f"{type(returned).__name__}: register the async function itself (a "
                "wrapper of one must be an `async def` too)",
                code="BAD_HANDLER",
            )
        # None is the empty result, as for an async handler (check_result).
        return cast("dict[str, Any]", returned)


def handler_kind(fn: object) -> str:
    """``"async"``, ``"sync"``, or why the runtime cannot run ``fn``."""
    if _is_async(fn):
        return "async"
    if not callable(fn):
        return "not callable"
    if inspect.isclass(fn):
        return "a class (calling it makes an instance, not a result)"
    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        return "a generator function (it must return its result)"
    call = inspect.getattr_static(type(fn), "__call__", None)
    if inspect.isasyncgenfunction(call) or inspect.isgeneratorfunction(call):
        return "a generator function (it must return its result)"
    return "sync"


def with_offloaded_payload(handler: Handler, *, max_bytes: int) -> Handler:
    """``handler``, run after the job's payload is read from its blob into ``ctx.payload``.

    For a job submitted by reference. A payload blob that is not a JSON
    object (or larger than ``max_bytes``) fails the job (``PAYLOAD_INVALID``,
    ``BLOB_TOO_LARGE``); an object store outage retries it.
    """

    async def run(ctx: JobContext) -> dict[str, Any]:
        ref = ctx._attempt.payload_blob
        if ref is not None and ctx._payload is None:
            data = await ctx.read_blob(ref.name, limit=max_bytes)
            try:
                ctx._payload = payload_from_blob(data, ref.name)
            except ValueError as exc:
                raise PermanentError(str(exc), code="PAYLOAD_INVALID") from None
        return await handler(ctx)

    return run


F = TypeVar("F", bound="Handler | SyncHandler")

#: What :meth:`Registry.lifespan` takes: a factory of an async context manager.
Lifespan = Callable[[], AbstractAsyncContextManager[object]]


class Registry:
    """Handlers by job type."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._lifespans: list[Lifespan] = []

    def lifespan(self, factory: Lifespan) -> Lifespan:
        """Register what the handlers share in a worker process (a client, a model).

        The worker enters ``factory()`` when it starts, before it takes a
        job, and leaves it when it stops, after its handlers have ended: the
        resource has the worker's life, not the module's (nothing opens at
        import). Usable as a decorator of an ``asynccontextmanager``.
        """
        self._lifespans.append(factory)
        return factory

    @property
    def lifespans(self) -> tuple[Lifespan, ...]:
        """The registered lifespans, in order."""
        return tuple(self._lifespans)

    def handler(self, job_type: str) -> Callable[[F], F]:
        """Decorator: register ``fn`` (``async def`` or plain ``def``) for ``job_type``."""

        def register(fn: F) -> F:
            self.add(job_type, fn)
            return fn

        return register

    def add(self, job_type: str, fn: Handler | SyncHandler) -> None:
        """Register ``fn`` for ``job_type``: an ``async def``, or a plain ``def`` the
        worker runs in a thread (anything else: TypeError)."""
        validate_job_type(job_type)
        kind = handler_kind(fn)
        if kind not in ("async", "sync"):
            raise TypeError(
                f"the handler for {job_type!r} ({_qualname(fn)}) is {kind}: handlers are "
                "`async def` or plain `def` functions taking the job's context"
            )
        if job_type in self._handlers:
            raise ValueError(f"a handler for {job_type!r} is already registered")
        if kind == "async":
            self._handlers[job_type] = cast(Handler, fn)
        else:
            self._handlers[job_type] = Threaded(cast(SyncHandler, fn))

    def get(self, job_type: str) -> Handler | None:
        """The handler of ``job_type``, or None."""
        return self._handlers.get(job_type)

    def merge(self, other: Registry) -> Registry:
        """A new registry with the handlers of both."""
        merged = Registry()
        merged._lifespans = [*self._lifespans, *other._lifespans]
        for job_type, fn in (*self._handlers.items(), *other._handlers.items()):
            merged.add(job_type, fn)
        return merged

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._handlers))

    def __len__(self) -> int:
        return len(self._handlers)


class HandlersError(ValueError):
    """A ``--handlers`` spec that cannot be loaded; the message is one line for people."""


def load_registry(spec: str) -> Registry:
    """Import ``package.module:attribute`` and check it is a :class:`Registry`.

    The current directory comes first on the import path, as with
    ``celery -A``: ``jobplane worker --handlers jobs:registry`` finds
    ``./jobs.py``. Every way this can go wrong raises :class:`HandlersError`
    with a one-line message.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise HandlersError(
            f"--handlers must look like module:registry (e.g. myapp.jobs:registry), got {spec!r}"
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise HandlersError(
                f"no module named {exc.name!r} (--handlers {spec}; looked in {cwd} "
                "and on the Python path)"
            ) from None
        raise HandlersError(f"importing {module_name!r} failed: {_one_line(exc)}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # whatever the module raises at import, even SystemExit
        raise HandlersError(f"importing {module_name!r} failed: {_one_line(exc)}") from None
    found: Any = module
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except Exception:
            registries = sorted(n for n, v in vars(module).items() if isinstance(v, Registry))
            hint = f"; its registries: {', '.join(registries)}" if registries else ""
            raise HandlersError(
                f"module {module_name!r} has no attribute {attribute!r}{hint}"
            ) from None
    if not isinstance(found, Registry):
        raise HandlersError(f"{spec} is a {type(found).__name__}, not a jobplane.workers.Registry")
    if not len(found):
        raise HandlersError(f"{spec} has no handlers registered")
    return found


def _is_async(fn: object) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    # An instance whose __call__ is an async def (a class itself is not).
    if inspect.isclass(fn) or not callable(fn):
        return False
    return inspect.iscoroutinefunction(type(fn).__call__)


def _qualname(fn: object) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or '?'}.{name}"


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` and where it was raised."""
    lines = safe_str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{text} ({exc.filename}, line {exc.lineno})"
    # The user's line, not ours or importlib's (e.g. the decorator that
    # refused a plain function).
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(("<frozen", ours))
    ]
    if frames:
        return f"{text} (at {frames[-1].filename}:{frames[-1].lineno})"
    return text
