"""What a flow limit's budget counts, claim by claim, as a worker would claim: only
the jobs waiting for it, the RUNNING jobs that started under it (the first
matching entry's, not another's), and a pipeline stage's slot is freed by the
stage that held it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job
from jobplane.store.attempts import AttemptStore, ClaimStatus, HandBack
from jobplane.store.flow_sync import restart_limits
from jobplane.store.machine import AnyConn, Change, StateMachine, Transition
from jobplane.store.routes import sync_submit_rules
from jobplane.topology import RateLimitSpec, Topology, load_topology
from jobplane.types import JobState
from tests.support import services
from tests.support.parts import Started
from tests.support.stack import Stack, start_stack

_AIDJ = Path(__file__).parents[2] / "examples" / "topologies" / "aidj.toml"


@pytest.fixture
def limits() -> tuple[RateLimitSpec, ...]:
    return (RateLimitSpec("solo", ("solo.op",), max_running=1),)


@pytest.fixture
async def limited(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    limits: tuple[RateLimitSpec, ...],
    started: Started,
) -> Stack:
    """A server alone, under ``limits``: the test claims and writes as a worker would."""
    spec = replace(topology, rate_limits=limits)
    return await started(
        start_stack(engine, database_url, amqp_url, spec, relay=False, worker=False)
    )


async def _claim(stack: Stack, store: AttemptStore, job: Job) -> ClaimStatus:
    return (await store.claim(await stack.envelope(job.id))).status


async def test_a_parked_job_does_not_hold_the_budget_it_waited_for(limited: Stack) -> None:
    client = limited.client()
    store = AttemptStore(limited.db, lease_seconds=30.0)
    first, second, third = [await client.submit("solo.op", {}) for _ in range(3)]
    running = await store.claim(await limited.envelope(first.id))
    assert running.status is ClaimStatus.CLAIMED and running.attempt is not None
    assert await _claim(limited, store, second) is ClaimStatus.HELD
    # Its slot is free: the held job is dispatched, and handed back with no
    # live worker for it: parked, no longer waiting for the limit.
    await store.succeed(running.attempt, {})
    gone, _ = await store.hand_back(
        await limited.envelope(second.id), base_delay=1.0, max_delay=1.0
    )
    assert gone is HandBack.PARKED
    assert await _claim(limited, store, third) is ClaimStatus.CLAIMED


_OVERLAPPING = (
    RateLimitSpec("special", ("ov.special",), max_running=5),
    RateLimitSpec("wide", ("ov.*",), max_running=1),
)


@pytest.mark.parametrize("limits", [_OVERLAPPING])
async def test_a_job_counts_only_against_the_entry_that_governs_its_type(
    limited: Stack,
) -> None:
    client = limited.client()
    store = AttemptStore(limited.db, lease_seconds=30.0)
    special = [await client.submit("ov.special", {}) for _ in range(2)]
    for job in special:
        assert await _claim(limited, store, job) is ClaimStatus.CLAIMED
    # ov.special matches wide's pattern too, but special governs it: wide's one
    # slot is free.
    other, more = [await client.submit("ov.other", {}) for _ in range(2)]
    assert await _claim(limited, store, other) is ClaimStatus.CLAIMED
    assert await _claim(limited, store, more) is ClaimStatus.HELD


_RATE_ONLY = (RateLimitSpec("late", ("late.op",), per_second=1000.0, burst=10.0),)


@pytest.mark.parametrize("limits", [_RATE_ONLY])
async def test_a_job_started_before_its_max_running_existed_does_not_count_against_it(
    engine: AsyncEngine, limited: Stack, topology: Topology
) -> None:
    client = limited.client()
    store = AttemptStore(limited.db, lease_seconds=30.0)
    before = await client.submit("late.op", {})
    assert await _claim(limited, store, before) is ClaimStatus.CLAIMED
    # Started under the entry's rate alone; then the entry gets a max_running.
    late = replace(topology, rate_limits=(replace(_RATE_ONLY[0], max_running=1),))
    assert await sync_submit_rules(engine, late, max_payload_bytes=1 << 20)
    first, second = [await client.submit("late.op", {}) for _ in range(2)]
    assert await _claim(limited, store, first) is ClaimStatus.CLAIMED
    assert await _claim(limited, store, second) is ClaimStatus.HELD


_STAGES = (
    RateLimitSpec("first", ("native.analyze",), max_running=1),
    RateLimitSpec("second", ("neural.embed",), max_running=1),
)


@pytest.fixture
async def aidj(amqp_url: str) -> AsyncIterator[Topology]:
    """The seed's pipeline topology under names of this test's own."""
    names = load_topology(_AIDJ).prefixed(f"p{uuid.uuid4().hex[:6]}.")
    yield names
    await services.delete_topology(amqp_url, names)


@pytest.mark.parametrize("limits", [_STAGES])
async def test_a_stage_that_succeeds_frees_its_own_slot_not_the_next_stages(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    aidj: Topology,
    limits: tuple[RateLimitSpec, ...],
    started: Started,
) -> None:
    spec = replace(aidj, rate_limits=limits)
    stack = await started(
        start_stack(engine, database_url, amqp_url, spec, relay=False, worker=False)
    )
    client = stack.client()
    store = AttemptStore(stack.db, lease_seconds=30.0)
    job = await client.submit("aidj.analyze", {"track": "t"})
    running = await store.claim(await stack.envelope(job.id))
    assert running.status is ClaimStatus.CLAIMED and running.attempt is not None
    assert running.attempt.type == "native.analyze"
    plain = await client.submit("native.analyze", {})
    assert await _claim(stack, store, plain) is ClaimStatus.HELD
    # The pipeline's first stage succeeds: its slot of "first" is free.
    await store.succeed(running.attempt, {})
    dispatch = await stack.scalar("SELECT dispatch_id FROM jobs WHERE id = :id", id=plain.id)
    assert dispatch is not None
    assert await _claim(stack, store, plain) is ClaimStatus.CLAIMED


_SLOW = (RateLimitSpec("slow", ("slow.op",), per_second=0.5, burst=1.0),)
_DUE = text("SELECT next_attempt_time FROM jobs WHERE id = :id")


@pytest.mark.parametrize("limits", [_SLOW])
async def test_a_changed_rate_dispatches_its_throttled_jobs_again_now(
    engine: AsyncEngine, limited: Stack, topology: Topology
) -> None:
    client = limited.client()
    store = AttemptStore(limited.db, lease_seconds=30.0)
    first, second, third = [await client.submit("slow.op", {}) for _ in range(3)]
    assert await _claim(limited, store, first) is ClaimStatus.CLAIMED
    # Each reserves a start of the rate: two and four seconds from now.
    assert await _claim(limited, store, second) is ClaimStatus.HELD
    assert await _claim(limited, store, third) is ClaimStatus.HELD
    async with engine.connect() as conn:
        assert (await conn.execute(_DUE, {"id": third.id})).scalar_one() is not None
    fast = replace(topology, rate_limits=(replace(_SLOW[0], per_second=1000.0, burst=10.0),))
    assert await sync_submit_rules(engine, fast, max_payload_bytes=1 << 20)
    async with engine.connect() as conn:
        dues = [(await conn.execute(_DUE, {"id": j.id})).scalar_one() for j in (second, third)]
    # Dispatched again, due now, and admitted under the new rate.
    assert dues == [None, None]
    assert await _claim(limited, store, second) is ClaimStatus.CLAIMED
    assert await _claim(limited, store, third) is ClaimStatus.CLAIMED


@pytest.mark.parametrize("limits", [_SLOW])
async def test_a_restarted_limit_runs_the_functions_after_redispatch_for_each_job(
    engine: AsyncEngine, limited: Stack
) -> None:
    """With ``machine.on`` after REDISPATCH, the jobs go one by one, each through it."""
    client = limited.client()
    store = AttemptStore(limited.db, lease_seconds=30.0)
    first, second, third = [await client.submit("slow.op", {}) for _ in range(3)]
    assert await _claim(limited, store, first) is ClaimStatus.CLAIMED
    assert await _claim(limited, store, second) is ClaimStatus.HELD
    assert await _claim(limited, store, third) is ClaimStatus.HELD
    seen: list[tuple[str, JobState | None, str]] = []

    async def audit(conn: AnyConn, change: Change) -> None:
        seen.append((str(change.row["id"]), change.from_state, change.row["state"]))

    machine = StateMachine()
    machine.on([Transition.REDISPATCH], audit)
    async with engine.begin() as conn:
        assert await restart_limits(conn, ["slow"], machine) == 2
    queued = JobState.QUEUED
    assert sorted(seen) == sorted((j.id, queued, queued.value) for j in (second, third))
    async with engine.connect() as conn:
        dues = [(await conn.execute(_DUE, {"id": j.id})).scalar_one() for j in (second, third)]
    assert dues == [None, None]
    # The bucket starts afresh: its one start of burst is the second's.
    assert await _claim(limited, store, second) is ClaimStatus.CLAIMED
    assert await _claim(limited, store, third) is ClaimStatus.HELD


@pytest.mark.parametrize("limits", [_SLOW])
async def test_jobs_late_on_their_reservations_together_get_starts_an_interval_apart(
    engine: AsyncEngine, limited: Stack
) -> None:
    client = limited.client()
    store = AttemptStore(limited.db, lease_seconds=30.0)
    first, second, third = [await client.submit("slow.op", {}) for _ in range(3)]
    assert await _claim(limited, store, first) is ClaimStatus.CLAIMED
    assert await _claim(limited, store, second) is ClaimStatus.HELD
    assert await _claim(limited, store, third) is ClaimStatus.HELD
    # Starts bunched ahead of their reservations: the rate's next start is
    # a minute away when both arrive.
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE flow_buckets SET tat = now() + interval '60 seconds'"))
    assert await _claim(limited, store, second) is ClaimStatus.HELD
    assert await _claim(limited, store, third) is ClaimStatus.HELD
    async with engine.connect() as conn:
        due = [(await conn.execute(_DUE, {"id": j.id})).scalar_one() for j in (second, third)]
    # One emission interval (2 s at 0.5 per second) apart, not both at once.
    assert (due[1] - due[0]).total_seconds() >= 2.0 - 1e-3, due
