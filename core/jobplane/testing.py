"""Unit-test handlers without Postgres or RabbitMQ.

::

    from jobplane.testing import MemoryBlobs, run_handler

    async def test_render() -> None:
        outcome = await run_handler(registry, "reports.render", {"rows": 3})
        assert outcome.status == "succeeded"
        assert outcome.result == {"pages": 1}
        assert [p.progress for p in outcome.progress] == [0.5, 1.0]
        assert [e.event_type for e in outcome.emitted] == ["report.rendered"]

The handler gets the worker's own :class:`~jobplane.workers.JobContext` (a
plain ``def`` handler the worker's :class:`~jobplane.workers.SyncJobContext`,
from a thread), with a recording progress sink and an in-memory object store
in place of the worker's; what it returns or raises is judged by the worker's
own rules (:func:`jobplane.workers.outcome.check_result` and
:func:`~jobplane.workers.outcome.describe`). Emitted events are checked as
the worker checks them, child jobs (``ctx.submit``) kept by key in a
:class:`MemoryChildren`. Nothing here is written anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from jobplane.attempt_end import Retry, RetryPolicy, decide
from jobplane.blobs.names import blob_name, parse_blob_name
from jobplane.blobs.reader import BlobInfo, BlobReader
from jobplane.errors import BlobNotFound, BlobTooLarge, PayloadTooLarge, RequestIdReused
from jobplane.events.envelope import Event
from jobplane.fanout import FAN_OUT_REFUSED, FanOutRefused, ItemResult, fan_out_items
from jobplane.store.attempts import Attempt, ProgressUpdate, StageRun
from jobplane.store.rows import check_payload_size
from jobplane.topology import load_topology
from jobplane.workers.children import ChildRequest, child_job
from jobplane.workers.context import DEFAULT_EVENT_PAYLOAD_BYTES, Handler, JobContext
from jobplane.workers.outcome import Escaped, check_result, describe, invoke
from jobplane.workers.plain import SyncHandler, Threaded
from jobplane.workers.registry import Registry, handler_kind
from jobplane.workers.running import Ended, spawned_and_returned
from jobplane.workers.threads import HandlerThreads

__all__ = [
    "HandlerError",
    "ItemResult",
    "MemoryBlobs",
    "MemoryChildren",
    "Outcome",
    "SubmittedChild",
    "run_handler",
    "run_handler_sync",
]

#: How an attempt ended, as the worker would record it.
Status = Literal["succeeded", "retry", "failed", "cancelled"]


class _Body:
    """The bytes of an in-memory blob, read as a :class:`BlobReader` reads an S3 body."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._at = 0

    async def read(self, n: int | None = None) -> bytes:
        end = len(self._data) if n is None else min(len(self._data), self._at + n)
        chunk = self._data[self._at : end]
        self._at = end
        return chunk


class MemoryBlobs:
    """An object store in memory: the blobs a handler reads and writes in a test.

    ``name = blobs.add(b"...")`` stores an input (its name is
    ``blobs/{sha256}``, as in a worker); :attr:`contents` has every blob by
    name and :attr:`references` what jobs referenced (job id, name, role).
    Blobs are not kept apart by tenant.
    """

    def __init__(self) -> None:
        self.contents: dict[str, bytes] = {}
        self.content_types: dict[str, str] = {}
        self.references: list[tuple[uuid.UUID, str, str]] = []

    def add(self, data: bytes, *, content_type: str = "") -> str:
        """Store ``data``; its name."""
        name = blob_name(hashlib.sha256(data).hexdigest())
        self.contents[name] = bytes(data)
        self.content_types.setdefault(name, content_type)
        return name

    def _info(self, name: str) -> BlobInfo:
        try:
            digest = parse_blob_name(name)
        except ValueError:
            raise BlobNotFound(f"no blob named {name[:80]!r}") from None
        if name not in self.contents:
            raise BlobNotFound(f"no blob named {name}")
        return BlobInfo(name, digest, len(self.contents[name]), self.content_types.get(name, ""))

    def open(
        self, tenant_id: uuid.UUID, name: str
    ) -> contextlib.AbstractAsyncContextManager[BlobReader]:
        """The blob, streamed (:class:`~jobplane.errors.BlobNotFound` when absent)."""
        return self._open(name)

    @contextlib.asynccontextmanager
    async def _open(self, name: str) -> AsyncIterator[BlobReader]:
        info = self._info(name)
        yield BlobReader(info, _Body(self.contents[name]))

    async def read_bytes(
        self, tenant_id: uuid.UUID, name: str, *, limit: int | None = None
    ) -> bytes:
        """The whole blob; :class:`~jobplane.errors.BlobTooLarge` over ``limit`` bytes."""
        info = self._info(name)
        if limit is not None and info.size > limit:
            raise BlobTooLarge(f"{name} has {info.size} bytes, more than {limit}")
        return self.contents[name]

    async def put_bytes(
        self, tenant_id: uuid.UUID, data: bytes, *, content_type: str | None = None
    ) -> BlobInfo:
        """Store ``data``."""
        return self._info(self.add(data, content_type=content_type or ""))

    async def put_stream(
        self,
        tenant_id: uuid.UUID,
        chunks: AsyncIterable[bytes],
        *,
        content_type: str | None = None,
    ) -> BlobInfo:
        """Store the bytes of ``chunks``."""
        data = b"".join([bytes(chunk) async for chunk in chunks])
        return await self.put_bytes(tenant_id, data, content_type=content_type)

    async def reference(
        self, tenant_id: uuid.UUID, job_id: uuid.UUID, digest: str, role: str
    ) -> None:
        """Record that the job references the blob."""
        self.references.append((job_id, blob_name(digest), role))


