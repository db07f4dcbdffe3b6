"""The sweeper: repair for what did not advance. It is not the main path.

- Jobs RUNNING under a lease that ran out (their worker died or hung): a new
  attempt through the outbox, due after the queue's backoff, or FAILED when
  none is left, as :func:`jobplane.attempt_end.decide` says for any failed
  attempt.
- Outbox rows due for too long and still unpublished: reported; the relay
  that runs beside the sweeper (``jobplane relay`` runs both) publishes them
  (``jobplane sweep --once`` does one relay pass itself).
- Events committed over ``stuck_after`` seconds ago that no relay has
  published (the event feed is behind: no relay runs, the broker is away,
  or a long transaction holds the feed's horizon): reported.
- Dispatches the broker lost: a QUEUED job whose current dispatch was
  published more than ``republish_after`` seconds ago (doubling with each
  re-publish of that dispatch) gets it published again. A copy of a message
  that was not lost after all is harmless: the claim admits one. This pass
  reads QUEUED jobs, whose number grows with a backlog — exactly when the
  database has least to spare — so it runs on a slower schedule of its own
  (every ``republish_every`` seconds), in one sweeper at a time per database,
  and looks at no more than ``republish_scan`` QUEUED jobs per pass,
  continuing where its last pass stopped.

- Deadlines: jobs not ended by their deadline end FAILED, DEADLINE_EXCEEDED
  (a :class:`~jobplane.workers.deadlines.DeadlineLoop` beside the sweeps, on
  a clock of its own: within about ``deadline_poll`` seconds of the
  deadline; ADR-0044). :meth:`Sweeper.sweep_once` runs its pass too.

- Recurring schedules: a :class:`~jobplane.workers.scheduler.Scheduler` runs
  beside the sweeps (``schedules=False``: none), so every deployment ticks
  them (ADR-0041).

- Statistics a hot table has outgrown: a young table whose rows changed since
  its last ANALYZE outnumber the rows it had then is analyzed at once, so
  plans made while it was empty (prepared statements keep theirs) are made
  again; autovacuum visits a database once a minute, and a fresh one taking
  thousands of jobs a second outgrows its plans before that.

Safe to run in many processes at once: rows are taken with SKIP LOCKED and
re-checked under the lock. A sweep that fails is logged and the next one runs
on time: a sweeper never stops on its own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.attempt_end import Decision, EndCause, RetryPolicy, decide
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.lifecycle import Lifecycle
from jobplane.logs import describe_error
from jobplane.names import job_name
from jobplane.store.down import database_transient
from jobplane.store.sweeps import ExpiredLease, SweepStore
from jobplane.tasks import cancel_and_wait
from jobplane.topology import Topology
from jobplane.workers.deadlines import DEFAULT_POLL, DeadlineLoop
from jobplane.workers.interceptors import RelayInterceptor, chain_relay
from jobplane.workers.outcome import Failure
from jobplane.workers.scheduler import Scheduler

log = structlog.get_logger("jobplane.sweeper")

# The header a dispatch's stored context goes by (W3C trace context).
_TRACEPARENT = "traceparent"


def lease_expired(lease: ExpiredLease, policy: RetryPolicy) -> Decision:
    """How an attempt whose lease ran out ends: as a retryable failure (LEASE_EXPIRED)
    of that attempt, by the decision every failed attempt gets."""
    message = f"attempt {lease.attempt} stopped heartbeating (its worker died or hung)"
    failure = Failure("LEASE_EXPIRED", message, retryable=True)
    return decide(lease.budget_attempt, lease.max_attempts, failure, policy, EndCause.LEASE_EXPIRED)


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one sweep found and did."""

    requeued: int
    failed: int
    stuck_outbox: int
    republished: int = 0
    #: Events committed over ``stuck_after`` seconds ago and not published.
    events_behind: int = 0
    #: Jobs ended past their deadline (ADR-0044).
    deadlines: int = 0


