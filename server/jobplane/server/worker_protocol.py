"""The worker protocol's rules: claims and fenced reports of workers in any language.

A worker outside this package consumes the dispatch messages itself and
reports through WorkerService (docs/workers.md). Every call here is one of
:class:`~jobplane.store.attempts.AttemptStore`'s, the very transitions the
Python worker makes, with the same decision of how a failed attempt ends
(:func:`jobplane.attempt_end.decide`): the two kinds of worker cannot
disagree about what a claim or an outcome does. Nothing here knows gRPC.

A worker may also register (the types it runs, the queues it reads) so that
workers without its handlers hand its jobs back for it rather than park them
(ADR-0007), and hand back the jobs it has no handler for itself.

A worker holds only its attempt's fence (job, attempt, lease token). The
attempts this process claimed, or read back once, are kept by fence: a fence
names one attempt for ever, and whether it still holds is decided by each
write's own statement, never by what is kept here.

What a worker sends (an envelope, a fence, reports, a registration) is
checked in :mod:`jobplane.server.worker_requests` before any call here runs.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from jobplane import __version__
from jobplane.attempt_end import (
    CANCELLED,
    FAILED,
    RETRY,
    Decision,
    Retry,
    RetryPolicy,
    completed,
    decide,
)
from jobplane.blobs.payloads import payload_from_blob
from jobplane.config import DEFAULT_INLINE_BYTES
from jobplane.envelope import Envelope
from jobplane.errors import (
    AttemptLeaseLost,
    BlobNotFound,
    BlobsDisabled,
    BlobStoreUnavailable,
    CancelNotRequested,
    FailedPrecondition,
    InvalidArgument,
    PayloadTooLarge,
    WorkerNotFound,
    shown,
)
from jobplane.fanout import FanOutRefused, fan_out_items, next_stage
from jobplane.ids import new_id
from jobplane.logs import fingerprint
from jobplane.names import job_name
from jobplane.observe.metrics import NO_METRICS, Metrics
from jobplane.scheduling import DEFAULT_MAX_SCHEDULE_SECONDS
from jobplane.server.worker_requests import (
    MAX_CONCURRENCY,
    MAX_QUEUES,
    MAX_REPORTS,
    MAX_TYPES,
    MAX_WORKER_LABEL,
    REGISTRATION_TTL,
    RENEW_INTERVAL,
    Claimed,
    Failed,
    Fence,
    Registration,
    check_envelope,
    check_registration,
    check_reports,
    check_text,
    lost_message,
    parse_worker_name,
    worker_name,
)
from jobplane.store.attempts import (
    Attempt,
    AttemptStore,
    ClaimResult,
    ClaimStatus,
    HandBack,
    LeaseLost,
    ProgressUpdate,
)
from jobplane.store.children import ChildStore
from jobplane.store.held import HeldAttempts
from jobplane.store.rows import check_payload_size, dumps
from jobplane.store.workers import WorkerStore
from jobplane.topology import Topology
from jobplane.types import BlobRef, JobState
from jobplane.workers.children import ChildRequest, child_job, fence_of
from jobplane.workers.outcome import MAX_ERROR_MESSAGE, MAX_RETRY_DELAY, Failure, check_result

if TYPE_CHECKING:
    from jobplane.blobs.store import BlobStore

# Named here by the servicer and the tests, wherever defined.
__all__ = [
    "DEFAULT_ERROR_CODE",
    "ERROR_CODE",
    "HANDBACK_DELAY",
    "HANDBACK_MAX_DELAY",
    "MAX_CONCURRENCY",
    "MAX_QUEUES",
    "MAX_REPORTS",
    "MAX_TYPES",
    "MAX_WORKER_LABEL",
    "REGISTRATION_TTL",
    "RENEW_INTERVAL",
    "Claimed",
    "Failed",
    "Fence",
    "Registration",
    "WorkerService",
    "log",
    "parse_worker_name",
    "worker_name",
]

log = structlog.get_logger("jobplane.server")

T = TypeVar("T")

#: An error code: UPPER_SNAKE, as the Python worker's (jobplane.workers.outcome).
ERROR_CODE = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
DEFAULT_ERROR_CODE = "HANDLER_ERROR"
# Attempts kept by fence; past it the oldest are read back when next used.
_KEPT_ATTEMPTS = 10_000
# A hand-back's new dispatch is due after 0.5 s · 2^handbacks, at most 10 s,
# as the Python worker's (jobplane.workers.runtime.Worker's defaults).
HANDBACK_DELAY = 0.5
HANDBACK_MAX_DELAY = 10.0


def _no_limit(_tenant: uuid.UUID) -> None:
    """No submit limit: a service the server has not given its limiter."""


class WorkerService:
    """Every WorkerService call, for any tenant's jobs (worker keys serve a deployment)."""

    def __init__(
        self,
        store: AttemptStore,
        held: HeldAttempts,
        topology: Topology,
        *,
        workers: WorkerStore,
        max_result_bytes: int = 256 * 1024,
        blobs: BlobStore | None = None,
        inline_bytes: int | None = None,
        children: ChildStore | None = None,
        max_schedule_seconds: float = DEFAULT_MAX_SCHEDULE_SECONDS,
    ) -> None:
        self._store = store
        # SubmitChildJob: None refuses it (a service built without a database pool).
        self._children = children
        self._max_schedule_seconds = max_schedule_seconds
        #: Spends one of a tenant's submits (the server's limiter); nothing by default.
        self.take_submit: Callable[[uuid.UUID], None] = _no_limit
        # Payloads by reference are handed out inline (up to the payload
        # limit); results over the inline limit go to a blob, as the Python
        # worker's do.
        self._blobs = blobs
        self._inline_bytes = min(
            DEFAULT_INLINE_BYTES if inline_bytes is None else inline_bytes, max_result_bytes
        )
        self._held = held
        self._workers = workers
        self._topology = topology
        self._max_result_bytes = max_result_bytes
        self._kept: OrderedDict[Fence, Attempt] = OrderedDict()
        #: This deployment's id (jobplane.store.deployment), once the server knows it.
        self.deployment: str | None = None
        #: Where attempts are counted (the server's; nothing by default).
        self.metrics: Metrics = NO_METRICS

    @property
    def lease_seconds(self) -> float:
        """How long a claim or heartbeat makes the lease."""
        return self._store.lease_seconds

    # -- requests -----------------------------------------------------------
    # -- requests -----------------------------------------------------------

    @staticmethod
    def envelope(
        body: bytes, *, event_id: str, job_id: str, tenant_id: str, job_type: str
    ) -> Envelope:
        """The envelope a claim names: the message body, or its four fields."""
        return check_envelope(
            body, event_id=event_id, job_id=job_id, tenant_id=tenant_id, job_type=job_type
        )

    @staticmethod
    def reports(
        reports: Sequence[tuple[float, str, dict[str, Any]]],
        *,
        field: str = "reports",
        required: bool = False,
    ) -> list[ProgressUpdate]:
        """Checked progress reports; INVALID_ARGUMENT naming the first bad one's field."""
        return check_reports(reports, field=field, required=required)

    def registration(self, registration: Registration) -> Registration:
        """``registration`` checked; INVALID_ARGUMENT naming the first bad field."""
        return check_registration(self._topology, registration)

    # -- calls ----------------------------------------------------------------

    async def claim(self, envelope: Envelope) -> Claimed:
        """Start the attempt the message dispatches, or say what to do with the message."""
        result = await self._store.claim(envelope)
        if result.status is ClaimStatus.HELD:
            # Held by a flow limit or its concurrency key: the job waits QUEUED.
            self.metrics.throttled(result.limit, envelope.job_type)
        if result.attempt is not None and result.attempt.payload_blob is not None:
            result = await self._with_payload(result.attempt)
        if result.attempt is not None:
            self._keep(result.attempt)
            attempt = result.attempt
            structlog.contextvars.bind_contextvars(
                job=job_name(envelope.job_id),
                tenant_id=str(envelope.tenant_id),
                correlation_id=fingerprint(envelope.correlation_id),
                request_id=fingerprint(attempt.request_id),
                queue=attempt.queue,
                routing_key=envelope.job_type,
            )
            log.info("job.received", attempt=attempt.attempt, type=envelope.job_type)
            # The remote worker runs the handler once it has the claim.
            log.info("job.started", attempt=attempt.attempt, type=envelope.job_type)
            self.metrics.attempt_started(
                attempt.type, attempt.queue, attempt.attempt, attempt.create_time
            )
        lease = self._store.lease_seconds
        other = result.status is ClaimStatus.NOT_FOUND and self._other(envelope)
        # Lease times are the database's clock: a redelivery polls at a fraction of the lease.
        return Claimed(result, lease, min(lease / 3, 5.0), other_deployment=other)

    async def _with_payload(self, attempt: Attempt) -> ClaimResult:
        """The claim with the payload read from its blob; or, when it cannot be handed
        out, the attempt ended here (failed, or retried on an outage) and the message
        to be acked."""
        ref = attempt.payload_blob
        assert ref is not None
        code, message, retryable = "", "", False
        if self._blobs is None:
            code, message = BlobsDisabled.reason, "this server has no object store"
        elif ref.size > self._max_result_bytes:
            code = PayloadTooLarge.reason
            message = (
                f"the payload went by reference ({ref.size} bytes); WorkerService hands out "
                f"payloads of at most {self._max_result_bytes} bytes"
            )
        else:
            try:
                data = await self._blobs.read_bytes(attempt.tenant_id, ref.name)
                payload = payload_from_blob(data, ref.name)
                return ClaimResult(
                    ClaimStatus.CLAIMED, attempt=dataclasses.replace(attempt, payload=payload)
                )
            except BlobStoreUnavailable as exc:
                code, message, retryable = exc.reason, exc.message, True
            except BlobNotFound as exc:
                code, message = exc.reason, exc.message
            except ValueError as exc:
                code, message = "PAYLOAD_INVALID", str(exc)
        log.warning("worker_service.payload_unavailable", job=job_name(attempt.job_id), code=code)
        decision = self._decide(attempt, Failure(code, message, retryable))
        if isinstance(decision, Retry):
            await self._store.schedule_retry(
                attempt, decision.code, decision.message, delay=decision.delay
            )
            return ClaimResult(ClaimStatus.STALE)
        await self._store.fail(
            attempt, decision.code, decision.message, retryable=False, details=decision.details
        )
        return ClaimResult(ClaimStatus.FINISHED, state=JobState.FAILED)

    def _decide(self, attempt: Attempt, failure: Failure) -> Decision:
        """How ``attempt`` ends with ``failure``: the Python worker's decision
        (jobplane.attempt_end), with the queue's backoff."""
        policy = RetryPolicy.of_queue(self._topology, attempt.queue)
        return decide(attempt.budget_attempt, attempt.max_attempts, failure, policy)

    async def heartbeat(self, fence: Fence) -> bool:
        """Extend the lease; whether cancellation was requested."""
        attempt = await self._attempt(fence)
        return await self._fenced(fence, self._store.heartbeat(attempt))

    async def progress(self, fence: Fence, updates: Sequence[ProgressUpdate]) -> bool:
        """Store the reports in order; whether cancellation was requested."""
        attempt = await self._attempt(fence)
        return await self._fenced(fence, self._store.write_progress(attempt, updates))

    async def complete(
        self,
        fence: Fence,
        result: dict[str, Any],
        pending: Sequence[ProgressUpdate],
        *,
        items: Sequence[dict[str, Any]] = (),
        has_result: bool = False,
    ) -> None:
        """SUCCEEDED with ``result``, after the pending reports; a stage before a
        fan-out stage with ``items`` instead, one child job each (ADR-0047)."""
        checked = check_result(result, max_bytes=self._max_result_bytes)
        if not isinstance(checked, dict):
            raise InvalidArgument(str(checked), field="result", metadata={"code": checked.code})
        attempt = await self._attempt(fence)
        if attempt.stage is not None and attempt.stage.fans_out:
            await self._fan_out(fence, attempt, items, pending, has_result=has_result)
            return
        if items:
            raise InvalidArgument(
                "items are for a stage before a fan-out stage (ClaimJobResponse.fans_out)",
                field="items",
            )
        stored, ref = checked, None
        if self._blobs is not None and attempt.stage is None:
            body = dumps(checked).encode()
            if len(body) > self._inline_bytes:
                info = await self._blobs.put_bytes(
                    attempt.tenant_id, body, content_type="application/json"
                )
                stored, ref = {}, BlobRef(info.name, info.digest, info.size)
        await self._fenced(fence, self._store.succeed(attempt, stored, pending, result_blob=ref))
        self._forget(fence)
        self._bind(attempt).info("job.completed", attempt=fence.attempt)
        self.metrics.attempt_ended(attempt.type, attempt.queue, completed(attempt.stage))

    async def _fan_out(
        self,
        fence: Fence,
        attempt: Attempt,
        items: Sequence[dict[str, Any]],
        pending: Sequence[ProgressUpdate],
        *,
        has_result: bool,
    ) -> None:
        """The success of a stage before a fan-out stage: its children, checked as
        the Python worker checks them (:func:`jobplane.fanout.fan_out_items`)."""
        if has_result:
            raise InvalidArgument(
                "a stage before a fan-out stage completes with items, not a result",
                field="result",
            )
        try:
            spawned = fan_out_items(list(items))
            for item in spawned:
                check_payload_size(item, self._max_result_bytes)
        except FanOutRefused as exc:
            raise InvalidArgument(str(exc), field="items") from None
        except PayloadTooLarge as exc:
            raise InvalidArgument(str(exc), field="items") from None
        outcome = self._store.fanned_out(attempt, spawned)
        await self._fenced(fence, self._store.finish(outcome, pending))
        self._forget(fence)
        self._bind(attempt).info("job.fanned_out", attempt=fence.attempt, children=len(spawned))
        if (spec := next_stage(self._topology, attempt.stage)) is not None:
            self.metrics.submitted(spec.type, spec.queue, len(spawned))
        self.metrics.attempt_ended(attempt.type, attempt.queue, completed(attempt.stage))

    async def fail(
        self,
        fence: Fence,
        code: str,
        message: str,
        *,
        retryable: bool,
        delay: float | None,
        pending: Sequence[ProgressUpdate],
    ) -> Failed:
        """A retry when ``retryable`` and attempts are left, else FAILED: the Python
        worker's decision (jobplane.attempt_end), with the queue's backoff."""
        code = code or DEFAULT_ERROR_CODE
        if not ERROR_CODE.fullmatch(code):
            raise InvalidArgument(
                f"code {shown(code)} must be UPPER_SNAKE: A-Z first, then A-Z, 0-9, '_'; "
                "at most 64 characters",
                field="code",
            )
        check_text(message, MAX_ERROR_MESSAGE, "message")
        if delay is not None:
            if not retryable:
                raise InvalidArgument(
                    "retry_delay is for a retryable failure only", field="retry_delay"
                )
            if not 0 <= delay <= MAX_RETRY_DELAY:
                raise InvalidArgument(
                    f"retry_delay must be 0 .. {MAX_RETRY_DELAY:g} seconds", field="retry_delay"
                )
        attempt = await self._attempt(fence)
        bound = self._bind(attempt).bind(attempt=fence.attempt, code=code)
        decision = self._decide(attempt, Failure(code, message, retryable, delay=delay))
        if isinstance(decision, Retry):
            wait = decision.delay
            await self._fenced(
                fence,
                self._store.schedule_retry(
                    attempt, decision.code, decision.message, delay=wait, pending=pending
                ),
            )
            self._forget(fence)
            bound.warning("job.retry_scheduled", delay=wait, error=message)
            self.metrics.attempt_ended(attempt.type, attempt.queue, RETRY)
            return Failed(True, wait)
        await self._fenced(
            fence,
            self._store.fail(
                attempt,
                decision.code,
                decision.message,
                retryable=False,
                pending=pending,
                details=decision.details,
            ),
        )
        self._forget(fence)
        bound.warning("job.failed", error=message)
        self.metrics.attempt_ended(attempt.type, attempt.queue, FAILED)
        return Failed(False)

    async def cancelled(self, fence: Fence, pending: Sequence[ProgressUpdate]) -> None:
        """CANCELLED, once cancellation was requested (the flag stays set for the attempt)."""
        attempt = await self._attempt(fence)
        if not await self._fenced(fence, self._store.heartbeat(attempt)):
            raise CancelNotRequested()
        await self._fenced(fence, self._store.cancelled(attempt, pending))
        self._forget(fence)
        self._bind(attempt).info("job.cancelled", attempt=fence.attempt)
        self.metrics.attempt_ended(attempt.type, attempt.queue, CANCELLED)

    def _bind(self, attempt: Attempt) -> Any:
        """The log with the attempt's durable ids bound."""
        return log.bind(
            job=job_name(attempt.job_id),
            tenant_id=str(attempt.tenant_id),
            correlation_id=fingerprint(attempt.correlation_id),
            request_id=fingerprint(attempt.request_id),
            queue=attempt.queue,
        )

    async def submit_child(self, fence: Fence, request: ChildRequest) -> tuple[str, bool]:
        """The child of the attempt's job with ``request.key``: its name, and whether
        this call created it (docs/workflows.md)."""
        if self._children is None:
            raise FailedPrecondition("this server does not take child jobs")
        attempt = await self._attempt(fence)
        new = child_job(
            self._topology,
            request,
            parent_correlation_id=attempt.correlation_id,
            max_payload_bytes=self._max_result_bytes,
            horizon_seconds=self._max_schedule_seconds,
        )
        self.take_submit(attempt.tenant_id)
        job, created = await self._fenced(
            fence, self._children.submit(fence_of(attempt), request.key, new)
        )
        if created:
            self.metrics.submitted(new.type, new.queue)
        return job.name, created

    async def register(self, registration: Registration) -> uuid.UUID:
        """Record a live worker (see :meth:`registration`); re-dispatch what it can run."""
        worker_id = new_id()
        await self._workers.register(
            worker_id,
            host=registration.host,
            pid=registration.pid,
            types=registration.types,
            queues=registration.queues,
            concurrency=registration.concurrency,
            version=registration.version or f"workerservice/{__version__}",
            ttl=REGISTRATION_TTL,
        )
        log.info(
            "worker_service.registered",
            worker=worker_name(worker_id),
            types=registration.types,
            queues=registration.queues,
        )
        self.metrics.know_types(registration.types)
        await self._unpark(registration.types, registration.queues)
        return worker_id

    async def renew(self, worker_id: uuid.UUID) -> None:
        """Live for another :data:`REGISTRATION_TTL`; re-dispatch what it can run."""
        found = await self._workers.renew(worker_id, ttl=REGISTRATION_TTL)
        if found is None:
            raise WorkerNotFound(f"{worker_name(worker_id)} is not registered, or stopped")
        # A job parked by a worker that had not seen this one yet waits for this.
        await self._unpark(*found)

    async def stop_worker(self, worker_id: uuid.UUID) -> None:
        """The worker takes no more work; stopping twice changes nothing."""
        await self._workers.stop(worker_id)

    async def hand_back(self, envelope: Envelope) -> tuple[HandBack, str, bool]:
        """Give the job back unclaimed: what became of it, its waiting reason, and
        whether the message is another deployment's."""
        status, reason = await self._store.hand_back(
            envelope, base_delay=HANDBACK_DELAY, max_delay=HANDBACK_MAX_DELAY
        )
        return status, reason, status is HandBack.NOT_FOUND and self._other(envelope)

    async def _unpark(self, types: Sequence[str], queues: Sequence[str]) -> None:
        while True:
            count = await self._store.unpark(types, queues)
            if count:
                log.info("worker_service.jobs.unparked", jobs=count)
            if count < 500:
                return

    def _other(self, envelope: Envelope) -> bool:
        # Decided after the lookup, as the Python worker does: a deployment
        # whose identity changed still runs its own jobs.
        return (
            envelope.deployment is not None
            and self.deployment is not None
            and envelope.deployment != self.deployment
        )

    # -- attempts by fence -------------------------------------------------------

    async def _attempt(self, fence: Fence) -> Attempt:
        kept = self._kept.get(fence)
        if kept is not None:
            self._kept.move_to_end(fence)
            return kept
        attempt = await self._held.get(fence.job_id, fence.attempt, fence.lease_token)
        if attempt is None:
            raise AttemptLeaseLost(lost_message(fence))
        self._keep(attempt)
        return attempt

    async def _fenced(self, fence: Fence, write: Awaitable[T]) -> T:
        try:
            return await write
        except LeaseLost:
            self._forget(fence)
            raise AttemptLeaseLost(lost_message(fence)) from None

    def _keep(self, attempt: Attempt) -> None:
        fence = Fence(attempt.job_id, attempt.attempt, attempt.lease_token)
        self._kept[fence] = attempt
        self._kept.move_to_end(fence)
        if len(self._kept) > _KEPT_ATTEMPTS:
            self._kept.popitem(last=False)

    def _forget(self, fence: Fence) -> None:
        self._kept.pop(fence, None)
