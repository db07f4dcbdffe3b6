"""The transition table, enumerated on the real database.

For every transition and every state a job can be in (RUNNING split by its
lease), a job is put in that state with everything else the transition
matches on (its fence and its guard) in place, and the transition is
applied: where the table allows it, it changes the job into the declared
state with the declared event and dispatch; everywhere else it changes
nothing at all — no row, no event, no outbox row.

Then the hook: it runs in the transition's transaction, once per changed
row, with the state the job came from; its writes commit with the winning
outcome of an attempt and never with a fenced-out one.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.envelope import Envelope
from jobplane.events.envelope import Event
from jobplane.ids import new_id
from jobplane.store.attempts import AttemptStore, ClaimStatus, LeaseLost, ProgressUpdate
from jobplane.store.db import Conn, Database
from jobplane.store.events import emitted
from jobplane.store.jobs import JobStore, NewJob
from jobplane.store.machine import (
    MACHINE,
    RULES,
    AnyConn,
    Cause,
    Change,
    Emitted,
    Hook,
    NewStage,
    Phase,
    StateMachine,
    Transition,
    Write,
    lifecycle_event_id,
)
from jobplane.store.rows import dumps
from jobplane.types import JobState
from tests.support.rows import insert_tenant

_QUEUE = "default"
_LIVE_LEASE = "now() + interval '1 hour'"
_DEAD_LEASE = "now() - interval '1 hour'"


@dataclass(frozen=True, slots=True)
class Placed:
    """A job put in a phase, with what its fences match."""

    job_id: uuid.UUID
    tenant_id: uuid.UUID
    type: str
    dispatch_id: uuid.UUID | None
    lease_token: uuid.UUID
    request_id: str
    phase: Phase


@pytest.fixture
async def tenant(engine: AsyncEngine) -> uuid.UUID:
    """A tenant of the test database."""
    return await insert_tenant(engine, "machine")


async def _place(
    engine: AsyncEngine, tenant: uuid.UUID, phase: Phase, transition: Transition
) -> Placed:
    """A job in ``phase`` whose fence and guard for ``transition`` hold.

    Only the state (and, for RUNNING, whether the lease is live) differs
    between the jobs of one transition: a refusal can come from nothing else.
    """
    job_type = f"machine.{phase.value}"
    # A stage to advance to, or to restart at: a pipeline job of two stages.
    staged = transition in (Transition.ADVANCE, Transition.RESTART)
    # A fan-out stage to spawn at, or to wait at: three stages (ADR-0047).
    fanned = transition in _FANS
    async with Database(engine.url.render_as_string(hide_password=False)) as db:
        job, _ = await JobStore(engine, db).submit(
            tenant,
            NewJob(
                type="machine.pipeline" if staged or fanned else job_type,
                queue=_QUEUE,
                payload={"phase": phase.value},
                request_id=f"{transition}-{phase.value}",
                max_attempts=3,
                stages=_fan_stages(job_type) if fanned else _two_stages(job_type) if staged else (),
            ),
        )
    job_id = uuid.UUID(job.id)
    token = uuid.uuid4()
    # Guards: an attempt left or none, a parked job, no cancel requested yet.
    exhausted = transition in (Transition.EXHAUST, Transition.EXPIRE_LAST_LEASE)
    parked = transition in (Transition.UNPARK, Transition.RELEASE, Transition.RELEASE_LIMIT)
    parked = parked or transition in _DECIDES or transition is Transition.JOIN
    lease = _DEAD_LEASE if phase is Phase.RUNNING_EXPIRED else _LIVE_LEASE
    async with engine.begin() as conn:
        row = await conn.execute(
            text(
                f"""
                UPDATE jobs SET state = :state, attempt = 1, lease_token = :token,
                    lease_expires_at = {lease}, max_attempts = :max_attempts,
                    dispatch_id = CASE WHEN :parked THEN NULL ELSE dispatch_id END,
                    deadline = CASE WHEN :past THEN now() - interval '1 second' END
                WHERE id = :id RETURNING dispatch_id
                """
            ),
            {
                "state": phase.state.value,
                "token": token,
                "max_attempts": 1 if exhausted else 3,
                "parked": parked,
                # Past its deadline, for DEADLINE's guard (ADR-0044).
                "past": transition is Transition.DEADLINE,
                "id": job_id,
            },
        )
        dispatch_id = row.scalar_one()
        # The relay published the first dispatch long ago: only a new
        # dispatch is a pending outbox row.
        await conn.execute(
            text("UPDATE outbox SET published_at = now() WHERE job_id = :id"), {"id": job_id}
        )
    if transition in (Transition.HOLD, Transition.RELEASE):
        await _keyed(engine, tenant, job_id, f"{transition}-{phase.value}", transition)
    if transition in (Transition.THROTTLE, Transition.RELEASE_LIMIT):
        await _limited(engine, job_id, transition)
    if transition in _DECIDES:
        # Waiting for the jobs it runs after, its counts deciding as the transition does.
        failed, policy = _DECIDES[transition]
        async with engine.begin() as conn:
            await conn.execute(_WAITING, {"id": job_id, "failed": failed, "policy": policy})
    if transition in (Transition.JOIN, Transition.REJOIN):
        # At its fan-out stage, its children ended (JOIN) or to run again (REJOIN).
        async with engine.begin() as conn:
            await conn.execute(_AT_FAN, {"id": job_id})
    return Placed(
        job_id=job_id,
        tenant_id=tenant,
        type=job_type,
        dispatch_id=dispatch_id,
        lease_token=token,
        request_id=f"{transition}-{phase.value}",
        phase=phase,
    )


async def _limited(engine: AsyncEngine, job_id: uuid.UUID, transition: Transition) -> None:
    """A rate limit of every type whose budget is used for a day, for a throttle;
    the job held for a limit's slot (``limit/held``), for its release."""
    async with engine.begin() as conn:
        if transition is Transition.THROTTLE:
            await conn.execute(
                text(
                    "INSERT INTO flow_limits (name, rank, patterns, regexes, per_second) "
                    "VALUES ('all', 1, '{#}', :regexes, 1) ON CONFLICT DO NOTHING"
                ),
                {"regexes": [r"^(\.[^.]+)*$"]},
            )
            await conn.execute(
                text(
                    "INSERT INTO flow_buckets (key, tat, booked) "
                    "VALUES ('limit/all', now() + interval '1 day', now() + interval '1 day') "
                    "ON CONFLICT DO NOTHING"
                )
            )
            return
        await conn.execute(
            text(
                "UPDATE jobs SET flow_key = 'limit/held', waiting_code = 'RATE_LIMITED' "
                "WHERE id = :id"
            ),
            {"id": job_id},
        )