@dataclass(frozen=True)
class SubmittedChild:
    """A child job a handler submitted (``ctx.submit``), as the worker would write it."""

    #: ``jobs/{id}``: the same for every submit of its key.
    name: str
    key: str
    type: str
    payload: dict[str, Any]
    #: The request as submitted (options included), for anything else a test checks.
    request: ChildRequest = field(repr=False)


class MemoryChildren:
    """The children handlers submit in a test, by key, as a worker keeps them.

    One child a key, whatever the attempt: pass the same ``MemoryChildren``
    to several :func:`run_handler` calls (attempt 1, then 2) to see that a
    handler run again gets its children back. A key submitted again with a
    different request is refused as the worker refuses it. A child is checked
    as a worker checks it, against the built-in topology (which routes every
    type): whether your topology routes the type is not checked.
    """

    def __init__(self) -> None:
        self._topology = load_topology()
        self.by_key: dict[str, SubmittedChild] = {}
        #: Every submit, in order: (attempt, child, whether it was created then).
        self.submits: list[tuple[int, SubmittedChild, bool]] = []

    async def submit(self, attempt: Attempt, request: ChildRequest) -> tuple[str, bool]:
        """Record the child; its name and whether it is new."""
        # The worker's checks, against the built-in topology (every type routes).
        child_job(
            self._topology,
            request,
            parent_correlation_id=attempt.correlation_id,
            max_payload_bytes=DEFAULT_EVENT_PAYLOAD_BYTES,
        )
        known = self.by_key.get(request.key)
        if known is not None and known.request != request:
            raise RequestIdReused(
                f"key {request.key!r} was used for a different child", field="key"
            )
        child = known or SubmittedChild(
            name=f"jobs/{uuid.uuid4()}",
            key=request.key,
            type=request.type,
            payload=dict(request.payload),
            request=request,
        )
        self.by_key[request.key] = child
        self.submits.append((attempt.attempt, child, known is None))
        return child.name, known is None


class _Recorder:
    """The progress sink: every report, in order."""

    def __init__(self) -> None:
        self.updates: list[ProgressUpdate] = []

    async def add(self, update: ProgressUpdate) -> None:
        self.updates.append(update)


@dataclass(frozen=True)
class HandlerError:
    """The error an attempt ended with, as the worker stores it."""

    code: str
    message: str
    #: Whether another attempt may run (a :class:`~jobplane.workers.PermanentError`: no).
    retryable: bool
    #: The delay a :class:`~jobplane.workers.RetryableError` asked for (None: the backoff).
    delay: float | None
    #: What the handler raised (None when the worker's rules refused its result).
    exception: BaseException | None


@dataclass(frozen=True)
class Outcome:
    """What one attempt of a handler did, and how the worker would record it."""

    #: ``succeeded``; ``retry`` (a retryable error with attempts left); ``failed``;
    #: ``cancelled`` (stopped by ``cancel_after``).
    status: Status
    #: The stored result (``{}`` for None) when it succeeded.
    result: dict[str, Any] | None
    error: HandlerError | None
    #: Every progress report, in order (fraction clamped, message cut, as stored).
    progress: list[ProgressUpdate]
    #: The events the handler emitted; a worker publishes them only with a success.
    emitted: list[Event]
    #: The blobs the handler stored (``ctx.put_blob``), by name.
    blobs: dict[str, bytes]
    #: The attempt's context, for anything else a test wants to look at.
    context: JobContext = field(repr=False)
    #: The children this attempt submitted (``ctx.submit``), in order, each once.
    children: list[SubmittedChild] = field(default_factory=list)
    #: A stage before a fan-out stage (``fans_out=True``) that succeeded: the
    #: items it spawns, one child each (``ctx.spawn``'s, then the list returned).
    items: list[dict[str, Any]] | None = None


