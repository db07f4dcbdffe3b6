"""The worker runtime: consume, claim (fenced), run the handler, commit, then ack.

A message is acked only after the outcome of its attempt is committed, so a
worker that dies at any point leaves the message to be redelivered; the claim
decides what a redelivery does (run, wait, or ack a duplicate). A message of a
type this worker has no handler for is not claimed: the job is handed back
through the outbox, or parked when no live worker handles it (ADR-0007).
Whatever goes wrong while a message is handled, it ends acked or nacked.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import aio_pika
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.attempt_end import (
    CANCELLED,
    FAILED,
    RETRY,
    EndCause,
    Retry,
    RetryPolicy,
    completed,
    decide,
)
from jobplane.batcher import Batcher
from jobplane.config import DEFAULT_INLINE_BYTES, MAX_OFFLOADED_JSON_BYTES
from jobplane.envelope import Envelope, EnvelopeError
from jobplane.errors import BlobStoreUnavailable
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.lifecycle import Lifecycle
from jobplane.logs import describe_error, fingerprint
from jobplane.names import job_name
from jobplane.store.attempts import (
    Attempt,
    AttemptStore,
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    HandBack,
    LeaseLost,
    Outcome,
    ProgressUpdate,
)
from jobplane.store.db import Database
from jobplane.store.deployment import Deployment, this_deployment
from jobplane.store.down import database_error_name, database_transient, until_database_up
from jobplane.store.listen import Listener
from jobplane.store.machine import Emitted, Transition
from jobplane.store.rows import CANCEL_CHANNEL, dumps
from jobplane.tasks import cancel_and_wait
from jobplane.topology import Ownership, Topology, ensure
from jobplane.types import BlobRef
from jobplane.workers.bounce import Bounced, bounce_foreign
from jobplane.workers.group import DEFAULT_GROUP_MAX, DEFAULT_GROUP_WINDOW, Acks
from jobplane.workers.handlers import JobContext, Registry, with_offloaded_payload
from jobplane.workers.interceptors import Interceptor, chain
from jobplane.workers.outcome import Escaped, Failure, check_result, describe, invoke
from jobplane.workers.presence import Presence
from jobplane.workers.priority import Slots, SlotsClosed, consume
from jobplane.workers.progress import ProgressFlusher, ProgressWriter
from jobplane.workers.threads import HandlerThreads

if TYPE_CHECKING:
    from jobplane.blobs.store import BlobStore

log = structlog.get_logger("jobplane.worker")

T = TypeVar("T")


def _ungrouped(_size: int) -> None:
    """A group went out, and nothing observes the worker."""


class StopCause(enum.Enum):
    """Why the runtime cancelled a handler's task."""

    CANCEL_REQUESTED = "cancel_requested"
    LEASE_LOST = "lease_lost"
    SHUTDOWN = "shutdown"
    TIMEOUT = "timeout"


class _Running:
    """A handler task and why (if at all) the runtime stopped it."""

    def __init__(self, task: asyncio.Task[Any], on_stop: Callable[[], None] = lambda: None) -> None:
        self.task = task
        # Tells the handler's context (a thread cannot be cancelled; it reads it).
        self._on_stop = on_stop
        self.started = time.monotonic()
        self.cause: StopCause | None = None
        # Done when the task ends or the runtime stops it, whichever is first:
        # one future and a callback a job, not a task waiting on an event.
        self._woken: asyncio.Future[None] = task.get_loop().create_future()
        task.add_done_callback(self._wake)

    def _wake(self, *_: object) -> None:
        if not self._woken.done():
            self._woken.set_result(None)

    async def ended_or_stopped(self, timeout: float) -> None:
        """Until the task ended or was stopped, or ``timeout`` seconds passed."""
        if self._woken.done():
            return
        timer = self.task.get_loop().call_later(timeout, self._wake)
        try:
            await asyncio.shield(self._woken)
        finally:
            timer.cancel()

    @property
    def error(self) -> BaseException | None:
        """What the handler raised, once its task is done (None: returned, or stopped)."""
        task = self.task
        if not task.done() or task.cancelled():
            return None
        return task.exception()

    def stop(self, cause: StopCause) -> None:
        if self.cause is None and not self.task.done():
            self.cause = cause
            self._on_stop()
            self._wake()
            self.task.cancel()