async def _keyed(
    engine: AsyncEngine, tenant: uuid.UUID, job_id: uuid.UUID, key: str, transition: Transition
) -> None:
    """The job under its own concurrency key (limit 1): full, for a hold (another
    job of the key RUNNING); held, for a release."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE jobs SET concurrency_key = :key, concurrency_limit = 1, "
                "waiting_code = CASE WHEN :held THEN 'CONCURRENCY_LIMIT' END WHERE id = :id"
            ),
            {"key": key, "held": transition is Transition.RELEASE, "id": job_id},
        )
    if transition is not Transition.HOLD:
        return
    async with Database(engine.url.render_as_string(hide_password=False)) as db:
        blocker, _ = await JobStore(engine, db).submit(
            tenant,
            NewJob(
                type="machine.blocker",
                queue=_QUEUE,
                payload={},
                request_id=f"{key}-blocker",
                max_attempts=3,
                concurrency_key=key,
                concurrency_limit=1,
            ),
        )
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE jobs SET state = 'running', attempt = 1, lease_token = gen_random_uuid(), "
                f"lease_expires_at = {_LIVE_LEASE} WHERE id = :id"
            ),
            {"id": uuid.UUID(blocker.id)},
        )


# Dependencies (ADR-0045): the counts and policy each resolution decides on.
_DECIDES = {
    Transition.DEPENDENCIES_MET: (0, "fail"),
    Transition.DEPENDENCY_FAILED: (1, "fail"),
    Transition.DEPENDENCY_CANCELLED: (1, "cancel"),
}
_WAITING = text(
    "UPDATE jobs SET waiting_code = 'DEPENDENCIES', deps_waiting = 0, deps_failed = :failed, "
    "after_failure = :policy WHERE id = :id"
)


_FANS = (Transition.FAN_OUT, Transition.JOIN, Transition.REJOIN)
_AT_FAN = text(
    "UPDATE jobs SET stage = 1, stage_name = 'second', fan_stage = 1, fan_size = 1, "
    "waiting_code = 'DEPENDENCIES', deps_waiting = 0 WHERE id = :id"
)


def _fan_stages(job_type: str) -> tuple[NewStage, ...]:
    return (
        NewStage("first", job_type, _QUEUE, "v1", 3, 60.0, base=0.0, span=0.25),
        NewStage("second", "machine.map", _QUEUE, "v1", 3, 60.0, 0.25, 0.5, fan_out=True),
        NewStage("third", "machine.join", _QUEUE, "v1", 3, 60.0, base=0.75, span=0.25),
    )


def _two_stages(job_type: str) -> tuple[NewStage, ...]:
    return (
        NewStage("first", job_type, _QUEUE, "v1", 3, 60.0, base=0.0, span=0.5),
        NewStage("second", "machine.second", _QUEUE, "v1", 3, 60.0, base=0.5, span=0.5),
    )


def _params(transition: Transition, job: Placed) -> dict[str, Any]:
    """The binds of ``transition`` for ``job``, every fence matching."""
    fence = {"id": job.job_id, "attempt": 1, "lease_token": job.lease_token}
    by_dispatch = {"id": job.job_id, "tenant_id": job.tenant_id, "dispatch_id": job.dispatch_id}
    by_id = {"id": job.job_id, "tenant_id": job.tenant_id}
    match transition:
        case Transition.CLAIM:
            return {
                **by_dispatch,
                "type": job.type,
                "lease_token": uuid.uuid4(),
                "lease_seconds": 30.0,
            }
        case Transition.EXHAUST:
            return by_dispatch
        case Transition.PROGRESS:
            return {
                "ids": [job.job_id],
                "attempts": [1],
                "tokens": [job.lease_token],
                "ns": [2],
                "last_progress": [0.5],
                "last_message": ["half"],
                "ks": [1, 1],
                "ords": [1, 2],
                "progresses": [0.25, 0.5],
                "messages": ["quarter", "half"],
                "datas": ["{}", "{}"],
            }
        case Transition.SUCCEED:
            return {
                **fence,
                "result": dumps({"ok": True}),
                "result_blob": None,
                "result_blob_size": None,
            }
        case Transition.FAIL:
            return {**fence, "error_code": "BOOM", "error_message": "boom", "retryable": False}
        case Transition.CANCELLED:
            return fence
        case Transition.SCHEDULE_RETRY:
            return {
                **fence,
                "error_code": "AGAIN",
                "error_message": "again",
                "dispatch_id": new_id(),
                "delay": 60.0,
                "refund": 0,
            }
        case Transition.HAND_BACK | Transition.PARK:
            return {**by_dispatch, "new_dispatch_id": new_id(), "base_delay": 1, "max_delay": 2}
        case Transition.UNPARK:
            return {"types": [job.type], "queues": [_QUEUE], "limit": 10}
        case Transition.DEADLINE:
            return by_id
        case Transition.CANCEL | Transition.REQUEST_CANCEL:
            return {**by_id, "reason": "enough"}
        case Transition.RETRY | Transition.REDISPATCH:
            return {**by_id, "dispatch_id": new_id()}
        case Transition.ADVANCE:
            return {**fence, "result": '{"done": 1}', "dispatch_id": new_id()}
        case Transition.RESTART:
            return {**by_id, "dispatch_id": new_id(), "stage": 0}
        case Transition.FAN_OUT:
            return {**fence, "result": '{"children": 1}', "children": 1}
        case Transition.JOIN:
            return {"ids": [job.job_id]}
        case Transition.REJOIN:
            return {**by_id, "waiting": 1, "rerun": 1, "partial": 0.0}
        case Transition.EXPIRE_LEASE:
            return {
                "id": job.job_id,
                "attempt": 1,
                "message": "gone",
                "dispatch_id": new_id(),
                "delay": 5.0,
            }
        case Transition.EXPIRE_LAST_LEASE:
            return {"id": job.job_id, "attempt": 1, "message": "gone"}
        case Transition.RELAY_FAIL:
            return {
                "job_id": job.job_id,
                "dispatch_id": job.dispatch_id,
                "code": "DISPATCH_FAILED",
                "message": "no",
            }
        case Transition.HOLD | Transition.THROTTLE:
            return {**by_dispatch, "type": job.type}
        case Transition.RELEASE_LIMIT:
            return {"key": "limit/held", "free": None}
        case Transition.RELEASE:
            return {"tenant_id": job.tenant_id, "key": job.request_id}
        case (
            Transition.DEPENDENCIES_MET
            | Transition.DEPENDENCY_FAILED
            | Transition.DEPENDENCY_CANCELLED
        ):
            return {"ids": [job.job_id]}
        case Transition.WAIT:
            return {
                "id": job.job_id,
                "dispatch_id": job.dispatch_id,
                "waiting_code": "UNROUTABLE",
                "waiting_reason": "no route",
            }
    raise AssertionError(f"no binds for {transition}")


async def _snapshot(engine: AsyncEngine, job_id: uuid.UUID) -> tuple[Any, ...]:
    """The job's row, its events and its outbox rows, as the database has them."""
    async with engine.connect() as conn:
        params = {"id": job_id}
        job = (
            await conn.execute(text("SELECT to_jsonb(j) FROM jobs j WHERE id = :id"), params)
        ).scalar_one()
        events = (
            await conn.execute(
                text(
                    "SELECT coalesce(jsonb_agg(to_jsonb(e) ORDER BY seq), '[]') "
                    "FROM job_events e WHERE job_id = :id"
                ),
                params,
            )
        ).scalar_one()
        outbox = (
            await conn.execute(
                text(
                    "SELECT coalesce(jsonb_agg(to_jsonb(o) ORDER BY id), '[]') "
                    "FROM outbox o WHERE job_id = :id"
                ),
                params,
            )
        ).scalar_one()
        # Its domain events (lifecycle and emitted), in the order the relays publish them.
        domain = (
            await conn.execute(
                text(
                    "SELECT coalesce(jsonb_agg(jsonb_build_object("
                    "'event_id', e.event_id, 'event_type', e.event_type, "
                    "'causation_id', e.causation_id, 'payload', e.payload) "
                    "ORDER BY e.txid, e.seq), '[]') "
                    "FROM events e WHERE e.job_id = :id"
                ),
                params,
            )
        ).scalar_one()
    return job, events, outbox, domain


