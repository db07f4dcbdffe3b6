"""Running a handler attempt: its context, its task, its heartbeat and its timeout.

The handler runs in a task of its own; the worker stops it when the job is
cancelled, its lease is lost, its timeout passes or the worker shuts down,
and gives up on one that ignores being stopped after a grace period. How it
ended is then recorded (:class:`~jobplane.workers.recording.OutcomeRecording`).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import structlog

from jobplane.config import MAX_OFFLOADED_JSON_BYTES
from jobplane.logs import describe_error
from jobplane.store.attempts import Attempt, LeaseLost
from jobplane.store.children import ChildStore
from jobplane.store.db import Database
from jobplane.tasks import cancel_and_wait
from jobplane.workers.children import WorkerChildren
from jobplane.workers.handlers import JobContext, Registry, with_offloaded_payload
from jobplane.workers.outcome import invoke, raised
from jobplane.workers.progress import ProgressFlusher, ProgressWriter
from jobplane.workers.recording import OutcomeRecording
from jobplane.workers.running import Ended, Running, StopCause, spawned_and_returned
from jobplane.workers.threads import HandlerThreads

log = structlog.get_logger("jobplane.worker")


class AttemptRunner(OutcomeRecording):
    """Runs a claimed attempt's handler to its end, then records how it ended."""

    # Set up by the worker.
    _registry: Registry
    _progress: ProgressFlusher
    #: Where plain ``def`` handlers run (None: the worker is not started).
    _threads: HandlerThreads | None = None
    #: The handlers running now, by job id.
    _running: dict[str, Running]
    _cancel_grace: float
    _db: Database

    @functools.cached_property
    def _children(self) -> WorkerChildren:
        """Where ``ctx.submit`` writes child jobs: checked against the topology,
        fenced on the attempt."""
        return WorkerChildren(
            ChildStore(self._db),
            self._topology,
            max_payload_bytes=self._max_result_bytes,
            on_created=None if self._intercept is None else self._intercept.submitted,
        )

    async def _run(self, attempt: Attempt, bound: Any) -> None:
        key = str(attempt.job_id)
        handler = self._registry.get(attempt.type)
        if handler is None:  # pragma: no cover - the claim matched the message's type
            raise RuntimeError(f"claimed jobs/{key} of type {attempt.type!r} without its handler")
        holder: list[Running] = []

        def cancel_requested() -> None:
            if holder:
                holder[0].stop(StopCause.CANCEL_REQUESTED)

        writer = ProgressWriter(
            self._progress,
            attempt,
            on_cancel_requested=cancel_requested,
            on_progress=None if self._intercept is None else self._intercept.progress,
        )
        ctx = JobContext(
            attempt,
            writer,
            max_event_payload_bytes=self._max_result_bytes,
            blobs=self._blobs,
            threads=self._threads,
            children=self._children,
        )
        if attempt.payload_blob is not None:
            handler = with_offloaded_payload(handler, max_bytes=MAX_OFFLOADED_JSON_BYTES)
        bound.info("job.started", attempt=attempt.attempt, type=attempt.type)
        intercept = self._intercept
        run = None if intercept is None else intercept.started(attempt)
        running = Running(
            asyncio.create_task(
                invoke(handler, ctx),
                name=f"job-{key}",
                context=None if run is None else run.context(),
            ),
            on_stop=ctx._stop,
        )
        holder.append(running)
        self._running[key] = running
        # The heartbeat starts at its first beat: a job that ends before it
        # (most do) costs no task for it.
        beating: list[asyncio.Task[None]] = []

        def first_beat() -> None:
            if not running.task.done():
                beating.append(asyncio.create_task(self._heartbeat(attempt, running)))

        first = asyncio.get_running_loop().call_later(self._first_beat(), first_beat)
        try:
            ended = await self._wait(running, attempt, bound)
        except BaseException:
            running.stop(StopCause.SHUTDOWN)  # never leave a handler running unowned
            raise
        finally:
            first.cancel()
            for heartbeat in beating:
                await cancel_and_wait(heartbeat)
            self._running.pop(key, None)
            if run is not None:
                run.ended(raised(running.error))
        pending = await writer.drain()
        if ended.returned and ctx._spawned:
            ended = spawned_and_returned(ended, ctx._spawned)
        if intercept is None:
            await self._record(attempt, running, ended, pending, bound, ctx.emitted)
        else:
            with intercept.outcome(attempt):
                await self._record(attempt, running, ended, pending, bound, ctx.emitted)

    async def _wait(self, running: Running, attempt: Attempt, bound: Any) -> Ended:
        """How the handler ended; stops it at its timeout.

        A handler that ignores being stopped (it swallows the cancellation) is
        given up on after the grace period: the attempt's outcome is recorded
        as its stop cause says and the message settled, while the task runs on
        unowned (its writes are fenced out).
        """
        task = running.task
        await running.ended_or_stopped(attempt.timeout_seconds)
        if not task.done():
            running.stop(StopCause.TIMEOUT)
            finished, _ = await asyncio.wait({task}, timeout=self._cancel_grace)
            if not finished:
                bound.error(
                    "job.handler.unresponsive",
                    attempt=attempt.attempt,
                    cause=running.cause.value if running.cause else None,
                    grace=self._cancel_grace,
                )
                task.add_done_callback(_retrieve)
                return Ended()
        if task.cancelled():
            if running.cause is None:
                stray = RuntimeError("the handler's task was cancelled, not by the worker")
                return Ended(error=stray)
            return Ended()
        error = task.exception()
        if error is not None:
            return Ended(error=error)
        return Ended(returned=True, result=task.result())

    def _first_beat(self) -> float:
        """Seconds from a handler's start to its first heartbeat.

        Early: a cancel that landed between our claim and the running-job
        registration missed the LISTEN path, and the row is where it waits.
        Short jobs end before it and pay nothing.
        """
        return min(self._store.lease_seconds / 3, 1.0)

    async def _heartbeat(self, attempt: Attempt, running: Running) -> None:
        """Beat now (the first beat is due), then every third of the lease."""
        interval = self._store.lease_seconds / 3
        delay = 0.0
        while not running.task.done():
            await asyncio.sleep(delay)
            delay = interval
            if running.task.done():
                return
            try:
                if await self._store.heartbeat(attempt):
                    running.stop(StopCause.CANCEL_REQUESTED)
            except LeaseLost:
                running.stop(StopCause.LEASE_LOST)
                return
            except Exception as exc:
                # Beat again next time; the lease outlives a few missed beats.
                log.warning("job.heartbeat.failed", error=describe_error(exc))


def _retrieve(task: asyncio.Task[Any]) -> None:
    # A handler given up on ends some time later; what it raised then is moot.
    if not task.cancelled():
        task.exception()
