"""Recording how an attempt ended: its outcome committed, fenced, then logged.

A success, a retry or a failure as the queue's retry policy decides, a cancel:
each is committed with the attempt's pending progress, in an outcome group
when grouping is on (ADR-0028), and only then logged and told to the
interceptors. An outcome the database refuses ends the attempt in our words.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
from sqlalchemy.exc import DBAPIError

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
from jobplane.config import MAX_OFFLOADED_JSON_BYTES
from jobplane.errors import BlobStoreUnavailable, PayloadTooLarge
from jobplane.fanout import FAN_OUT_REFUSED, FanOutRefused, fan_out_items, next_stage
from jobplane.faults import FaultPoints
from jobplane.logs import describe_error
from jobplane.store.attempts import Attempt, AttemptStore, LeaseLost, Outcome, ProgressUpdate
from jobplane.store.down import database_error_name, database_transient
from jobplane.store.machine import Emitted
from jobplane.store.rows import check_payload_size, dumps
from jobplane.topology import Topology
from jobplane.types import BlobRef
from jobplane.workers.interceptors import Interceptor
from jobplane.workers.outcome import Failure, check_result, describe, raised
from jobplane.workers.running import Ended, Running, StopCause

if TYPE_CHECKING:
    from jobplane.blobs.store import BlobStore

log = structlog.get_logger("jobplane.worker")

T = TypeVar("T")


class Stopping(Exception):
    """The worker is stopping; give the message back."""


@dataclass(frozen=True, slots=True)
class _Ending:
    """An attempt whose end is being recorded: what its writes and log lines name."""

    attempt: Attempt
    running: Running
    #: Progress reported and not yet written: committed with the outcome.
    pending: list[ProgressUpdate]
    #: The log bound to the job's delivery.
    bound: Any


class OutcomeRecording:
    """Commits each attempt's outcome, retrying while the database is down."""

    # Set up by the worker.
    _store: AttemptStore
    _topology: Topology
    _retry_base_delay: float | None
    #: The object store handlers reach through ctx (None: blobs disabled).
    _blobs: BlobStore | None
    _inline_bytes: int
    _max_result_bytes: int
    _intercept: Interceptor | None
    _outcomes: Batcher[Outcome, bool] | None
    _faults: FaultPoints
    #: Set once the worker stops: a database wait gives the message back instead.
    _stopping: bool = False

    async def _with_db_retry(self, op: Callable[[], Awaitable[T]]) -> T:
        delay = 0.2
        while True:
            try:
                return await op()
            except Exception as exc:
                if not database_transient(exc):
                    raise
                if self._stopping:
                    raise Stopping from exc
                log.warning("worker.db.retry", error=describe_error(exc), delay=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

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

    async def _record(
        self,
        attempt: Attempt,
        running: Running,
        ended: Ended,
        pending: list[ProgressUpdate],
        bound: Any,
        emitted: Sequence[Emitted] = (),
    ) -> None:
        # The handler's emitted events go only with a success; any other
        # outcome drops them.
        if running.cause is StopCause.LEASE_LOST:
            bound.warning("job.lease_lost", attempt=attempt.attempt)
            return
        end = _Ending(attempt, running, pending, bound)
        if running.cause is StopCause.CANCEL_REQUESTED and not ended.returned:
            await self._commit(end, self._store.was_cancelled(attempt))
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
            refused = await self._record_result(end, ended.result, emitted)
            if refused is None:
                return
            failure = refused
        else:
            failure = describe(ended.error or RuntimeError("the handler ended without a result"))
        await self._record_failure(end, failure, cause, ended.error)

    async def _record_result(
        self, end: _Ending, returned: Any, emitted: Sequence[Emitted]
    ) -> Failure | None:
        """Commit the success of an attempt whose handler returned ``returned``, or
        say why it cannot be stored (None: it succeeded)."""
        attempt = end.attempt
        if attempt.stage is not None and attempt.stage.fans_out:
            return await self._record_items(end, returned, emitted)
        # With an object store, a plain job's result may be larger than
        # the inline limit: it goes to a blob, the row keeps its name.
        offload = self._blobs is not None and attempt.stage is None
        limit = max(self._max_result_bytes, MAX_OFFLOADED_JSON_BYTES) if offload else None
        checked = check_result(returned, max_bytes=limit or self._max_result_bytes)
        if not isinstance(checked, dict):
            failure = describe(checked)
            return Failure(failure.code, failure.message, retryable=False)
        stored = await self._offload_result(attempt, checked) if offload else checked
        if isinstance(stored, Failure):
            return stored
        result, ref = stored if isinstance(stored, tuple) else (stored, None)
        await self._commit(
            end, self._store.succeeded(attempt, result, emitted=emitted, result_blob=ref)
        )
        end.bound.info("job.completed", attempt=attempt.attempt, offloaded=ref is not None)
        self._ended(attempt, end.running, completed(attempt.stage))
        return None

    async def _record_items(
        self, end: _Ending, returned: Any, emitted: Sequence[Emitted]
    ) -> Failure | None:
        """Commit the success of a stage before a fan-out stage: its move to the
        fan-out stage with one child per item, in one transaction; or say why
        ``returned`` cannot be spawned (ADR-0047)."""
        attempt = end.attempt
        try:
            items = fan_out_items(returned)
            for item in items:
                check_payload_size(item, self._max_result_bytes)
        except (FanOutRefused, PayloadTooLarge, TypeError, ValueError) as exc:
            return Failure(FAN_OUT_REFUSED, str(exc), retryable=False)
        if await self._commit(end, self._store.fanned_out(attempt, items, emitted=emitted)):
            self._spawned(attempt, len(items))
        end.bound.info("job.fanned_out", attempt=attempt.attempt, children=len(items))
        self._ended(attempt, end.running, completed(attempt.stage))
        return None

    async def _record_failure(
        self, end: _Ending, failure: Failure, cause: EndCause, error: BaseException | None
    ) -> None:
        """Commit the retry or the failure the queue's policy decides for ``failure``
        (``error``: what the handler raised, if it did)."""
        attempt, store, bound = end.attempt, self._store, end.bound
        decision = decide(
            attempt.budget_attempt, attempt.max_attempts, failure, self._policy(attempt), cause
        )
        # The traceback goes to the log once, with the event that ends the attempt.
        exc_info = raised(error)
        if isinstance(decision, Retry):
            outcome = store.retried(
                attempt,
                decision.code,
                decision.message,
                delay=decision.delay,
                refund=decision.refund,
                details=decision.details,
            )
            event, ended_as, fields = "job.retry_scheduled", RETRY, {"delay": decision.delay}
        else:
            outcome = store.failed(
                attempt, decision.code, decision.message, retryable=False, details=decision.details
            )
            event, ended_as, fields = "job.failed", FAILED, {}
        await self._commit(end, outcome)
        bound.warning(
            event,
            attempt=attempt.attempt,
            **fields,
            code=decision.code,
            error=decision.message,
            exc_info=exc_info,
        )
        self._ended(attempt, end.running, ended_as)

    async def _commit(self, end: _Ending, outcome: Outcome) -> bool:
        """Commit ``outcome`` with the attempt's pending progress (False: it was not
        written: fenced out, or refused and the attempt failed instead)."""
        return await self._outcome(
            end.attempt, end.bound, lambda: self._write(outcome, end.pending)
        )

    def _spawned(self, attempt: Attempt, children: int) -> None:
        """Tell the interceptor of a fan-out's ``children``: jobs of the fan-out stage."""
        spec = next_stage(self._topology, attempt.stage)
        if self._intercept is not None and spec is not None:
            self._intercept.submitted(spec.type, spec.queue, children)

    def _ended(self, attempt: Attempt, running: Running, outcome: str) -> None:
        intercept = self._intercept
        if intercept is not None:
            intercept.ended(attempt, outcome, time.monotonic() - running.started)

    def _policy(self, attempt: Attempt) -> RetryPolicy:
        # The same policy as WorkerService's (jobplane.server.worker_protocol).
        return RetryPolicy.of_queue(
            self._topology, attempt.queue, base_override=self._retry_base_delay
        )

    async def _outcome(
        self, attempt: Attempt, bound: Any, write: Callable[[], Awaitable[None]]
    ) -> bool:
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
        else:
            return True
        return False

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
