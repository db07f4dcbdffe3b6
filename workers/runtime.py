"""The worker runtime: consume, claim (fenced), run the handler, commit, then ack.

A message is acked only after the outcome of its attempt is committed, so a
worker that dies at any point leaves the message to be redelivered; the claim
decides what a redelivery does (run, wait, or ack a duplicate).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aio_pika
import structlog
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.envelope import Envelope, EnvelopeError
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.names import job_name
from jobplane.store.attempts import (
    Attempt,
    AttemptStore,
    ClaimResult,
    ClaimStatus,
    LeaseLost,
    ProgressUpdate,
)
from jobplane.store.listen import Listener
from jobplane.store.rows import CANCEL_CHANNEL
from jobplane.tasks import cancel_and_wait
from jobplane.topology import Topology, TopologyError, declare
from jobplane.workers.handlers import JobContext, PermanentError, Registry, RetryableError
from jobplane.workers.progress import ProgressFlusher, ProgressWriter
from jobplane.workers.retry import backoff

log = structlog.get_logger("jobplane.worker")

T = TypeVar("T")


class StopCause(enum.Enum):
    """Why the runtime cancelled a handler's task."""

    CANCEL_REQUESTED = "cancel_requested"
    LEASE_LOST = "lease_lost"
    SHUTDOWN = "shutdown"
    TIMEOUT = "timeout"


class _Running:
    """A handler task and why (if at all) the runtime stopped it."""

    def __init__(self, task: asyncio.Task[dict[str, Any]]) -> None:
        self.task = task
        self.cause: StopCause | None = None

    def stop(self, cause: StopCause) -> None:
        if self.cause is None and not self.task.done():
            self.cause = cause
            self.task.cancel()