async def run_handler(
    handler: Registry | Handler | SyncHandler,
    job_type: str = "test.job",
    payload: dict[str, Any] | None = None,
    *,
    attempt: int = 1,
    max_attempts: int = 3,
    job_id: uuid.UUID | None = None,
    tenant_id: uuid.UUID | None = None,
    correlation_id: str = "",
    request_id: str = "",
    timeout_seconds: float = 3600.0,
    pipeline: str = "",
    pipeline_version: str = "",
    stage: str = "",
    stage_version: str = "",
    inputs: Mapping[str, dict[str, Any]] | None = None,
    fans_out: bool = False,
    results: Sequence[ItemResult] | None = None,
    blobs: MemoryBlobs | None = None,
    children: MemoryChildren | None = None,
    cancel_after: float | None = None,
    grace: float = 10.0,
    max_result_bytes: int = DEFAULT_EVENT_PAYLOAD_BYTES,
) -> Outcome:
    """Run one attempt of ``handler`` (or ``job_type``'s handler in a registry).

    The keyword arguments are the attempt's fields as the handler sees them
    (``ctx.attempt``, ``ctx.stage``, ``ctx.inputs``, …); ``stage`` makes it a
    pipeline stage's attempt; ``fans_out`` one before a fan-out stage (its
    items are the outcome's ``items``), ``results`` a join's (``ctx.results``;
    ADR-0047). ``blobs`` is the object store the handler
    reads and writes (a new empty one by default); ``children`` keeps what its
    ``ctx.submit`` submits (pass one to several calls). ``cancel_after`` stops the
    attempt after that many seconds as the worker stops a cancelled job:
    ``ctx.cancelled`` turns True, an async handler's task is cancelled and a
    plain handler's next context call raises
    :class:`~jobplane.workers.AttemptStopped`. A handler that has not ended
    ``grace`` seconds after that raises :class:`TimeoutError` (the worker
    gives up on it then too); its thread is left to run.
    """
    fn = _handler_of(handler, job_type)
    store = MemoryBlobs() if blobs is None else blobs
    stage_run = _fanned(
        _stage_run(pipeline, pipeline_version, stage, stage_version, inputs), fans_out, results
    )
    the_attempt = Attempt(
        job_id=job_id or uuid.uuid4(),
        tenant_id=tenant_id or uuid.uuid4(),
        type=job_type,
        payload=dict(payload or {}),
        attempt=attempt,
        max_attempts=max_attempts,
        retry_base=0,
        lease_token=uuid.uuid4(),
        correlation_id=correlation_id,
        request_id=request_id or str(uuid.uuid4()),
        timeout_seconds=timeout_seconds,
        stage=stage_run,
    )
    recorder = _Recorder()
    # A plain handler's thread, as the worker's: a daemon, left behind once
    # given up on (closing the pool lets its task end).
    threads = HandlerThreads(1, thread_name_prefix="jobplane-handler")
    ctx = JobContext(
        the_attempt,
        recorder,
        max_event_payload_bytes=max_result_bytes,
        blobs=store,
        threads=threads,
        children=MemoryChildren() if children is None else children,
    )
    try:
        return await _run(fn, ctx, store, recorder, cancel_after, grace, max_result_bytes)
    finally:
        threads.shutdown(wait=False, cancel_futures=True)


def _fanned(
    stage_run: StageRun | None, fans_out: bool, results: Sequence[ItemResult] | None
) -> StageRun | None:
    """A test's stage before a fan-out stage (``fans_out``), or its join (``results``)."""
    if not fans_out and results is None:
        return stage_run
    if stage_run is None:
        raise ValueError("a fan-out's stages are a pipeline's (stage=...)")
    return replace(
        stage_run,
        count=stage_run.count + 1 if fans_out else stage_run.count,
        fans_out=fans_out,
        results=None if results is None else tuple(results),
    )


def _stage_run(
    pipeline: str,
    pipeline_version: str,
    stage: str,
    stage_version: str,
    inputs: Mapping[str, dict[str, Any]] | None,
) -> StageRun | None:
    """The stage a test's attempt runs (None: a plain job's attempt)."""
    if not stage:
        if pipeline or inputs:
            raise ValueError("a pipeline's attempt names its stage (stage=...)")
        return None
    given = dict(inputs or {})
    return StageRun(
        pipeline=pipeline,
        pipeline_version=pipeline_version,
        name=stage,
        index=len(given),
        count=len(given) + 1,
        version=stage_version,
        inputs=given,
    )