class Worker(Lifecycle):
    """Consumes the topology's queues and runs the registry's handlers.

    ``async with Worker(...) as worker:`` starts it and stops it with the
    default grace (or ``await start()``, then ``await stop(grace)``); :meth:`run`
    is a whole process's life.
    """

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
        presence_interval: float = 5.0,
        handback_delay: float = 0.5,
        handback_max_delay: float = 10.0,
        cancel_grace: float = 10.0,
        max_result_bytes: int = 256 * 1024,
        reserve: int | None = None,
        blobs: BlobStore | None = None,
        inline_bytes: int | None = None,
        interceptors: Sequence[Interceptor] = (),
        group_window: float = DEFAULT_GROUP_WINDOW,
        group_max: int = DEFAULT_GROUP_MAX,
        db: Database | None = None,
        sync_threads: int | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if group_max < 1:
            raise ValueError("group_max must be at least 1")
        if sync_threads is not None and sync_threads < 1:
            raise ValueError("sync_threads must be at least 1")
        # Plain ``def`` handlers run in these threads; no more than the slots
        # by default, since a thread only ever runs a slot's handler.
        self._sync_threads = sync_threads or concurrency
        self._threads: HandlerThreads | None = None
        self._engine = engine
        # The attempts' statements run on asyncpg (ADR-0030): the caller's
        # pool, or one of the worker's own, opened and closed with it.
        self._owns_db = db is None
        self._db = db or Database(database_url, size=worker_pool_size(concurrency))
        self._store = AttemptStore(self._db, lease_seconds=lease_seconds)
        self._amqp_url = amqp_url
        self._topology = topology
        self._registry = registry
        self._concurrency = concurrency
        self._prefetch = prefetch
        self._queues = queues or [q.name for q in topology.queues]
        # Handler slots across all the queues, granted by queue priority.
        specs = [q for q in topology.queues if q.name in self._queues]
        self._slots = Slots(concurrency, [q.priority for q in specs], reserve=reserve)
        self._classes: dict[str, str] = {}
        self._progress = ProgressFlusher(self._store, window=progress_window)
        self._retry_base_delay = retry_base_delay
        self._faults = faults
        self._cancels = Listener(database_url, CANCEL_CHANNEL)
        self._cancels.on_notify(self._on_cancel_notification)
        self._connection: AbstractConnection | None = None
        self._bounce_channel: AbstractChannel | None = None
        self._deployment: Deployment | None = None
        self.ownership: Ownership | None = None
        self.bounced = 0
        self._consumers: list[tuple[aio_pika.abc.AbstractQueue, str]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: dict[str, _Running] = {}
        self._stopping = False
        self._presence = Presence(
            engine,
            self._store,
            types=list(registry),
            queues=self._queues,
            concurrency=concurrency,
            interval=presence_interval,
        )
        self._handback_delay = handback_delay
        self._handback_max_delay = handback_max_delay
        self._cancel_grace = cancel_grace
        self._max_result_bytes = max_result_bytes
        # The object store handlers reach through ctx (the caller's; None: blobs disabled).
        self._blobs = blobs
        self._inline_bytes = min(
            DEFAULT_INLINE_BYTES if inline_bytes is None else inline_bytes, max_result_bytes
        )
        # The registry's lifespans: entered at start, left at stop after the handlers.
        self._lifespans = contextlib.AsyncExitStack()
        # What the process observes of this worker (tracing, metrics): read
        # once at each seam, None when it observes nothing.
        self._intercept = intercept = chain(interceptors)
        on_group = None if intercept is None else intercept.grouped
        # Group commit (ADR-0028): claims and outcomes of concurrent deliveries
        # within group_window seconds go out as one statement each, and their
        # acks together; a window of 0 or less writes each one alone.
        self._claims: Batcher[ClaimRequest, ClaimResult | None] | None = None
        self._outcomes: Batcher[Outcome, bool] | None = None
        self._acks: Acks | None = None
        if group_window > 0:
            self._claims = Batcher(
                self._store.claim_many,
                window=group_window,
                max_size=group_max,
                # Nothing of a failed claim group commits: each claims alone.
                split=_not_transient,
                on_group=_ungrouped if on_group is None else lambda size: on_group("claim", size),
            )
            self._outcomes = Batcher(
                self._finish_group,
                window=group_window,
                max_size=group_max,
                split=_refused_for_its_values,
                on_group=_ungrouped if on_group is None else lambda n: on_group("outcome", n),
            )
            self._acks = Acks()
        if intercept is not None:
            intercept.known(self._slot_counts, topology, registry)

    def _slot_counts(self) -> tuple[int, int]:
        return (self._slots.running, self._concurrency) if self._consumers else (0, 0)

    def not_ready(self) -> str | None:
        """Why this worker does not take deliveries now (None: it does)."""
        connection = self._connection
        if connection is None or connection.is_closed or connection.transport is None:
            return "no broker connection"
        return None if self._consumers else "not consuming"

    @property
    def id(self) -> str:
        """This worker's id in the ``workers`` table."""
        return str(self._presence.id)

    @property
    def busy(self) -> bool:
        """True while any delivered message is still being handled."""
        return bool(self._tasks)

    @property
    def group_sizes(self) -> dict[str, dict[int, int]]:
        """How many claim and outcome groups of each size this worker wrote."""
        return {
            "claim": dict(self._claims.sizes) if self._claims else {},
            "outcome": dict(self._outcomes.sizes) if self._outcomes else {},
        }

    @property
    def acks_sent(self) -> dict[str, int]:
        """basic.ack frames sent through groups: with ``multiple`` and without."""
        acks = self._acks
        return {"multiple": acks.multiple, "single": acks.single} if acks else {}

    @property
    def running_jobs(self) -> list[str]:
        """Names of the jobs whose handlers run now."""
        return [job_name(k) for k in self._running]

    async def start(self) -> None:
        """Check the topology (declaring only what is missing) and start consuming.

        Waits while the broker or the database is down; raises
        :class:`TopologyMissing` when part of the topology is missing and this
        account may not declare it.
        """
        for name in self._queues:
            self._topology.queue(name)  # unknown queue names fail here, not later
        await self._db.open()
        # Threads start only when a plain handler first runs; daemons, so that
        # one given up on cannot keep the process from exiting.
        self._threads = HandlerThreads(self._sync_threads, thread_name_prefix="jobplane-handler")
        try:
            await self._enter_lifespans()
        except BaseException:
            await self._close_pools()
            raise
        try:
            self._deployment = await until_database_up(lambda: this_deployment(self._engine), log)
            await self._cancels.start()
        except BaseException:
            await self._lifespans.aclose()
            await self._close_pools()
            raise
        try:
            self.ownership = await broker.until_up(self._check_topology, log)
            self._connection = await broker.until_up(
                lambda: broker.connect(self._amqp_url, robust=True), log
            )
            self._bounce_channel = await self._connection.channel(publisher_confirms=True)
            # Registered before consuming: others park a job only when no live
            # worker handles its type, so a worker that consumes must be seen.
            await until_database_up(self._presence.start, log)
            self._classes = await consume(
                self._connection,
                [self._topology.queue(name) for name in self._queues],
                self._slots,
                self._on_message,
                self._consumers,
                prefetch=self._prefetch,
            )
        except BaseException:
            # Whatever started is stopped: a failed start leaves nothing running.
            for queue, tag in self._consumers:
                with contextlib.suppress(Exception):
                    await queue.cancel(tag)
            self._consumers.clear()
            with contextlib.suppress(Exception):
                await self._presence.stop()
            if self._connection is not None:
                with contextlib.suppress(Exception):
                    await self._connection.close()
                self._connection = None
            await self._cancels.stop()
            await self._lifespans.aclose()
            await self._close_pools()
            raise
        log.info(
            "worker.started",
            worker=self.id,
            queues=self._queues,
            handlers=list(self._registry),
            concurrency=self._concurrency,
            prefetch=self._prefetch or {c: self._slots.prefetch(c) for c in self._slots.classes},
            reserve=self._slots.reserve,
            deployment=self._deployment.id,
        )

    async def _check_topology(self) -> Ownership:
        assert self._deployment is not None
        connection = await broker.connect(self._amqp_url)
        async with connection:
            return await ensure(connection, self._topology, self._deployment)

    async def stop(self, grace: float = 10.0) -> None:
        """Stop consuming; give running handlers ``grace`` seconds, then cancel them."""
        self._stopping = True
        for queue, tag in self._consumers:
            with contextlib.suppress(Exception):
                await queue.cancel(tag)
        self._consumers.clear()
        self._slots.close()  # deliveries waiting for a slot go back to their queue
        await self._presence.stop()
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            if pending:
                for running in list(self._running.values()):
                    running.stop(StopCause.SHUTDOWN)
                await asyncio.wait(pending, timeout=10)
        for batcher in (self._claims, self._outcomes, self._acks):
            if batcher is not None:
                # Bounded: a statement stuck on a lock must not hold the stop.
                await batcher.stop(timeout=10)
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
            self._connection = None
        await self._progress.stop()
        await self._cancels.stop()
        await self._lifespans.aclose()
        await self._close_pools()
        log.info("worker.stopped")

    async def _close_pools(self) -> None:
        """Close the worker's database pool (its own) and its handler threads."""
        if self._threads is not None:
            # Not joined: a handler thread given up on may never return. Its
            # threads are daemons, so the process still exits when it is done.
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        if self._owns_db:
            await self._db.close()

    async def _enter_lifespans(self) -> None:
        """Enter the registry's lifespans (what its handlers share); all or none."""
        try:
            for factory in self._registry.lifespans:
                await self._lifespans.enter_async_context(factory())
        except BaseException:
            await self._lifespans.aclose()
            raise

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        # Our own task, not aiormq's: a channel that closes must not cancel a
        # handler mid-run (its outcome is still committed; only the ack is lost).
        if self._acks is not None:
            self._acks.delivered(message)
        task = asyncio.create_task(self._handle_settled(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle_settled(self, message: AbstractIncomingMessage) -> None:
        """:meth:`_handle`, and a nack for a message it left unsettled, whatever happened.

        An unsettled delivery holds a prefetch slot for the life of the
        channel; enough of them and the worker takes nothing more. The nack
        requeues: a claimed job's redelivery waits out our lease, and a crash
        that repeats ends in the dead-letter queue at the delivery limit.
        """
        try:
            await self._handle_and_nack(message)
        finally:
            if self._acks is not None:
                self._acks.forget(message)

    async def _handle_and_nack(self, message: AbstractIncomingMessage) -> None:
        try:
            intercept = self._intercept
            if intercept is None:
                await self._handle(message)
            else:
                with intercept.delivered(message.headers):
                    await self._handle(message)
        except asyncio.CancelledError:
            if not self._settled(message):
                await _settle(message.nack(requeue=True))
            raise
        except Exception as exc:
            # The log's renderer withholds database messages (they can quote
            # a statement's values) from the line and the traceback alike.
            log.error(
                "job.message.crashed",
                message_id=message.message_id,
                error=describe_error(exc),
                exc_info=exc,
            )
            if not self._settled(message):
                await _settle(message.nack(requeue=True))
            return
        if not self._settled(message):
            log.error("job.message.unsettled", message_id=message.message_id)
            await _settle(message.nack(requeue=True))

    def _settled(self, message: AbstractIncomingMessage) -> bool:
        """Whether ``message`` was settled (by itself, or by a group's multiple ack)."""
        return self._acks.settled(message) if self._acks is not None else message.processed

    async def _ack(self, message: AbstractIncomingMessage) -> None:
        """Ack after the commit: with the others of this moment when grouping."""
        if self._acks is None:
            await _settle(message.ack())
        else:
            await self._acks.ack(message)

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
        queue = next((q.name for q, tag in self._consumers if tag == message.consumer_tag), "")
        bound = log.bind(
            job=job_name(envelope.job_id),
            event_id=str(envelope.event_id),
            tenant_id=str(envelope.tenant_id),
            correlation_id=fingerprint(envelope.correlation_id),
            queue=queue,
            exchange=message.exchange,
            routing_key=message.routing_key,
            delivery_tag=message.delivery_tag,
            redelivered=bool(message.redelivered),
        )
        if message.redelivered:
            bound.info("broker.message.redelivered")
        if self._registry.get(envelope.job_type) is None:
            await self._hand_back_job(envelope, message, bound)
            return
        # A slot before the claim: a job is claimed only when it can start.
        priority = self._classes.get(message.consumer_tag or "", "")
        try:
            async with self._slots.turn(priority):
                await self._claim_and_run(envelope, message, bound)
        except SlotsClosed:
            await _settle(message.nack(requeue=True))

    async def _claim_and_run(
        self, envelope: Envelope, message: AbstractIncomingMessage, bound: Any
    ) -> None:
        try:
            redelivered = bool(message.redelivered)
            intercept = self._intercept
            if intercept is None:
                claim = await self._claim(envelope, redelivered=redelivered)
            else:
                claim = await intercept.claim(
                    envelope, message, lambda: self._claim(envelope, redelivered=redelivered)
                )
        except _Stopping:
            await _settle(message.nack(requeue=True))
            return
        if claim.status is ClaimStatus.CLAIMED and claim.attempt is not None:
            bound = bound.bind(request_id=fingerprint(claim.attempt.request_id))
            bound.info("job.received", attempt=claim.attempt.attempt, type=envelope.job_type)
            try:
                await self._run(claim.attempt, bound)
            except _Stopping:
                # Outcome not committed: the redelivery finds the lease and waits it out.
                await _settle(message.nack(requeue=True))
                return
            self._faults.hit("worker.after_outcome")
            await self._ack(message)
            return
        if claim.status is ClaimStatus.NOT_FOUND:
            await self._unknown_job(message, envelope, bound)
            return
        bound.info("job.message.duplicate", status=claim.status.value)
        await self._ack(message)

    @property
    def _deployment_id(self) -> str | None:
        return self._deployment.id if self._deployment is not None else None

    async def _unknown_job(
        self, message: AbstractIncomingMessage, envelope: Envelope, bound: Any
    ) -> None:
        """No such job in our database: another deployment's message, or a stray."""
        # Decided after the lookup, not before: a deployment whose identity
        # changed (its database restored elsewhere) still runs its own jobs.
        if self._foreign(envelope):
            await self._bounce(message, envelope, bound)
            return
        bound.error("job.message.unknown_job")
        await _settle(message.reject(requeue=False))

    def _foreign(self, envelope: Envelope) -> bool:
        """True for a message of another deployment sharing these queues."""
        return envelope.deployment not in (None, self._deployment_id)

    async def _bounce(
        self, message: AbstractIncomingMessage, envelope: Envelope, bound: Any
    ) -> None:
        """A message of another deployment (no such job here): back to its queue
        (ADR-0006), or to the dead-letter queue after too many bounces."""
        assert self._bounce_channel is not None
        queue = next((q.name for q, tag in self._consumers if tag == message.consumer_tag), None)
        try:
            done, bounces = await bounce_foreign(
                self._bounce_channel, message, queue, this_deployment=self._deployment_id
            )
        except Exception as exc:
            bound.warning("job.message.bounce_failed", error=describe_error(exc))
            await _settle(message.nack(requeue=True))
            return
        if done is Bounced.REQUEUED:
            self.bounced += 1
            bound.info(
                "job.message.bounced",
                owner=envelope.deployment,
                this=self._deployment_id,
                bounces=bounces,
            )

    async def _claim(self, envelope: Envelope, *, redelivered: bool) -> ClaimResult:
        """Claim, waiting while another attempt holds a live lease.

        A redelivery of a message whose worker died finds the job RUNNING under
        that worker's lease; it waits for the lease to run out (or the job to
        end) instead of dropping the only message that can restart the job.
        A first delivery that finds a live lease is a copy (a relay that
        published twice, a re-published dispatch): the message that claimed
        the job is held by the worker running it, and comes back if that
        worker dies, so the copy is acked rather than holding a slot for the
        whole run.
        """
        while True:
            claim = await self._with_db_retry(lambda: self._claim_once(envelope))
            if claim.status is not ClaimStatus.IN_FLIGHT or not redelivered:
                return claim
            if self._stopping:
                raise _Stopping
            # Lease times are the database's clock: poll at a fraction of the lease.
            await asyncio.sleep(min(self._store.lease_seconds / 3, 5.0))

    async def _claim_once(self, envelope: Envelope) -> ClaimResult:
        """One claim of ``envelope``: in the next claim group, or alone."""
        store = self._store
        if self._claims is None or not store.groups_claims:
            return await store.claim(envelope, worker=self.id)
        request = store.claim_request(envelope, worker=self.id)
        claim = await self._claims.submit(request)
        if claim is None:
            # Refused by its fence: why, as a claim alone finds it (in this
            # delivery's own context, as are the statements that follow).
            return await store.refused_claim(request)
        intercept = self._intercept
        if intercept is not None:
            intercept.applied(Transition.CLAIM)
        return claim

    async def _finish_group(self, outcomes: list[Outcome]) -> list[bool]:
        done = await self._store.finish_many(outcomes)
        # Committed, not acked: a crash here leaves every delivery of the
        # group to be redelivered, and their claims find the jobs ended.
        self._faults.hit("worker.after_group_commit")
        return done

    async def _write(self, outcome: Outcome, pending: list[ProgressUpdate]) -> None:
        """Commit ``outcome``: with the next outcome group, or alone.

        An outcome with pending progress commits alone, in one transaction
        with its reports, so that its terminal event is the job's last.
        """
        store = self._store
        if pending or self._outcomes is None or not store.groups(outcome):
            await store.finish(outcome, pending)
            return
        if not await self._outcomes.submit(outcome):
            attempt = outcome.attempt
            raise LeaseLost(f"jobs/{attempt.job_id} attempt {attempt.attempt} was fenced out")
        intercept = self._intercept
        if intercept is not None:
            intercept.applied(outcome.transition)

    async def _hand_back_job(
        self, envelope: Envelope, message: AbstractIncomingMessage, bound: Any
    ) -> None:
        """Give the job back unclaimed: this worker has no handler for its type."""
        try:
            status, reason = await self._with_db_retry(
                lambda: self._store.hand_back(
                    envelope, base_delay=self._handback_delay, max_delay=self._handback_max_delay
                )
            )
        except _Stopping:
            await _settle(message.nack(requeue=True))
            return
        if status is HandBack.NOT_FOUND:
            await self._unknown_job(message, envelope, bound)
            return
        if status is HandBack.PARKED:
            bound.warning("job.parked", type=envelope.job_type, reason=reason)
        elif status is HandBack.HANDED_BACK:
            bound.info("job.handed_back", type=envelope.job_type)
        else:
            # Finished, stale, or running: a worker that has the handler owns
            # it (a lease that runs out is the sweeper's to repair).
            bound.info("job.message.duplicate", status=status.value)
        await _settle(message.ack())

    async def _with_db_retry(self, op: Callable[[], Awaitable[T]]) -> T:
        delay = 0.2
        while True:
            try:
                return await op()
            except Exception as exc:
                if not database_transient(exc):
                    raise
                if self._stopping:
                    raise _Stopping from exc
                log.warning("worker.db.retry", error=describe_error(exc), delay=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _run(self, attempt: Attempt, bound: Any) -> None:
        key = str(attempt.job_id)
        handler = self._registry.get(attempt.type)
        if handler is None:  # pragma: no cover - the claim matched the message's type
            raise RuntimeError(f"claimed jobs/{key} of type {attempt.type!r} without its handler")
        holder: list[_Running] = []

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
        )
        if attempt.payload_blob is not None:
            handler = with_offloaded_payload(handler, max_bytes=MAX_OFFLOADED_JSON_BYTES)
        bound.info("job.started", attempt=attempt.attempt, type=attempt.type)
        intercept = self._intercept
        run = None if intercept is None else intercept.started(attempt)
        running = _Running(
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
                run.ended(running.error)
        pending = await writer.drain()
        if intercept is None:
            await self._record(attempt, running, ended, pending, bound, ctx.emitted)
        else:
            with intercept.outcome(attempt):
                await self._record(attempt, running, ended, pending, bound, ctx.emitted)

    async def _offload_result(
        self, attempt: Attempt, result: dict[str, Any]
    ) -> dict[str, Any] | tuple[dict[str, Any], BlobRef] | Failure:
        """``result`` as it is stored: itself, or ``{}`` and the blob it went to."""
        assert self._blobs is not None
        body = dumps(result).encode()
        if len(body) <= self._inline_bytes:
            return result
        try:
            info = await self._blobs.put_bytes(
                attempt.tenant_id, body, content_type="application/json"
            )
        except BlobStoreUnavailable as exc:
            return Failure(BlobStoreUnavailable.reason, exc.message, retryable=True)
        return {}, BlobRef(info.name, info.digest, info.size)

    async def _wait(self, running: _Running, attempt: Attempt, bound: Any) -> _Ended:
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
                return _Ended()
        if task.cancelled():
            if running.cause is None:
                stray = RuntimeError("the handler's task was cancelled, not by the worker")
                return _Ended(error=stray)
            return _Ended()
        error = task.exception()
        if error is not None:
            return _Ended(error=error)
        return _Ended(returned=True, result=task.result())

    async def _record(
        self,
        attempt: Attempt,
        running: _Running,
        ended: _Ended,
        pending: list[ProgressUpdate],
        bound: Any,
        emitted: Sequence[Emitted] = (),
    ) -> None:
        # The handler's emitted events go only with a success; any other
        # outcome drops them.
        store = self._store
        if running.cause is StopCause.LEASE_LOST:
            bound.warning("job.lease_lost", attempt=attempt.attempt)
            return
        if running.cause is StopCause.CANCEL_REQUESTED and not ended.returned:
            cancelled = store.was_cancelled(attempt)
            await self._outcome(attempt, bound, lambda: self._write(cancelled, pending))
            bound.info("job.cancelled", attempt=attempt.attempt)
            self._ended(attempt, running, CANCELLED)
            return
        cause = EndCause.FAILED
        if running.cause is StopCause.SHUTDOWN and not ended.returned:
            failure = Failure("WORKER_SHUTDOWN", "the worker shut down during the attempt", True)
            cause = EndCause.SHUTDOWN
        elif running.cause is StopCause.TIMEOUT and not ended.returned:
            failure = Failure(
                "TIMEOUT",
                f"the attempt ran longer than its timeout of {attempt.timeout_seconds:g}s",
                retryable=True,
            )
        elif ended.returned:
            # With an object store, a plain job's result may be larger than
            # the inline limit: it goes to a blob, the row keeps its name.
            offload = self._blobs is not None and attempt.stage is None
            limit = max(self._max_result_bytes, MAX_OFFLOADED_JSON_BYTES) if offload else None
            checked = check_result(ended.result, max_bytes=limit or self._max_result_bytes)
            if isinstance(checked, dict):
                stored = await self._offload_result(attempt, checked) if offload else checked
                if not isinstance(stored, Failure):
                    result, ref = stored if isinstance(stored, tuple) else (stored, None)
                    succeeded = store.succeeded(attempt, result, emitted=emitted, result_blob=ref)
                    await self._outcome(attempt, bound, lambda: self._write(succeeded, pending))
                    bound.info("job.completed", attempt=attempt.attempt, offloaded=ref is not None)
                    self._ended(attempt, running, completed(attempt.stage))
                    return
                failure = stored
            else:
                failure = describe(checked)
                failure = Failure(failure.code, failure.message, retryable=False)
        else:
            failure = describe(ended.error or RuntimeError("the handler ended without a result"))
        decision = decide(
            attempt.budget_attempt, attempt.max_attempts, failure, self._policy(attempt), cause
        )
        # The traceback goes to the log once, with the event that ends the attempt.
        exc_info = _loggable(ended.error)
        if isinstance(decision, Retry):
            retried = store.retried(
                attempt,
                decision.code,
                decision.message,
                delay=decision.delay,
                refund=decision.refund,
                details=decision.details,
            )
            await self._outcome(attempt, bound, lambda: self._write(retried, pending))
            bound.warning(
                "job.retry_scheduled",
                attempt=attempt.attempt,
                delay=decision.delay,
                code=decision.code,
                error=decision.message,
                exc_info=exc_info,
            )
            self._ended(attempt, running, RETRY)
            return
        failed = store.failed(
            attempt, decision.code, decision.message, retryable=False, details=decision.details
        )
        await self._outcome(attempt, bound, lambda: self._write(failed, pending))
        bound.warning(
            "job.failed",
            attempt=attempt.attempt,
            code=decision.code,
            error=decision.message,
            exc_info=exc_info,
        )
        self._ended(attempt, running, FAILED)

    def _ended(self, attempt: Attempt, running: _Running, outcome: str) -> None:
        intercept = self._intercept
        if intercept is not None:
            intercept.ended(attempt, outcome, time.monotonic() - running.started)

    def _policy(self, attempt: Attempt) -> RetryPolicy:
        # The same policy as WorkerService's (jobplane.server.workers).
        return RetryPolicy.of_queue(
            self._topology, attempt.queue, base_override=self._retry_base_delay
        )

    async def _outcome(
        self, attempt: Attempt, bound: Any, write: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            await self._with_db_retry(write)
        except LeaseLost:
            bound.warning("job.outcome.fenced_out")
        except DBAPIError as exc:
            # Refused for what it holds, not because the database is down: the
            # same write would fail on every try. End the attempt in our words.
            refused = database_error_name(exc)
            bound.error("job.outcome.refused", attempt=attempt.attempt, error=refused)
            try:
                await self._with_db_retry(
                    lambda: self._store.fail(
                        attempt,
                        "OUTCOME_REFUSED",
                        f"the database refused the attempt's outcome ({refused})",
                        retryable=False,
                    )
                )
            except LeaseLost:
                bound.warning("job.outcome.fenced_out")

    def _first_beat(self) -> float:
        """Seconds from a handler's start to its first heartbeat.

        Early: a cancel that landed between our claim and the running-job
        registration missed the LISTEN path, and the row is where it waits.
        Short jobs end before it and pay nothing.
        """
        return min(self._store.lease_seconds / 3, 1.0)

    async def _heartbeat(self, attempt: Attempt, running: _Running) -> None:
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


def worker_pool_size(concurrency: int) -> int:
    """Connections a worker's attempts use at most: concurrent groups, progress
    and heartbeats of ``concurrency`` handlers, between 4 and 20."""
    return max(4, min(concurrency, 20))


class _Stopping(Exception):
    """The worker is stopping; give the message back."""


def _not_transient(exc: BaseException) -> bool:
    """A claim group failed for anything but a passing database error (a value, a
    row it could not read): run each alone, so that one claim cannot fail the rest."""
    return not (isinstance(exc, DBAPIError) and database_transient(exc))


def _refused_for_its_values(exc: BaseException) -> bool:
    """A group's statement failed for what one of its rows holds: run each alone."""
    return isinstance(exc, DBAPIError) and not database_transient(exc)


@dataclass(frozen=True, slots=True)
class _Ended:
    """How a handler's task ended: it returned ``result``, raised ``error``, or
    neither (it was stopped, or given up on)."""

    returned: bool = False
    result: Any = None
    error: BaseException | None = None


def _loggable(error: BaseException | None) -> BaseException | None:
    if error is None:
        return None
    return error.original if isinstance(error, Escaped) else error


def _retrieve(task: asyncio.Task[Any]) -> None:
    # A handler given up on ends some time later; what it raised then is moot.
    if not task.cancelled():
        task.exception()


async def _settle(settle: Awaitable[Any]) -> None:
    """Ack, nack or reject; a closed channel means the broker redelivers anyway."""
    try:
        await settle
    except Exception as exc:
        log.warning("job.message.settle_failed", error=str(exc))