class Worker:
    """Consumes the topology's queues and runs the registry's handlers."""

    def __init__(
        self,
        engine: AsyncEngine,
        database_url: str,
        amqp_url: str,
        topology: Topology,
        registry: Registry,
        *,
        concurrency: int = 8,
        prefetch: int | None = None,
        lease_seconds: float = 30.0,
        queues: list[str] | None = None,
        progress_window: float = 0.005,
        retry_base_delay: float | None = None,
        faults: FaultPoints = NO_FAULTS,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._store = AttemptStore(engine, lease_seconds=lease_seconds)
        self._amqp_url = amqp_url
        self._topology = topology
        self._registry = registry
        self._concurrency = concurrency
        self._prefetch = prefetch if prefetch is not None else concurrency
        self._queues = queues or [q.name for q in topology.queues]
        self._progress = ProgressFlusher(self._store, window=progress_window)
        self._retry_base_delay = retry_base_delay
        self._faults = faults
        self._cancels = Listener(database_url, CANCEL_CHANNEL)
        self._cancels.on_notify(self._on_cancel_notification)
        self._connection: AbstractConnection | None = None
        self._consumers: list[tuple[aio_pika.abc.AbstractQueue, str]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: dict[str, _Running] = {}
        self._stopping = False

    @property
    def busy(self) -> bool:
        """True while any delivered message is still being handled."""
        return bool(self._tasks)

    @property
    def running_jobs(self) -> list[str]:
        """Names of the jobs whose handlers run now."""
        return [job_name(k) for k in self._running]

    async def start(self) -> None:
        """Declare the topology and start consuming."""
        for name in self._queues:
            self._topology.queue(name)  # unknown queue names fail here, not later
        await self._cancels.start()
        self._connection = await broker.connect(self._amqp_url, robust=True)
        channel = await self._connection.channel()
        await channel.set_qos(prefetch_count=self._prefetch)
        await declare(channel, self._topology)
        for name in self._queues:
            queue = await channel.get_queue(name)
            tag = await queue.consume(self._on_message, no_ack=False)
            self._consumers.append((queue, tag))
        log.info(
            "worker.started",
            queues=self._queues,
            handlers=list(self._registry),
            concurrency=self._concurrency,
            prefetch=self._prefetch,
        )

    async def stop(self, grace: float = 10.0) -> None:
        """Stop consuming; give running handlers ``grace`` seconds, then cancel them."""
        self._stopping = True
        for queue, tag in self._consumers:
            with contextlib.suppress(Exception):
                await queue.cancel(tag)
        self._consumers.clear()
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            if pending:
                for running in list(self._running.values()):
                    running.stop(StopCause.SHUTDOWN)
                await asyncio.wait(pending, timeout=10)
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
            self._connection = None
        await self._progress.stop()
        await self._cancels.stop()
        log.info("worker.stopped")

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        # Our own task, not aiormq's: a channel that closes must not cancel a
        # handler mid-run (its outcome is still committed; only the ack is lost).
        task = asyncio.create_task(self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_cancel_notification(self, payload: str) -> None:
        running = self._running.get(payload)
        if running is not None:
            running.stop(StopCause.CANCEL_REQUESTED)

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        try:
            envelope = Envelope.decode(message.body)
        except EnvelopeError as exc:
            log.error("job.message.rejected", reason=str(exc), message_id=message.message_id)
            await _settle(message.reject(requeue=False))
            return
        bound = log.bind(job=job_name(envelope.job_id), event_id=str(envelope.event_id))
        try:
            claim = await self._claim(envelope)
        except _Stopping:
            await _settle(message.nack(requeue=True))
            return
        if claim.status is ClaimStatus.CLAIMED and claim.attempt is not None:
            bound.info("job.received", attempt=claim.attempt.attempt, type=envelope.job_type)
            try:
                await self._run(claim.attempt, bound)
            except _Stopping:
                # Outcome not committed: the redelivery finds the lease and waits it out.
                await _settle(message.nack(requeue=True))
                return
            self._faults.hit("worker.after_outcome")
            await _settle(message.ack())
            return
        if claim.status is ClaimStatus.NOT_FOUND:
            bound.error("job.message.unknown_job")
            await _settle(message.reject(requeue=False))
            return
        bound.info("job.message.duplicate", status=claim.status.value)
        await _settle(message.ack())

    async def _claim(self, envelope: Envelope) -> ClaimResult:
        """Claim, waiting while another attempt holds a live lease.

        A redelivery of a message whose worker died finds the job RUNNING under
        that worker's lease; it waits for the lease to run out (or the job to
        end) instead of dropping the only message that can restart the job.
        """
        while True:
            claim = await self._with_db_retry(lambda: self._store.claim(envelope))
            if claim.status is not ClaimStatus.IN_FLIGHT:
                return claim
            if self._stopping:
                raise _Stopping
            # Lease times are the database's clock: poll at a fraction of the lease.
            await asyncio.sleep(min(self._store.lease_seconds / 3, 5.0))

    async def _with_db_retry(self, op: Callable[[], Awaitable[T]]) -> T:
        delay = 0.2
        while True:
            try:
                return await op()
            except (DBAPIError, OSError) as exc:
                if self._stopping:
                    raise _Stopping from exc
                log.warning("worker.db.retry", error=str(exc).splitlines()[0], delay=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _run(self, attempt: Attempt, bound: Any) -> None:
        key = str(attempt.job_id)
        handler = self._registry.get(attempt.type)
        if handler is None:
            await self._outcome(
                bound,
                lambda: self._store.fail(
                    attempt,
                    "NO_HANDLER",
                    f"no handler is registered for job type {attempt.type!r} on this worker",
                    retryable=False,
                ),
            )
            bound.error("job.failed", reason="no_handler", type=attempt.type)
            return
        holder: list[_Running] = []

        def cancel_requested() -> None:
            if holder:
                holder[0].stop(StopCause.CANCEL_REQUESTED)

        writer = ProgressWriter(self._progress, attempt, on_cancel_requested=cancel_requested)
        ctx = JobContext(attempt, writer)
        running = _Running(asyncio.create_task(handler(ctx), name=f"job-{key}"))
        holder.append(running)
        self._running[key] = running
        heartbeat = asyncio.create_task(self._heartbeat(attempt, running))
        try:
            result: dict[str, Any] | None = None
            error: BaseException | None = None
            try:
                done, _ = await asyncio.wait({running.task}, timeout=attempt.timeout_seconds)
                if not done:
                    running.stop(StopCause.TIMEOUT)
                result = await running.task
            except asyncio.CancelledError:
                if running.cause is None:
                    raise  # we are being cancelled ourselves
            except Exception as exc:
                error = exc
        finally:
            await cancel_and_wait(heartbeat)
            self._running.pop(key, None)
        pending = await writer.drain()
        await self._record(attempt, running, result, error, pending, bound)

    async def _record(
        self,
        attempt: Attempt,
        running: _Running,
        result: dict[str, Any] | None,
        error: BaseException | None,
        pending: list[ProgressUpdate],
        bound: Any,
    ) -> None:
        store = self._store
        if running.cause is StopCause.LEASE_LOST or isinstance(error, LeaseLost):
            bound.warning("job.lease_lost", attempt=attempt.attempt)
            return
        if running.cause is StopCause.CANCEL_REQUESTED and result is None:
            await self._outcome(bound, lambda: store.cancelled(attempt, pending))
            bound.info("job.cancelled", attempt=attempt.attempt)
            return
        refund = False
        if running.cause is StopCause.SHUTDOWN and result is None:
            error = RetryableError(
                "the worker shut down during the attempt", delay=0, code="WORKER_SHUTDOWN"
            )
            refund = True
        if running.cause is StopCause.TIMEOUT and result is None:
            error = RetryableError(
                f"the attempt ran longer than its timeout of {attempt.timeout_seconds:g}s",
                code="TIMEOUT",
            )
        if error is None:
            checked = _check_result(result)
            if isinstance(checked, dict):
                await self._outcome(bound, lambda: store.succeed(attempt, checked, pending))
                bound.info("job.succeeded", attempt=attempt.attempt)
                return
            error = PermanentError(checked, code="BAD_RESULT")
        code = getattr(error, "code", "HANDLER_ERROR")
        if not isinstance(error, PermanentError | RetryableError):
            code = "HANDLER_ERROR"
        # Our own errors carry a message meant for people; anything else is
        # named by its type, which is what tells a developer where to look.
        if isinstance(error, PermanentError | RetryableError):
            message = str(error)[:4096]
        else:
            message = f"{type(error).__name__}: {error}"[:4096]
        retryable = not isinstance(error, PermanentError)
        if retryable and (attempt.attempts_left > 0 or refund):
            delay = getattr(error, "delay", None)
            if delay is None:
                delay = self._backoff(attempt)
            await self._outcome(
                bound,
                lambda: store.schedule_retry(
                    attempt, code, message, delay=delay, pending=pending, refund=refund
                ),
            )
            bound.warning(
                "job.retry_scheduled", attempt=attempt.attempt, delay=delay, error=message
            )
            return
        await self._outcome(
            bound, lambda: store.fail(attempt, code, message, retryable=retryable, pending=pending)
        )
        bound.warning("job.failed", attempt=attempt.attempt, error=message)

    def _backoff(self, attempt: Attempt) -> float:
        try:
            queue = self._topology.queue(attempt.queue)
        except TopologyError:  # the job's queue left the topology: plain defaults
            return backoff(attempt.attempt, base=self._retry_base_delay or 1.0)
        base = queue.retry_base_delay if self._retry_base_delay is None else self._retry_base_delay
        return backoff(attempt.attempt, base=base, cap=queue.retry_max_delay)

    async def _outcome(self, bound: Any, write: Callable[[], Awaitable[None]]) -> None:
        try:
            await self._with_db_retry(write)
        except LeaseLost:
            bound.warning("job.outcome.fenced_out")

    async def _heartbeat(self, attempt: Attempt, running: _Running) -> None:
        interval = self._store.lease_seconds / 3
        # The first beat comes early: a cancel that landed between our claim
        # and the running-job registration missed the LISTEN path, and the
        # row is where it waits. Short jobs end before it and pay nothing.
        delay = min(interval, 1.0)
        while not running.task.done():
            await asyncio.sleep(delay)
            delay = interval
            try:
                if await self._store.heartbeat(attempt):
                    running.stop(StopCause.CANCEL_REQUESTED)
            except LeaseLost:
                running.stop(StopCause.LEASE_LOST)
                return
            except (DBAPIError, OSError) as exc:
                log.warning("job.heartbeat.failed", error=str(exc).splitlines()[0])


class _Stopping(Exception):
    """The worker is stopping; give the message back."""


def _check_result(result: Any) -> dict[str, Any] | str:
    if not isinstance(result, dict):
        return f"the handler returned {type(result).__name__}, not a JSON object"
    try:
        json.dumps(result, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return f"the handler's result is not JSON: {exc}"
    return result


async def _settle(settle: Awaitable[Any]) -> None:
    """Ack, nack or reject; a closed channel means the broker redelivers anyway."""
    try:
        await settle
    except Exception as exc:
        log.warning("job.message.settle_failed", error=str(exc))
