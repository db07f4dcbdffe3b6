"""Recording what the broker did with each outbox row the relay published.

In the claim's transaction: published, due again after a backoff, waiting for
a route, or failed (with its job). When the database refuses the batch's
record, each row is recorded on its own, so one row's fate never holds up
the others; a row it refuses even that is held back and reported (see
:mod:`jobplane.workers.relay`).
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from dataclasses import dataclass, field

import structlog
from sqlalchemy.exc import DBAPIError

from jobplane.logs import describe_error, fingerprint
from jobplane.names import job_name
from jobplane.store.down import database_transient
from jobplane.store.outbox import GiveUp, OutboxBatch, OutboxKind, OutboxRow, OutboxStore
from jobplane.topology import Topology
from jobplane.types import WaitingCode
from jobplane.workers.interceptors import RelayInterceptor

log = structlog.get_logger("jobplane.relay")

DISPATCH_FAILED = "DISPATCH_FAILED"
JOB_TYPE_UNROUTABLE = "JOB_TYPE_UNROUTABLE"
# How long a row the database refuses to change is left out of this relay's
# claims before it is tried again (an operator may have fixed the cause).
_HOLD_SECONDS = 300.0
# SQLSTATE classes of a refusal about the values of a row, not the statement:
# data exceptions (22), integrity constraints (23), a trigger's RAISE (P0),
# WITH CHECK OPTION (44). Anything else non-transient (an undefined column, a
# missing privilege, a bug) refuses the statement for every row alike: failing
# rows over it would fail every job in the system, so it is left to an
# operator instead, loudly.
_ROW_REFUSALS = frozenset({"22", "23", "P0", "44"})


class Fate(enum.Enum):
    """What the broker did with one row's publish."""

    CONFIRMED = "confirmed"
    FAILED = "failed"  # nack, timeout, lost connection: transient
    RETURNED = "returned"
    UNPUBLISHABLE = "unpublishable"


@dataclass(frozen=True, slots=True)
class RowOutcome:
    row: OutboxRow
    fate: Fate
    error: BaseException | None = None


@dataclass(slots=True)
class Recorded:
    """What recording a batch did, reported once it committed."""

    published: int = 0
    failed: list[tuple[OutboxRow, str, str, bool]] = field(default_factory=list)
    confirmed: list[OutboxRow] = field(default_factory=list)
    #: Dispatches whose job says now that it waits for a route.
    unroutable: list[OutboxRow] = field(default_factory=list)

    def add(self, other: Recorded) -> None:
        self.published += other.published
        self.failed += other.failed
        self.confirmed += other.confirmed
        self.unroutable += other.unroutable