async def _live_worker(engine: AsyncEngine, types: Sequence[str]) -> None:
    """A live worker that handles ``types`` on the queue."""
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO workers (id, host, pid, types, queues, concurrency, expire_time) "
                "VALUES (:id, 'test', 1, :types, :queues, 1, now() + interval '1 hour')"
            ),
            {"id": uuid.uuid4(), "types": list(types), "queues": [_QUEUE]},
        )


_TRANSITIONS = [t for t in Transition if t is not Transition.SUBMIT]


@pytest.mark.parametrize("transition", _TRANSITIONS, ids=str)
async def test_each_transition_applies_exactly_from_its_sources(
    engine: AsyncEngine, tenant: uuid.UUID, transition: Transition
) -> None:
    rule = RULES[transition]
    jobs = {phase: await _place(engine, tenant, phase, transition) for phase in Phase}
    if transition is Transition.HAND_BACK:
        await _live_worker(engine, [job.type for job in jobs.values()])
    for phase, job in jobs.items():
        allowed = phase in rule.sources
        before = await _snapshot(engine, job.job_id)
        async with engine.begin() as conn:
            # A fan-out spawns a child for each item: one here.
            items = [{"i": 1}] if transition is Transition.FAN_OUT else []
            rows = await MACHINE.apply(
                conn, transition, _params(transition, job), Cause("by the table", items=items)
            )
        after = await _snapshot(engine, job.job_id)
        where = f"{transition} from {phase.value}"
        if not allowed:
            assert rows == [], f"{where}: applied, but the table refuses it"
            assert after == before, f"{where}: refused, yet something changed"
            continue
        assert [r["transition"] for r in rows] == [str(transition)], where
        row_before, events_before, outbox_before, domain_before = before
        row_after, events_after, outbox_after, domain_after = after
        assert row_after["state"] == rule.target.value, where
        new_events = events_after[len(events_before) :]
        assert events_after[: len(events_before)] == events_before, where
        expected = rule.event.value if rule.event else None
        wanted = 2 if transition is Transition.PROGRESS else int(expected is not None)
        assert [e["type"] for e in new_events] == [expected] * wanted, where
        assert row_after["last_seq"] == row_before["last_seq"] + wanted, where
        if new_events:
            assert new_events[-1]["seq"] == row_after["last_seq"], where
            assert new_events[-1]["state"] == rule.target.value, where
        pending = [o for o in outbox_after if o["published_at"] is None]
        if rule.dispatch:
            assert [o["id"] for o in pending] == [row_after["dispatch_id"]], where
            assert len(outbox_after) == len(outbox_before) + 1, where
        else:
            assert pending == [], where
            assert outbox_after == outbox_before, where
        # Its lifecycle event: the id of (job, its event seq), caused by the
        # job's lifecycle event before it (job.queued, seq 1, for these jobs).
        assert domain_after[: len(domain_before)] == domain_before, where
        published = domain_after[len(domain_before) :]
        if rule.lifecycle is None:
            assert published == [], where
            assert row_after["lifecycle_seq"] == row_before["lifecycle_seq"], where
            continue
        seq = row_after["last_seq"]
        assert [(e["event_type"], e["event_id"], e["causation_id"]) for e in published] == [
            (
                rule.lifecycle.value,
                str(lifecycle_event_id(job.job_id, seq)),
                str(lifecycle_event_id(job.job_id, row_before["lifecycle_seq"])),
            )
        ], where
        assert published[0]["payload"]["state"] == rule.target.value, where
        assert (row_after["lifecycle_seq"], row_after["lifecycle_cause"]) == (
            seq,
            row_before["lifecycle_seq"],
        ), where


