"""Plain ``def`` handlers: the :class:`SyncJobContext` they get, and
:class:`Threaded`, which runs one in the worker's threads.

A plain handler runs in a thread of its own (:mod:`jobplane.workers.threads`
is the pool); what it calls on its context that needs the event loop
(progress, blobs) is run there as a task of the loop, and the thread waits
for its answer. Handlers import :class:`SyncJobContext` from
:mod:`jobplane.workers.handlers`; :class:`Threaded` is the registry's and
the runtime's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Self, TypeVar, cast, overload

from jobplane.workers.context import JobContext
from jobplane.workers.errors import AttemptStopped, PermanentError
from jobplane.workers.threads import HandlerThreads
from jobplane.workers.values import qualname

T = TypeVar("T")


class _Same(Generic[T]):
    """An attribute of :class:`JobContext`, read on the sync context's own.

    ``name = _Same(lambda ctx: ctx.name)`` is typed by its getter and
    documented as the attribute it mirrors, so that the two contexts' job
    attributes are declared once (tests/unit/test_testing.py holds each
    getter to its name).
    """

    def __init__(self, read: Callable[[JobContext], T]) -> None:
        self._read = read

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.__doc__ = getattr(JobContext, name).__doc__

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...

    @overload
    def __get__(self, obj: SyncJobContext, owner: type[Any]) -> T: ...

    def __get__(self, obj: SyncJobContext | None, owner: type[Any]) -> Self | T:
        return self if obj is None else self._read(obj._ctx)


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

    name = _Same(lambda ctx: ctx.name)
    id = _Same(lambda ctx: ctx.id)
    type = _Same(lambda ctx: ctx.type)
    payload = _Same(lambda ctx: ctx.payload)
    tenant_id = _Same(lambda ctx: ctx.tenant_id)
    attempt = _Same(lambda ctx: ctx.attempt)
    max_attempts = _Same(lambda ctx: ctx.max_attempts)
    correlation_id = _Same(lambda ctx: ctx.correlation_id)
    request_id = _Same(lambda ctx: ctx.request_id)
    pipeline = _Same(lambda ctx: ctx.pipeline)
    pipeline_version = _Same(lambda ctx: ctx.pipeline_version)
    stage = _Same(lambda ctx: ctx.stage)
    stage_version = _Same(lambda ctx: ctx.stage_version)
    inputs = _Same(lambda ctx: ctx.inputs)
    previous = _Same(lambda ctx: ctx.previous)
    fans_out = _Same(lambda ctx: ctx.fans_out)
    results = _Same(lambda ctx: ctx.results)
    emitted = _Same(lambda ctx: ctx.emitted)

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

    def spawn(self, payload: dict[str, Any]) -> None:
        """:meth:`JobContext.spawn`: kept in the context's list, which the worker
        reads only after the handler's thread has ended."""
        self._check()
        self._ctx.spawn(payload)

    def submit(self, job_type: str, payload: dict[str, Any] | None = None, **options: Any) -> str:
        """:meth:`JobContext.submit` (the same arguments, ``key=`` among them), from the
        handler's thread; the child's name."""
        return self._on_loop(lambda: self._ctx.submit(job_type, payload, **options))

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


#: A plain ``def`` handler, run in a thread (a list: a stage's items before a fan-out stage).
SyncHandler = Callable[[SyncJobContext], "dict[str, Any] | list[dict[str, Any]] | None"]


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
        self.__qualname__ = qualname(fn)

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