class OutboxRecording:
    """The relay's record of its publishes: what each row's fate writes, and what it logs."""

    # Set up by the relay.
    _store: OutboxStore
    _topology: Topology
    _intercept: RelayInterceptor | None
    #: Row id -> monotonic time it is tried again.
    _held: dict[uuid.UUID, float]
    _unroutable_after: float
    _unroutable_returns: int
    published: int
    failed: int

    def _count(self, outcomes: list[RowOutcome]) -> None:
        intercept = self._intercept
        if intercept is None:
            return
        for outcome in outcomes:
            intercept.relayed(outcome.row.kind.value, outcome.fate.value, 1)

    async def _record(self, batch: OutboxBatch, outcomes: list[RowOutcome]) -> Recorded:
        """Write what the broker did with each row, in ``batch``'s transaction."""
        by_fate: dict[Fate, list[RowOutcome]] = {fate: [] for fate in Fate}
        for outcome in outcomes:
            by_fate[outcome.fate].append(outcome)
        confirmed = by_fate[Fate.CONFIRMED]
        await batch.mark_published([o.row.id for o in confirmed])
        if retry := by_fate[Fate.FAILED]:
            await batch.mark_retry([o.row.id for o in retry], repr(retry[0].error))
        give_up = [
            (o.row, DISPATCH_FAILED, f"the broker cannot accept it: {o.error}")
            for o in by_fate[Fate.UNPUBLISHABLE]
        ]
        noted: list[OutboxRow] = []
        if returned := by_fate[Fate.RETURNED]:
            unroutable = await batch.mark_returned(
                [o.row.id for o in returned],
                repr(returned[0].error),
                give_up_after=self._unroutable_after,
                give_up_returns=self._unroutable_returns,
            )
            give_up += [
                (o.row, JOB_TYPE_UNROUTABLE, self._unroutable_message(o.row))
                for o in returned
                if o.row.id in unroutable
            ]
            # Until then the job says why it waits (GetJob, the CLI, the
            # dashboard), not only this relay's log.
            noted = await batch.note_waiting(
                [
                    (o.row, WaitingCode.UNROUTABLE, self._waiting_message(o.row))
                    for o in returned
                    if o.row.id not in unroutable
                ]
            )
        # Published at last (the topology applied): the reason is gone. Only
        # a row that failed before can have left one.
        await batch.note_waiting(
            [(o.row, "", "") for o in confirmed if o.row.retried],
            clears=WaitingCode.UNROUTABLE,
        )
        recorded = Recorded(
            published=len(confirmed), confirmed=[o.row for o in confirmed], unroutable=noted
        )
        for row, code, message in give_up:
            result = await batch.fail(row, code, message)
            if result is GiveUp.BUSY:
                # Its job is being changed right now (a cancel, most likely):
                # the row stays due and the next pass decides.
                await batch.defer([row.id], message)
            else:
                recorded.failed.append((row, code, message, result is GiveUp.JOB_FAILED))
        return recorded

    async def _record_each(self, outcomes: list[RowOutcome]) -> Recorded:
        """Record each row on its own, and settle the ones the database refuses.

        Each row's record is reported as soon as it commits, so what was done
        is counted even when the database goes away half-way.
        """
        total = Recorded()
        unsettled: DBAPIError | None = None
        for outcome in outcomes:
            try:
                async with self._store.claim_one(outcome.row.id) as batch:
                    # An empty batch: taken or settled by another relay meanwhile.
                    recorded = await self._record(batch, [outcome]) if batch.rows else Recorded()
            except DBAPIError as exc:
                if database_transient(exc):
                    raise
                if not _refuses_the_row(exc):
                    # The row stays due; the others still move. Raised below.
                    unsettled = unsettled or exc
                    continue
                recorded = await self._settle_refused(outcome.row, exc)
            self._count([outcome])
            self._report(recorded)
            total.add(recorded)
        if unsettled is not None:
            raise unsettled
        return total

    async def _settle_refused(self, row: OutboxRow, refusal: DBAPIError) -> Recorded:
        """A row whose outcome the database refuses: fail it (and its job if it can).

        Held back from this relay's claims when the database refuses even that.
        """
        message = f"the database refused to record its dispatch: {describe_error(refusal)}"
        try:
            async with self._store.claim_one(row.id) as batch:
                if not batch.rows:
                    return Recorded()
                result = await batch.fail(row, DISPATCH_FAILED, message)
                if result is GiveUp.BUSY:
                    return Recorded()  # still due; the next pass tries again
                return Recorded(
                    failed=[(row, DISPATCH_FAILED, message, result is GiveUp.JOB_FAILED)]
                )
        except DBAPIError as exc:
            if database_transient(exc):
                raise
            job_refusal = exc
        try:
            async with self._store.claim_one(row.id) as batch:
                if not batch.rows:
                    return Recorded()
                await batch.mark_failed(row, message)
        except DBAPIError as exc:
            if database_transient(exc):
                raise
            self._held[row.id] = time.monotonic() + _HOLD_SECONDS
            log.error(
                "relay.dispatch.held",
                **_subject(row, self._intercept),
                error=describe_error(exc),
                retry_in=_HOLD_SECONDS,
                hint="the database refuses every change to this outbox row; an operator must look",
            )
            return Recorded()
        log.error(
            _failed_event(row),
            **_subject(row, self._intercept),
            code=DISPATCH_FAILED,
            error=message,
            job_failed=False,
            job_error=describe_error(job_refusal),
            hint="the job could not be failed and stays QUEUED; an operator must look",
        )
        self.failed += 1
        return Recorded()

    def _holding(self) -> list[uuid.UUID]:
        now = time.monotonic()
        for row_id in [i for i, until in self._held.items() if until <= now]:
            del self._held[row_id]
        return list(self._held)

    def _report(self, recorded: Recorded) -> None:
        self.published += recorded.published
        if recorded.confirmed and log.is_enabled_for(logging.INFO):
            for row in recorded.confirmed:
                if row.job_id is not None:
                    log.info("job.dispatched", **_dispatched(row, self._topology, self._intercept))
        for row in recorded.unroutable:
            log.warning(
                "job.waiting",
                **_subject(row, self._intercept),
                code=WaitingCode.UNROUTABLE.value,
                type=row.routing_key,
                exchange=row.exchange or self._topology.exchange,
            )
        for row, code, message, job_failed in recorded.failed:
            self.failed += 1
            log.error(
                _failed_event(row),
                **_subject(row, self._intercept),
                code=code,
                error=message,
                job_failed=job_failed,
            )

    def _unroutable_message(self, row: OutboxRow) -> str:
        return (
            f"no queue on the broker takes job type {row.routing_key!r}: the dispatch "
            f"came back unroutable {self._unroutable_returns} times in a row over at least "
            f"{self._unroutable_after:g}s (the broker's bindings differ from the topology; "
            "run `jobplane topology apply`)"
        )

    def _waiting_message(self, row: OutboxRow) -> str:
        exchange = row.exchange or self._topology.exchange
        return (
            f"the broker returned its dispatch: no queue is bound for routing key "
            f"{row.routing_key!r} (its job type) on exchange {exchange!r}: apply a topology "
            "that routes it (`jobplane topology apply`). Retried until then; the job fails "
            f"with {JOB_TYPE_UNROUTABLE} if it still comes back after "
            f"{self._unroutable_returns} returns over {self._unroutable_after:g}s"
        )