async def test_submit_creates_a_queued_job_once(
    engine: AsyncEngine, db: Database, tenant: uuid.UUID
) -> None:
    """SUBMIT starts from no row; a replay finds the job in any state and changes nothing."""
    store = JobStore(engine, db)
    for phase in Phase:
        job = await _place(engine, tenant, phase, Transition.SUBMIT)
        before = await _snapshot(engine, job.job_id)
        again, created = await store.submit(
            tenant,
            NewJob(
                type=job.type,
                queue=_QUEUE,
                payload={"phase": phase.value},
                request_id=job.request_id,
                max_attempts=3,
            ),
        )
        assert not created and again.id == str(job.job_id)
        assert await _snapshot(engine, job.job_id) == before, phase
    async with engine.connect() as conn:
        counts = (
            await conn.execute(
                text(
                    "SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM job_events), "
                    "(SELECT count(*) FROM outbox WHERE kind = 'job.dispatch'), "
                    "(SELECT count(*) FROM events), "
                    "(SELECT count(*) FROM outbox WHERE kind <> 'job.dispatch')"
                )
            )
        ).one()
    # One job, its one event, its one dispatch and its one job.queued per
    # phase (no outbox row of its own: the relays read events): nothing more.
    assert tuple(counts) == (len(Phase),) * 4 + (0,)
    fresh, created = await store.submit(
        tenant,
        NewJob(type="machine.new", queue=_QUEUE, payload={}, request_id="new", max_attempts=1),
    )
    assert created
    row, events, outbox, domain = await _snapshot(engine, uuid.UUID(fresh.id))
    rule = RULES[Transition.SUBMIT]
    assert row["state"] == rule.target.value
    assert rule.event is not None and [e["type"] for e in events] == [rule.event.value]
    assert [o["id"] for o in outbox] == [row["dispatch_id"]]
    # job.queued starts the job's chain: no cause.
    assert rule.lifecycle is not None
    assert [(e["event_type"], e["event_id"], e["causation_id"]) for e in domain] == [
        (rule.lifecycle.value, str(lifecycle_event_id(uuid.UUID(fresh.id), 1)), None)
    ]


