"""Consuming: each delivery decoded, claimed (fenced) and run, then acked or nacked.

A message is acked only after the outcome of its attempt is committed; the
claim decides what a redelivery does (run, wait, or ack a duplicate). A
message of a type this worker has no handler for is handed back, and one of
another deployment is bounced back to its queue. Whatever goes wrong while
a message is handled, it ends acked or nacked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import structlog
from aio_pika.abc import AbstractChannel
from sqlalchemy.exc import DBAPIError

from jobplane.batcher import Batcher
from jobplane.envelope import Envelope, EnvelopeError
from jobplane.logs import describe_error, fingerprint
from jobplane.names import job_name
from jobplane.store.attempts import ClaimRequest, ClaimResult, ClaimStatus, HandBack, Outcome
from jobplane.store.deployment import Deployment
from jobplane.store.down import database_transient
from jobplane.store.machine import Transition
from jobplane.workers.attempt import AttemptRunner
from jobplane.workers.bounce import Bounced, bounce_foreign
from jobplane.workers.consumers import Consumers
from jobplane.workers.group import Acks
from jobplane.workers.inbound import Delivery
from jobplane.workers.presence import Presence
from jobplane.workers.priority import Slots, SlotsClosed
from jobplane.workers.recording import Stopping
from jobplane.workers.running import StopCause

log = structlog.get_logger("jobplane.worker")


class Deliveries(AttemptRunner):
    """Handles the deliveries of the worker's consumers, each in a task of its own."""

    # Set up by the worker.
    _presence: Presence
    _slots: Slots
    _consumers: Consumers
    #: The deliveries being handled.
    _tasks: set[asyncio.Task[None]]
    _claims: Batcher[ClaimRequest, ClaimResult | None] | None
    _acks: Acks | None
    #: This deployment (None: not read yet); a message of another is bounced.
    _deployment: Deployment | None = None
    #: The confirming channel bounced messages go out on (None: not connected).
    _bounce_channel: AbstractChannel | None = None
    _handback_delay: float
    _handback_max_delay: float
    #: Messages of another deployment sent back to their queue.
    bounced: int = 0

    @property
    def id(self) -> str:
        """This worker's id in the ``workers`` table."""
        return str(self._presence.id)

    def _group_commit(
        self, window: float, max_size: int
    ) -> tuple[
        Batcher[ClaimRequest, ClaimResult | None] | None, Batcher[Outcome, bool] | None, Acks | None
    ]:
        """Group commit (ADR-0028): claims and outcomes of concurrent deliveries
        within ``window`` seconds go out as one statement each, and their acks
        together; a window of 0 or less writes each one alone (no groups).

        A claim that finds no claim group running goes out at once (ADR-0053):
        the window holds claims only while a group is in flight, so an idle
        worker starts a lone job without waiting it out."""
        if window <= 0:
            return None, None, None
        on_group = None if self._intercept is None else self._intercept.grouped
        claims = Batcher(
            self._store.claim_many,
            window=window,
            max_size=max_size,
            # Nothing of a failed claim group commits: each claims alone.
            split=_not_transient,
            eager=True,
            on_group=_ungrouped if on_group is None else lambda size: on_group("claim", size),
        )
        outcomes = Batcher(
            self._finish_group,
            window=window,
            max_size=max_size,
            split=_refused_for_its_values,
            on_group=_ungrouped if on_group is None else lambda n: on_group("outcome", n),
        )
        return claims, outcomes, Acks()

    def _on_message(self, message: Delivery) -> None:
        # Our own task, not aiormq's: a channel that closes must not cancel a
        # handler mid-run (its outcome is still committed; only the ack is lost).
        if self._acks is not None:
            self._acks.delivered(message)
        task = asyncio.create_task(self._handle_settled(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle_settled(self, message: Delivery) -> None:
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

    async def _handle_and_nack(self, message: Delivery) -> None:
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

    def _settled(self, message: Delivery) -> bool:
        """Whether ``message`` was settled (by itself, or by a group's multiple ack)."""
        return message.processed

    async def _ack(self, message: Delivery) -> None:
        """Ack after the commit: with the others of this moment when grouping."""
        if self._acks is None:
            await _settle(message.ack())
        else:
            await self._acks.ack(message)

    def _on_cancel_notification(self, payload: str) -> None:
        running = self._running.get(payload)
        if running is not None:
            running.stop(StopCause.CANCEL_REQUESTED)

    async def _handle(self, message: Delivery) -> None:
        try:
            envelope = Envelope.decode(message.body)
        except EnvelopeError as exc:
            log.error("job.message.rejected", reason=str(exc), message_id=message.message_id)
            await _settle(message.reject(requeue=False))
            return
        bound = log.bind(
            job=job_name(envelope.job_id),
            event_id=str(envelope.event_id),
            tenant_id=str(envelope.tenant_id),
            correlation_id=fingerprint(envelope.correlation_id),
            queue=message.queue,
            exchange=message.exchange,
            routing_key=message.routing_key,
            delivery_tag=message.delivery_tag,
            redelivered=message.redelivered,
        )
        if message.redelivered:
            bound.info("broker.message.redelivered")
        if self._registry.get(envelope.job_type) is None:
            await self._hand_back_job(envelope, message, bound)
            return
        # A slot before the claim: a job is claimed only when it can start.
        try:
            async with self._slots.turn(message.priority):
                await self._claim_and_run(envelope, message, bound)
        except SlotsClosed:
            await _settle(message.nack(requeue=True))

    async def _claim_and_run(self, envelope: Envelope, message: Delivery, bound: Any) -> None:
        try:
            redelivered = message.redelivered
            intercept = self._intercept
            if intercept is None:
                claim = await self._claim(envelope, redelivered=redelivered)
            else:
                claim = await intercept.claim(
                    envelope, message, lambda: self._claim(envelope, redelivered=redelivered)
                )
        except Stopping:
            await _settle(message.nack(requeue=True))
            return
        if claim.status is ClaimStatus.CLAIMED and claim.attempt is not None:
            bound = bound.bind(request_id=fingerprint(claim.attempt.request_id))
            bound.info("job.received", attempt=claim.attempt.attempt, type=envelope.job_type)
            try:
                await self._run(claim.attempt, bound)
            except Stopping:
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

    async def _unknown_job(self, message: Delivery, envelope: Envelope, bound: Any) -> None:
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

    async def _bounce(self, message: Delivery, envelope: Envelope, bound: Any) -> None:
        """A message of another deployment (no such job here): back to its queue
        (ADR-0006), or to the dead-letter queue after too many bounces."""
        assert self._bounce_channel is not None
        try:
            done, bounces = await bounce_foreign(
                self._bounce_channel,
                message,
                message.queue or None,
                this_deployment=self._deployment_id,
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
                raise Stopping
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

    async def _hand_back_job(self, envelope: Envelope, message: Delivery, bound: Any) -> None:
        """Give the job back unclaimed: this worker has no handler for its type."""
        try:
            status, reason = await self._with_db_retry(
                lambda: self._store.hand_back(
                    envelope, base_delay=self._handback_delay, max_delay=self._handback_max_delay
                )
            )
        except Stopping:
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


def _ungrouped(_size: int) -> None:
    """A group went out, and nothing observes the worker."""


def _not_transient(exc: BaseException) -> bool:
    """A claim group failed for anything but a passing database error (a value, a
    row it could not read): run each alone, so that one claim cannot fail the rest."""
    return not (isinstance(exc, DBAPIError) and database_transient(exc))


def _refused_for_its_values(exc: BaseException) -> bool:
    """A group's statement failed for what one of its rows holds: run each alone."""
    return isinstance(exc, DBAPIError) and not database_transient(exc)


async def _settle(settle: Awaitable[Any]) -> None:
    """Ack, nack or reject; a closed channel means the broker redelivers anyway."""
    try:
        await settle
    except Exception as exc:
        log.warning("job.message.settle_failed", error=str(exc))