class Sweeper(Lifecycle):
    """Finds expired leases, stuck outbox rows and lost dispatches.

    A part of its own beside the relays: ``async with Sweeper(...)`` sweeps every
    ``interval`` seconds in the background until the block ends (or ``await
    start()``, then ``await stop()``); :meth:`sweep_once` is one pass.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        lease_grace: float = 5.0,
        stuck_after: float = 60.0,
        batch_size: int = 100,
        topology: Topology | None = None,
        retry_base_delay: float | None = None,
        republish_after: float = 600.0,
        republish_every: float | None = None,
        republish_scan: int = 10_000,
        interceptors: Sequence[RelayInterceptor] = (),
        interval: float = 5.0,
        schedules: bool = True,
        faults: FaultPoints = NO_FAULTS,
        deadline_poll: float = DEFAULT_POLL,
    ) -> None:
        """``republish_every`` defaults to a tenth of ``republish_after``, at least 30 s.

        An expired lease is retried with its queue's backoff in ``topology``
        (``retry_base_delay`` replaces the base), as a failed attempt is.
        ``interceptors`` see each sweep's report and name the traces of its
        lines (the process hands tracing's and metrics'; none: nothing).
        ``interval``: seconds between the background sweeps, once started.
        ``schedules``: tick recurring schedules while started (a
        :class:`~jobplane.workers.scheduler.Scheduler` of its own), whose
        named fault points are ``faults``'. ``deadline_poll``: the most seconds
        between two looks at the jobs' deadlines, once started.
        """
        self._intercept = chain_relay(interceptors)
        self._store = SweepStore(engine)
        self._lease_grace = lease_grace
        self._stuck_after = stuck_after
        self._batch_size = batch_size
        self._topology = topology or Topology()
        self._retry_base_delay = retry_base_delay
        self._republish_after = republish_after
        self._republish_every = (
            max(republish_after / 10, 30.0) if republish_every is None else republish_every
        )
        self._republish_scan = republish_scan
        self._next_republish = 0.0  # monotonic; the first sweep runs the pass
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self.deadlines = DeadlineLoop(engine, poll=deadline_poll, limit=batch_size)
        self.scheduler = (
            Scheduler(engine, topology=self._topology, faults=faults) if schedules else None
        )

    def _decide(self, lease: ExpiredLease) -> Decision:
        policy = RetryPolicy.of_queue(
            self._topology, lease.queue, base_override=self._retry_base_delay
        )
        return lease_expired(lease, policy)

    async def sweep_once(self) -> SweepReport:
        """One pass; repeats the lease repair while whole batches come back.

        The lost-dispatch pass runs only when its own schedule is due.
        """
        requeued = failed = 0
        while True:
            repair = await self._store.expire_leases(
                grace=self._lease_grace, limit=self._batch_size, decide=self._decide
            )
            requeued += repair.requeued
            failed += repair.failed
            if repair.requeued + repair.failed < self._batch_size:
                break
        deadlines = await self.deadlines.run_once()
        # Keys freed by those expiries, and any whose release was lost.
        released = await self._store.release_held(limit=self._batch_size)
        if released:
            log.info("sweeper.keys.released", jobs=released)
        # Jobs that run after others, left waiting by an end that did not settle them.
        settled = await self._store.settle_dependencies(limit=self._batch_size)
        if settled:
            log.warning("sweeper.dependencies.settled", jobs=settled)
        republished = 0
        if time.monotonic() >= self._next_republish:
            republished = await self._republish()
            self._next_republish = time.monotonic() + self._republish_every
        analyzed = await self._store.analyze_grown()
        if analyzed:
            log.info("sweeper.tables.analyzed", tables=analyzed)
        stuck = await self._store.stuck_outbox(older_than=self._stuck_after)
        lag = await self._store.events_behind(older_than=self._stuck_after)
        report = SweepReport(
            requeued=requeued,
            failed=failed,
            stuck_outbox=stuck,
            republished=republished,
            events_behind=lag.count,
            deadlines=deadlines,
        )
        if self._intercept is not None:
            self._intercept.repaired(report)
        if requeued or failed:
            log.warning("sweeper.leases.expired", requeued=requeued, failed=failed)
        if stuck:
            log.warning("sweeper.outbox.stuck", rows=stuck, older_than=self._stuck_after)
        if lag.count:
            log.warning(
                "sweeper.events.behind",
                events=lag.count,
                oldest_seconds=round(lag.oldest_seconds or 0.0, 1),
                older_than=self._stuck_after,
            )
        return report

    async def _republish(self) -> int:
        done = await self._store.republish_unclaimed(
            after=self._republish_after, scan=self._republish_scan
        )
        if done is None:
            log.debug("sweeper.republish.skipped", reason="another sweeper's pass is running")
            return 0
        intercept = self._intercept
        for dispatch in done.republished:
            # No span here: the line names the job's trace from its dispatch's context.
            trace_id = (
                intercept.trace_id({_TRACEPARENT: dispatch.traceparent})
                if intercept is not None and dispatch.traceparent
                else None
            )
            log.warning(
                "sweeper.dispatch.republished",
                job=job_name(dispatch.job_id),
                event_id=str(dispatch.dispatch_id),
                republish=dispatch.count,
                next_after=self._republish_after * 2**dispatch.count,
                **({} if trace_id is None else {"trace_id": trace_id}),
            )
        log.debug("sweeper.republish.pass", scanned=done.scanned, lap_done=done.lap_done)
        return len(done.republished)

    async def start(self) -> None:
        """Sweep every ``interval`` seconds in the background (the first sweep after one)."""
        self._task = asyncio.create_task(self._loop(self._interval), name="jobplane-sweeper")
        await self.deadlines.start()
        if self.scheduler is not None:
            await self.scheduler.start()

    async def stop(self) -> None:
        """Stop the background loop; never raises what ended it."""
        if self.scheduler is not None:
            await self.scheduler.stop()
        await self.deadlines.stop()
        task, self._task = self._task, None
        try:
            await cancel_and_wait(task)
        except Exception as exc:  # the loop catches everything; this is a last guard
            log.error("sweeper.failed", error=describe_error(exc), exc_info=exc)

    async def _loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep_once()
            except Exception as exc:
                # A sweeper that stops sweeping strands jobs silently: whatever
                # the failure, say it and sweep again next time.
                if database_transient(exc):
                    log.warning("sweeper.db.error", error=describe_error(exc))
                else:
                    log.error("sweeper.error", error=describe_error(exc), exc_info=exc)