class _Recorder(Hook):
    """Records what the machine hands its hooks, and can refuse a transition."""

    def __init__(self, *, fail_on: Transition | None = None) -> None:
        self.changes: list[Change] = []
        self.fail_on = fail_on
        self.in_transaction: list[bool] = []

    def follows(self, transition: Transition) -> bool:
        return True

    async def after(self, conn: AnyConn, change: Change) -> None:
        self.changes.append(change)
        self.in_transaction.append(
            conn.raw.is_in_transaction() if isinstance(conn, Conn) else conn.in_transaction()
        )
        if change.transition is self.fail_on:
            raise RuntimeError("the hook refuses")


@pytest.fixture
def hooked() -> tuple[StateMachine, _Recorder]:
    """A machine with the built-in hooks and a recorder after them."""
    machine = StateMachine()
    recorder = _Recorder()
    machine.register(recorder)
    return machine, recorder


def _envelope(job: Placed) -> Envelope:
    assert job.dispatch_id is not None
    return Envelope(
        event_id=job.dispatch_id,
        job_id=job.job_id,
        tenant_id=job.tenant_id,
        job_type=job.type,
        correlation_id="",
    )


async def test_the_hook_gets_each_change_with_the_state_it_came_from(
    engine: AsyncEngine, db: Database, tenant: uuid.UUID, hooked: tuple[StateMachine, _Recorder]
) -> None:
    machine, recorder = hooked
    store = AttemptStore(db, machine=machine)
    queued = await _place(engine, tenant, Phase.QUEUED, Transition.CLAIM)
    expired = await _place(engine, tenant, Phase.RUNNING_EXPIRED, Transition.CLAIM)
    for job in (queued, expired):
        claimed = await store.claim(_envelope(job))
        assert claimed.status is ClaimStatus.CLAIMED and claimed.attempt is not None
        await store.write_progress(claimed.attempt, [ProgressUpdate(0.5, "half", {})])
        await store.succeed(claimed.attempt, {"ok": True})
    seen = [(c.transition, c.row["id"], c.from_state, c.row["state"]) for c in recorder.changes]
    running, succeeded = JobState.RUNNING.value, JobState.SUCCEEDED.value
    assert seen == [
        (Transition.CLAIM, queued.job_id, JobState.QUEUED, running),
        (Transition.PROGRESS, queued.job_id, JobState.RUNNING, running),
        (Transition.SUCCEED, queued.job_id, JobState.RUNNING, succeeded),
        (Transition.CLAIM, expired.job_id, JobState.RUNNING, running),
        (Transition.PROGRESS, expired.job_id, JobState.RUNNING, running),
        (Transition.SUCCEED, expired.job_id, JobState.RUNNING, succeeded),
    ]
    assert all(recorder.in_transaction)
    assert recorder.changes[0].cause.message == "attempt started"
    # The row after: every column, as committed.
    assert recorder.changes[2].row["progress"] == 1.0
    assert recorder.changes[2].row["last_seq"] == recorder.changes[1].row["last_seq"] + 1