async def _run(
    fn: Handler,
    ctx: JobContext,
    store: MemoryBlobs,
    recorder: _Recorder,
    cancel_after: float | None,
    grace: float,
    max_result_bytes: int,
) -> Outcome:
    the_attempt = ctx._attempt
    kept = ctx._children
    before = len(kept.submits) if isinstance(kept, MemoryChildren) else 0
    task = asyncio.create_task(invoke(fn, ctx), name=f"test-{the_attempt.job_id}")
    stopped = False
    if cancel_after is not None:
        done, _ = await asyncio.wait({task}, timeout=cancel_after)
        if not done:
            stopped = True
            ctx._stop()
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=grace)
            if not done:
                if ctx._threads is not None:
                    ctx._threads.shutdown(wait=False)
                task.cancel()  # a plain handler's task ends once its threads are closed
                name = getattr(fn, "__qualname__", None) or repr(fn)
                raise TimeoutError(
                    f"the handler {name} did not end within {grace} s of its stop "
                    "(cancel_after): a plain handler checks ctx.cancelled or calls its "
                    "context, an async one lets its CancelledError go on"
                )
    await asyncio.wait({task})
    status: Status
    result: dict[str, Any] | None = None
    items: list[dict[str, Any]] | None = None
    error: HandlerError | None = None
    if task.cancelled():
        if not stopped:
            raise asyncio.CancelledError("the handler's task was cancelled, not by cancel_after")
        status = "cancelled"
    elif (raised := task.exception()) is not None:
        # As the worker records a stopped attempt that raised: cancelled.
        status, error = ("cancelled", None) if stopped else _raised(the_attempt, raised)
    elif ctx.fans_out:
        status, result, items, error = _spawned(ctx, task.result(), max_result_bytes)
    else:
        checked = check_result(task.result(), max_bytes=max_result_bytes)
        if isinstance(checked, dict):
            status, result = "succeeded", checked
        else:
            failure = describe(checked)
            error = HandlerError(failure.code, failure.message, False, None, None)
            status = "failed"
    written = {
        name: store.contents[name]
        for job, name, role in store.references
        if job == the_attempt.job_id and role == "output"
    }
    return Outcome(
        status=status,
        result=result,
        error=error,
        progress=list(recorder.updates),
        emitted=[made.event for made in ctx.emitted],
        blobs=written,
        context=ctx,
        children=(
            list({c.name: c for _, c, _ in kept.submits[before:]}.values())
            if isinstance(kept, MemoryChildren)
            else []
        ),
        items=items,
    )


def _raised(the_attempt: Attempt, raised: BaseException) -> tuple[Status, HandlerError]:
    """How an attempt whose handler raised ends: the worker's own decision (the
    backoff it picks is not reported)."""
    failure = describe(raised)
    original = raised.original if isinstance(raised, Escaped) else raised
    error = HandlerError(failure.code, failure.message, failure.retryable, failure.delay, original)
    decision = decide(the_attempt.budget_attempt, the_attempt.max_attempts, failure, RetryPolicy())
    return ("retry" if isinstance(decision, Retry) else "failed"), error


def _spawned(
    ctx: JobContext, returned: Any, max_bytes: int
) -> tuple[Status, dict[str, Any] | None, list[dict[str, Any]] | None, HandlerError | None]:
    """A fan-out's items as the worker checks them, or the stage's failure."""
    ended = spawned_and_returned(Ended(returned=True, result=returned), ctx._spawned)
    try:
        items = fan_out_items(ended.result)
        for item in items:
            check_payload_size(item, max_bytes)
    except (FanOutRefused, PayloadTooLarge, TypeError, ValueError) as exc:
        return "failed", None, None, HandlerError(FAN_OUT_REFUSED, str(exc), False, None, None)
    return "succeeded", {"children": len(items)}, items, None


def run_handler_sync(
    handler: Registry | Handler | SyncHandler,
    job_type: str = "test.job",
    payload: dict[str, Any] | None = None,
    **fields: Any,
) -> Outcome:
    """:func:`run_handler` for a test that has no event loop (plain pytest)."""
    return asyncio.run(run_handler(handler, job_type, payload, **fields))


def _handler_of(handler: Registry | Handler | SyncHandler, job_type: str) -> Handler:
    """The async callable the worker would run: a registry's, or ``handler`` wrapped
    as the registry wraps it."""
    if isinstance(handler, Registry):
        found = handler.get(job_type)
        if found is None:
            raise LookupError(
                f"the registry has no handler for {job_type!r} (it has: {', '.join(handler)})"
            )
        return found
    kind = handler_kind(handler)
    if kind == "async":
        return cast(Handler, handler)
    if kind == "sync":
        return Threaded(cast(SyncHandler, handler))
    raise TypeError(f"{handler!r} is {kind}: not a handler")