def _dispatched(
    row: OutboxRow, topology: Topology, intercept: RelayInterceptor | None
) -> dict[str, str]:
    """The fields of a ``job.dispatched`` line."""
    queue = topology.route(row.routing_key)
    fields = {
        "job": job_name(row.job_id) if row.job_id is not None else "",
        "event_id": str(row.id),
        "tenant_id": str(row.tenant_id),
        "correlation_id": fingerprint(row.correlation_id),
        "type": row.routing_key,
        "queue": queue.name if queue is not None else "",
        "exchange": row.exchange or topology.exchange,
    }
    return _with_trace(fields, row, intercept)


def _with_trace(
    fields: dict[str, str], row: OutboxRow, intercept: RelayInterceptor | None
) -> dict[str, str]:
    """``fields`` and, with tracing handed over, the ``trace_id`` of the row's
    context: the line is logged after the publish span ended (or with none, for
    a trace not sampled), so the log's own processor finds no span to name."""
    if intercept is not None:
        trace_id = intercept.trace_id(row.headers)
        if trace_id is not None:
            fields["trace_id"] = trace_id
    return fields


def _failed_event(row: OutboxRow) -> str:
    """The log event of giving up on ``row``."""
    return "relay.event.failed" if row.kind is OutboxKind.EVENT else "relay.dispatch.failed"


def _subject(row: OutboxRow, intercept: RelayInterceptor | None) -> dict[str, str]:
    """What a log line about ``row`` names: its job, or its event type."""
    if row.job_id is not None:
        fields = {"job": job_name(row.job_id), "event_id": str(row.id)}
        return _with_trace(fields, row, intercept)
    return {"outbox_id": str(row.id), "kind": row.kind.value, "event_type": row.routing_key}


def _refuses_the_row(exc: DBAPIError) -> bool:
    """True when Postgres refused ``exc``'s statement for the values of its row."""
    current: BaseException | None = exc.orig
    while current is not None:
        state = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(state, str) and state:
            return state[:2] in _ROW_REFUSALS
        current = current.__cause__
    return False