async def test_a_hook_that_fails_undoes_its_transition(
    engine: AsyncEngine, db: Database, tenant: uuid.UUID
) -> None:
    machine = StateMachine()
    machine.register(_Recorder(fail_on=Transition.CLAIM))
    job = await _place(engine, tenant, Phase.QUEUED, Transition.CLAIM)
    before = await _snapshot(engine, job.job_id)
    with pytest.raises(RuntimeError, match="the hook refuses"):
        await AttemptStore(db, machine=machine).claim(_envelope(job))
    assert await _snapshot(engine, job.job_id) == before


class _EmittedLog(Hook):
    """Writes a succeeding attempt's emitted events into a table, in its statement."""

    def writes(self, transition: Transition) -> Sequence[Write]:
        if transition is not Transition.SUCCEED:
            return ()
        sql = """
        INSERT INTO emitted_log (job_id, event_type, payload)
        SELECT j.id, e.event_type, CAST(e.payload AS jsonb)
        FROM {j} AS j,
             unnest(CAST(:emitted_types AS text[]), CAST(:emitted_payloads AS text[]))
                AS e(event_type, payload)"""
        return [Write(sql, columns=frozenset({"id"}))]

    def binds(self, transition: Transition, cause: Cause) -> dict[str, Any]:
        return {
            "emitted_types": [e.event_type for e in cause.emitted],
            "emitted_payloads": [dumps(dict(e.payload)) for e in cause.emitted],
        }


