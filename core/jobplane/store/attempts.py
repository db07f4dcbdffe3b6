"""The worker side of the job table: claims and fenced writes.

A claim bumps ``attempt`` and sets a fresh lease token; every later write of
that attempt (progress, heartbeat, outcome) matches on (job id, attempt, lease
token, state = running). A write that matches no row was fenced out: another
attempt owns the job now, or it was changed under us; nothing is written.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import structlog

from jobplane.envelope import Envelope
from jobplane.fanout import FAN_OUT_REFUSED, FanOutRefused, fan_out_items
from jobplane.ids import new_id
from jobplane.logs import describe_error
from jobplane.store.claims import (
    CLAIMED,
    INSPECT,
    Attempt,
    ClaimRequest,
    ClaimResult,
    ClaimStatus,
    HandBack,
    StageRun,
    attempt_from_row,
    claim_cause,
    limit_name,
    stage_run,
)
from jobplane.store.concurrency import ended_keys, release_key
from jobplane.store.db import Conn, Database
from jobplane.store.flow import ended_limits, held_limits, limit_keys, release_limit
from jobplane.store.machine import (
    HEARTBEAT,
    MACHINE,
    Cause,
    Emitted,
    Returning,
    Row,
    StateMachine,
    Transition,
    lifecycle_event_id,
)
from jobplane.store.outcomes import Outcome, ProgressUpdate, progress_binds
from jobplane.store.rows import dumps
from jobplane.types import BlobRef, JobState

# The claim's types are named here by the worker side, wherever they are defined.
__all__ = [
    "Attempt",
    "AttemptStore",
    "ClaimRequest",
    "ClaimResult",
    "ClaimStatus",
    "HandBack",
    "LeaseLost",
    "Outcome",
    "ProgressUpdate",
    "StageRun",
    "attempt_from_row",
    "stage_run",
]


class LeaseLost(Exception):
    """This attempt no longer owns the job; its writes are refused."""


log = structlog.get_logger("jobplane.store")
_ID: Returning = ("id",)
# An attempt's end, with what its key's release needs (ADR-0040).
_ENDED: Returning = ("id", "tenant_id", "concurrency_key", "flow_slots")
# A refused claim's job held (no dispatch) or throttled (due at its reserved start).
_HOLDS = (Transition.HOLD, Transition.THROTTLE)
# A hold: what holds the job (for the throttled-starts count), and its key.
_HELD: Returning = ("id", "waiting_code", "flow_key", "tenant_id", "concurrency_key")
# A claim its key refused is tried again while the hold finds the key free:
# a slot freed between the two statements. The tries after the first run in
# one transaction, which holds the key's lock from its first claim's guard on:
# what raises the key's count takes the lock, so a claim after a hold in it that
# found the slot free takes it (ADR-0059).
_CLAIM_TRIES = 3


class AttemptStore:
    """Claims attempts and writes their progress and outcome, fenced."""

    def __init__(
        self,
        db: Database,
        *,
        lease_seconds: float = 30.0,
        machine: StateMachine = MACHINE,
    ) -> None:
        # Claims, heartbeats, progress and most outcomes are one statement
        # each: atomic alone (autocommit), without BEGIN/COMMIT round trips.
        self._db = db
        self._machine = machine
        self.lease_seconds = lease_seconds

    async def claim(self, envelope: Envelope, *, worker: str = "") -> ClaimResult:
        """Try to start the attempt this message dispatches.

        ``worker`` (the claiming worker's id) goes into the STARTED event's
        data, for the dashboard's attempts; empty: none is recorded.
        """
        token = uuid.uuid4()
        params = self._claim_params(envelope, token)
        machine = self._machine
        scope = machine.session(
            self._db, Transition.CLAIM, Transition.EXHAUST, Transition.DEADLINE, *_HOLDS
        )
        ended: list[Any] = []
        holds: list[Any] = []
        async with scope as conn:

            async def once() -> ClaimResult | None:
                rows = await machine.apply(
                    conn, Transition.CLAIM, params, claim_cause(worker), returning=CLAIMED
                )
                if rows:
                    return await self._claimed(conn, envelope, token, rows[0])
                return await self._refused(conn, envelope, params, ended, holds)

            result = await once()
            async with conn.transaction() if result is None else nullcontext():
                for _ in range(_CLAIM_TRIES - 1):
                    result = result or await once()
        # Ended at its claim by its deadline, or held (ADR-0059): what it held or
        # was promised is free, for the oldest job waiting.
        await self.release_ended(ended)
        await self.release_keys(ended_keys(holds))
        await self.release_limits(held_limits(holds))
        return result or ClaimResult(ClaimStatus.IN_FLIGHT, state=JobState.QUEUED)

    def claim_request(self, envelope: Envelope, *, worker: str = "") -> ClaimRequest:
        """A claim of ``envelope`` for :meth:`claim_many`, its binds taken here and now."""
        token = uuid.uuid4()
        binds = self._machine.prepare(
            Transition.CLAIM, self._claim_params(envelope, token), claim_cause(worker)
        )
        return ClaimRequest(envelope, token, binds, worker)

    @property
    def groups_claims(self) -> bool:
        """Whether :meth:`claim_many` can claim (the machine has no per-row Python hook)."""
        return self._machine.groupable(Transition.CLAIM)

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult | None]:
        """Claim many deliveries in one statement (ADR-0028).

        For each request, in order: what :meth:`claim` returns when it
        claimed, or None when its fence refused it; the caller then learns
        why with :meth:`refused_claim`, as :meth:`claim` would have.

        One transaction: the claims commit with what is read after them (a
        stage's inputs, each attempt), or none does. A failure of any one
        leaves every job of the group as it was, claimable again with the
        same requests, rather than held under leases nobody runs.
        """
        machine = self._machine
        async with self._db.begin() as conn:
            rows = await machine.apply_many(
                conn, Transition.CLAIM, [r.binds for r in requests], returning=CLAIMED
            )
            return [
                None if row is None else await self._claimed(conn, r.envelope, r.lease_token, row)
                for r, row in zip(requests, rows, strict=True)
            ]

    async def refused_claim(self, request: ClaimRequest) -> ClaimResult:
        """What :meth:`claim` finds for ``request``, which :meth:`claim_many` refused.

        A group claims no job with a concurrency key or under a flow limit
        (those take advisory locks: ADR-0043): it is claimed here, alone, as
        is any other the group refused, which learns why (fails the job when
        no attempt is left)."""
        return await self.claim(request.envelope, worker=request.worker)

    def _claim_params(self, envelope: Envelope, token: uuid.UUID) -> dict[str, Any]:
        return {
            "id": envelope.job_id,
            "tenant_id": envelope.tenant_id,
            "dispatch_id": envelope.event_id,
            "type": envelope.job_type,
            "lease_token": token,
            "lease_seconds": self.lease_seconds,
        }

    async def _claimed(
        self, conn: Conn, envelope: Envelope, token: uuid.UUID, row: Any
    ) -> ClaimResult:
        stage = None
        if row["stage"] is not None:
            stage = await stage_run(conn, envelope.job_id, row)
        started = (
            None
            if row["lifecycle_seq"] is None
            else lifecycle_event_id(envelope.job_id, int(row["lifecycle_seq"]))
        )
        attempt = attempt_from_row(envelope.job_id, envelope.tenant_id, token, row, stage, started)
        return ClaimResult(ClaimStatus.CLAIMED, attempt=attempt)

    async def _refused(
        self,
        conn: Conn,
        envelope: Envelope,
        params: Mapping[str, Any],
        ended: list[Any],
        holds: list[Any],
    ) -> ClaimResult | None:
        """Why the claim was refused; None when its key was full and is no longer
        (claim again). A job past its deadline is ended now (DEADLINE), its row
        added to ``ended``: FINISHED, the message acked. A job held is added to
        ``holds``, as held and as found: the budget it was made due for is free
        too, whatever holds it now."""
        found = await conn.fetchrow(INSPECT, params)
        if found is None:
            return ClaimResult(ClaimStatus.NOT_FOUND)
        state = JobState(found["state"])
        if state.terminal:
            return ClaimResult(ClaimStatus.FINISHED, state=state)
        if (
            str(found["dispatch_id"]) != str(envelope.event_id)
            or found["type"] != envelope.job_type
        ):
            # Not this job's current dispatch (or not a message our relay
            # wrote): the job's own message is elsewhere.
            return ClaimResult(ClaimStatus.STALE, state=state)
        if found["past_deadline"]:
            rows = await self._machine.apply(
                conn, Transition.DEADLINE, params, Cause("past its deadline"), returning=_ENDED
            )
            ended.extend(rows)
            if rows:
                return ClaimResult(ClaimStatus.FINISHED, state=JobState.FAILED)
        if state is JobState.RUNNING and not found["lease_expired"]:
            return ClaimResult(
                ClaimStatus.IN_FLIGHT, state=state, lease_expires_at=found["lease_expires_at"]
            )
        if found["exhausted"]:
            exhausted = await self._machine.apply(
                conn, Transition.EXHAUST, params, Cause("no attempts left"), returning=_ID
            )
            if exhausted:
                return ClaimResult(ClaimStatus.EXHAUSTED, state=JobState.FAILED)
        if state is JobState.QUEUED:
            # Its key or a flow limit holds it: without a dispatch until a slot
            # frees, or with one due at the start its rate reserved (the
            # message is acked). A flow limit with room now gives it a
            # dispatch due now (THROTTLE); a key alone with room changes
            # nothing: claimed again.
            held = await self._machine.apply(
                conn, Transition.HOLD, params, Cause("held"), returning=_HELD
            )
            if not held:
                return None
            holds.extend((*held, found))  # its key and budget, now and as it came
            return ClaimResult(
                ClaimStatus.HELD,
                state=state,
                waiting_code=str(held[0]["waiting_code"]),
                limit=limit_name(held[0]["flow_key"]),
            )
        # Changed between the two statements; the caller looks again.
        return ClaimResult(ClaimStatus.IN_FLIGHT, state=state)

    async def hand_back(
        self, envelope: Envelope, *, base_delay: float, max_delay: float
    ) -> tuple[HandBack, str]:
        """Give back a delivered job this worker has no handler for, without claiming it.

        Returns what became of it and the waiting reason now on the job.
        """
        params = {
            "id": envelope.job_id,
            "tenant_id": envelope.tenant_id,
            "dispatch_id": envelope.event_id,
            "new_dispatch_id": new_id(),
            "base_delay": base_delay,
            "max_delay": max_delay,
        }
        machine = self._machine
        async with machine.session(self._db, Transition.HAND_BACK, Transition.PARK) as conn:
            rows = await machine.apply(
                conn, Transition.HAND_BACK, params, returning=("handled", "waiting_reason")
            )
            if rows:
                status = HandBack.HANDED_BACK if rows[0]["handled"] else HandBack.PARKED
                return status, str(rows[0]["waiting_reason"])
            found = await conn.fetchrow(INSPECT, params)
        return (HandBack.NOT_FOUND if found is None else HandBack.NOT_QUEUED), ""

    async def unpark(self, types: Sequence[str], queues: Sequence[str], *, limit: int = 500) -> int:
        """Dispatch parked jobs of ``types`` on ``queues`` again; how many were."""
        if not types or not queues:
            return 0
        params = {"types": list(types), "queues": list(queues), "limit": limit}
        machine = self._machine
        async with machine.session(self._db, Transition.UNPARK) as conn:
            return len(await machine.apply(conn, Transition.UNPARK, params, returning=_ID))

    async def heartbeat(self, attempt: Attempt) -> bool:
        """Extend the lease; returns whether cancellation was requested."""
        async with self._db.connect() as conn:
            row = await conn.fetchrow(
                HEARTBEAT, {**attempt.fence(), "lease_seconds": self.lease_seconds}
            )
        if row is None:
            raise LeaseLost(f"jobs/{attempt.job_id} attempt {attempt.attempt} lost its lease")
        return bool(row[0])

    async def write_progress(self, attempt: Attempt, updates: Sequence[ProgressUpdate]) -> bool:
        """Store progress events in one statement; returns whether cancel was requested."""
        async with self._machine.session(self._db, Transition.PROGRESS) as conn:
            return await self._progress(conn, attempt, updates)

    async def write_progress_many(
        self, batches: Sequence[tuple[Attempt, Sequence[ProgressUpdate]]]
    ) -> list[bool | None]:
        """Store the progress of many attempts in one statement.

        For each batch, in order: whether cancellation of its job was
        requested, or None when the attempt was fenced out (nothing of it was
        written).
        """
        async with self._machine.session(self._db, Transition.PROGRESS) as conn:
            return await self._progress_many(conn, batches)

    async def succeed(
        self,
        attempt: Attempt,
        result: dict[str, Any],
        pending: Sequence[ProgressUpdate] = (),
        *,
        emitted: Sequence[Emitted] = (),
        result_blob: BlobRef | None = None,
    ) -> None:
        """Commit SUCCEEDED (after any pending progress) or raise :class:`LeaseLost`.

        ``result_blob``: the result was offloaded to this blob (``result`` is
        then ``{}``); the job references it (role ``result``).

        A pipeline stage that is not the last commits its result and the next
        stage's dispatch instead, the job QUEUED for it (ADR-0017).
        ``emitted``: the handler's events, for the machine's hooks to commit
        with the outcome (none of them when the attempt was fenced out).
        """
        outcome = self.succeeded(attempt, result, emitted=emitted, result_blob=result_blob)
        await self.finish(outcome, pending)

    async def fail(
        self,
        attempt: Attempt,
        code: str,
        message: str,
        *,
        retryable: bool,
        pending: Sequence[ProgressUpdate] = (),
        details: Mapping[str, Any] | None = None,
    ) -> None:
        """Commit FAILED with the error, or raise :class:`LeaseLost`.

        ``details`` (e.g. the traceback) go into the failed event's
        ``data.error``, not the job row.
        """
        outcome = self.failed(attempt, code, message, retryable=retryable, details=details)
        await self.finish(outcome, pending)

    async def cancelled(self, attempt: Attempt, pending: Sequence[ProgressUpdate] = ()) -> None:
        """Commit CANCELLED, or raise :class:`LeaseLost`."""
        await self.finish(self.was_cancelled(attempt), pending)

    async def schedule_retry(
        self,
        attempt: Attempt,
        code: str,
        message: str,
        *,
        delay: float,
        pending: Sequence[ProgressUpdate] = (),
        refund: bool = False,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        """Back to QUEUED with a new dispatch due after ``delay`` seconds, via the outbox.

        ``refund``: the attempt does not count against max_attempts (it was
        interrupted by a shutdown, not failed by the job). ``details`` go into
        the event's ``data.error``.
        """
        outcome = self.retried(attempt, code, message, delay=delay, refund=refund, details=details)
        await self.finish(outcome, pending)

    # The outcomes, made without writing them: for finish() or finish_many().

    def succeeded(
        self,
        attempt: Attempt,
        result: dict[str, Any],
        *,
        emitted: Sequence[Emitted] = (),
        result_blob: BlobRef | None = None,
    ) -> Outcome:
        """The outcome :meth:`succeed` writes."""
        stage = attempt.stage
        if stage is not None and stage.fans_out:
            return self.fanned_out(attempt, result, emitted=emitted)
        if stage is not None and not stage.last:
            return self._outcome(
                attempt,
                Transition.ADVANCE,
                {"result": dumps(result), "dispatch_id": new_id()},
                Cause(f"stage {stage.name} succeeded", emitted=emitted),
            )
        return self._outcome(
            attempt,
            Transition.SUCCEED,
            {
                "result": dumps(result),
                "result_blob": result_blob.sha256 if result_blob else None,
                "result_blob_size": result_blob.size if result_blob else None,
            },
            Cause("succeeded", emitted=emitted),
        )

    def fanned_out(
        self, attempt: Attempt, result: Any, *, emitted: Sequence[Emitted] = ()
    ) -> Outcome:
        """The success of a stage before a fan-out stage: one child per item of
        ``result`` (a list), or the stage's failure when it is not one (ADR-0047)."""
        assert attempt.stage is not None
        try:
            items = fan_out_items(result)
        except FanOutRefused as exc:
            return self.failed(attempt, FAN_OUT_REFUSED, str(exc), retryable=False)
        return self._outcome(
            attempt,
            Transition.FAN_OUT,
            {"result": dumps({"children": len(items)}), "children": len(items)},
            Cause(f"stage {attempt.stage.name} succeeded", emitted=emitted, items=items),
        )

    def failed(
        self,
        attempt: Attempt,
        code: str,
        message: str,
        *,
        retryable: bool,
        details: Mapping[str, Any] | None = None,
    ) -> Outcome:
        """The outcome :meth:`fail` writes."""
        error = {**(details or {}), "code": code, "message": message, "retryable": retryable}
        return self._outcome(
            attempt,
            Transition.FAIL,
            {"error_code": code, "error_message": message, "retryable": retryable},
            Cause(message, {"error": error}),
        )

    def was_cancelled(self, attempt: Attempt) -> Outcome:
        """The outcome :meth:`cancelled` writes."""
        return self._outcome(attempt, Transition.CANCELLED, {}, Cause("cancelled"))

    def retried(
        self,
        attempt: Attempt,
        code: str,
        message: str,
        *,
        delay: float,
        refund: bool = False,
        details: Mapping[str, Any] | None = None,
    ) -> Outcome:
        """The outcome :meth:`schedule_retry` writes."""
        extra = {
            "error_code": code,
            "error_message": message,
            "dispatch_id": new_id(),
            "delay": float(delay),
            "refund": 1 if refund else 0,
        }
        data = {
            "error": {**(details or {}), "code": code, "message": message, "retryable": True},
            "delay_seconds": round(delay, 3),
            "next_attempt": attempt.attempt + 1,
        }
        return self._outcome(attempt, Transition.SCHEDULE_RETRY, extra, Cause(message, data))

    def _outcome(
        self, attempt: Attempt, transition: Transition, extra: dict[str, Any], cause: Cause
    ) -> Outcome:
        params = {**attempt.fence(), **extra}
        binds = self._machine.prepare(transition, params, cause)
        return Outcome(attempt, transition, params, cause, binds)

    def groups(self, outcome: Outcome) -> bool:
        """Whether :meth:`finish_many` can write ``outcome`` (see ``groupable``)."""
        return self._machine.groupable(outcome.transition)

    async def finish(self, outcome: Outcome, pending: Sequence[ProgressUpdate] = ()) -> None:
        """Commit ``outcome`` (after ``pending`` progress), or raise :class:`LeaseLost`."""
        # Pending progress and the outcome commit together; the outcome alone
        # is one statement, its event and any next dispatch included.
        machine = self._machine
        attempt = outcome.attempt
        scope = machine.session(self._db, outcome.transition, many=bool(pending))
        async with scope as conn:
            if pending:
                await self._progress(conn, attempt, pending)
            rows = await machine.apply(
                conn, outcome.transition, outcome.params, outcome.cause, returning=_ENDED
            )
            if not rows:
                raise LeaseLost(f"jobs/{attempt.job_id} attempt {attempt.attempt} was fenced out")
        await self.release_ended(rows)

    async def finish_many(self, outcomes: Sequence[Outcome]) -> list[bool]:
        """Commit many attempts' outcomes (none with pending progress): one statement
        per transition among them (ADR-0028). For each, in order: whether it
        committed (False: fenced out, nothing of it written)."""
        by_transition: dict[Transition, list[int]] = {}
        for index, outcome in enumerate(outcomes):
            by_transition.setdefault(outcome.transition, []).append(index)
        done = [False] * len(outcomes)
        ended: list[Row | None] = []
        async with self._db.connect() as conn:
            for transition, indexes in by_transition.items():
                rows = await self._machine.apply_many(
                    conn, transition, [outcomes[i].binds for i in indexes], returning=_ENDED
                )
                for index, row in zip(indexes, rows, strict=True):
                    done[index] = row is not None
                ended.extend(rows)
        await self.release_ended(ended)
        return done

    async def release_ended(self, rows: Sequence[Row | None]) -> None:
        """After jobs ended (``rows``, :data:`_ENDED`): the keys and limits they held free."""
        await self.release_keys(ended_keys(rows))
        await self.release_limits(ended_limits(rows))

    async def release_keys(self, keys: set[tuple[Any, str]]) -> None:
        """After RUNNING jobs of these (tenant, key)s ended: their oldest held jobs
        due again, up to the free slots (ADR-0040). Each key in a transaction of
        its own, after the end committed; one lost here is the sweeper's."""
        for tenant_id, key in sorted(keys, key=str):
            try:
                async with self._db.begin() as conn:
                    await release_key(conn, self._machine, tenant_id, key)
            except Exception as exc:
                # The outcome is committed: its caller must not write it again.
                # The sweeper releases the key on its next pass.
                log.warning(
                    "store.concurrency.release_failed",
                    tenant_id=str(tenant_id),
                    error=describe_error(exc),
                )

    async def release_limits(self, ended: Sequence[str]) -> None:
        """After RUNNING jobs that held slots of flow limits ended: the oldest jobs
        held for those limits due again, up to the free slots (ADR-0043). Each
        limit in a transaction of its own; one lost here is the sweeper's."""
        if not ended:
            return
        try:
            async with self._db.connect() as conn:
                keys = await limit_keys(conn, ended)
            for key in keys:
                async with self._db.begin() as conn:
                    await release_limit(conn, self._machine, key)
        except Exception as exc:
            # The outcome is committed; the sweeper releases on its next pass.
            log.warning("store.flow.release_failed", error=describe_error(exc))

    async def _progress(
        self, conn: Conn, attempt: Attempt, updates: Sequence[ProgressUpdate]
    ) -> bool:
        written = await self._progress_many(conn, [(attempt, updates)])
        if written[0] is None:
            raise LeaseLost(f"jobs/{attempt.job_id} attempt {attempt.attempt} was fenced out")
        return written[0]

    async def _progress_many(
        self, conn: Conn, batches: Sequence[tuple[Attempt, Sequence[ProgressUpdate]]]
    ) -> list[bool | None]:
        params = progress_binds(batches)
        rows = await self._machine.apply(
            conn, Transition.PROGRESS, params, returning=("k", "cancel_requested")
        )
        written: list[bool | None] = [None] * len(batches)
        for row in rows:
            written[int(row["k"]) - 1] = bool(row["cancel_requested"])
        return written