async def test_hook_writes_commit_only_with_the_winning_attempt(
    engine: AsyncEngine, db: Database, tenant: uuid.UUID
) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text("CREATE TABLE emitted_log (job_id uuid, event_type text, payload jsonb)")
        )
    machine = StateMachine()
    machine.register(_EmittedLog())
    store = AttemptStore(db, machine=machine, lease_seconds=30)
    job = await _place(engine, tenant, Phase.QUEUED, Transition.CLAIM)
    first = await store.claim(_envelope(job))
    assert first.attempt is not None
    # The first attempt's lease runs out and a second attempt takes the job.
    async with engine.begin() as conn:
        await conn.execute(
            text(f"UPDATE jobs SET lease_expires_at = {_DEAD_LEASE} WHERE id = :id"),
            {"id": job.job_id},
        )
    second = await store.claim(_envelope(job))
    assert second.status is ClaimStatus.CLAIMED and second.attempt is not None

    def made(event_type: str, payload: dict[str, Any]) -> Emitted:
        return emitted(Event.new(event_type, payload, tenant_id=tenant), job.job_id)

    stale = [made("thing.made", {"by": "stale"})]
    with pytest.raises(LeaseLost):
        await store.succeed(first.attempt, {"by": "stale"}, emitted=stale)
    won = [made("thing.made", {"n": 1}), made("thing.checked", {"n": 2})]
    await store.succeed(second.attempt, {"by": "winner"}, emitted=won)
    async with engine.connect() as conn:
        logged = (
            await conn.execute(
                text("SELECT job_id, event_type, payload FROM emitted_log ORDER BY event_type")
            )
        ).all()
    assert [tuple(r) for r in logged] == [
        (job.job_id, "thing.checked", {"n": 2}),
        (job.job_id, "thing.made", {"n": 1}),
    ]
    # The built-in hook wrote them as domain events the same way: the
    # winner's, in the order emitted (the feed's order), the stale one's never.
    async with engine.connect() as conn:
        stored = (
            await conn.execute(
                text(
                    "SELECT e.event_id, e.event_type, e.payload FROM events e "
                    "WHERE e.job_id = :id AND e.event_type LIKE 'thing.%' ORDER BY e.txid, e.seq"
                ),
                {"id": job.job_id},
            )
        ).all()
    assert [(r.event_id, r.event_type, r.payload) for r in stored] == [
        (e.event.event_id, e.event_type, dict(e.payload)) for e in won
    ]
