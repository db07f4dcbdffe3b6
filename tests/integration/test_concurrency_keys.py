"""Concurrency keys on the real database: the claim, the hold and the release.

A key's limit is decided by the state machine in Postgres (ADR-0040): these
tests claim and write as a worker would (no broker), so what they see is the
store's rule alone.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
import pytest

from jobplane.client import ConcurrencyLimitReached, Job, JobState
from jobplane.store.attempts import AttemptStore, ClaimStatus
from jobplane.store.sweeps import SweepStore
from jobplane.types import WaitingCode
from jobplane.v1 import workers_pb2, workers_pb2_grpc
from tests.support.stack import Stack


async def _claim(stack: Stack, store: AttemptStore, job: Job) -> Any:
    return await store.claim(await stack.envelope(job.id))


async def _dispatch(stack: Stack, job: Job) -> Any:
    return await stack.scalar("SELECT dispatch_id FROM jobs WHERE id = :id", id=job.id)


async def test_a_full_key_holds_the_next_job_until_the_running_one_ends(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    first = await client.submit("demo.echo", {}, concurrency_key="thread-1")
    second = await client.submit("demo.echo", {}, concurrency_key="thread-1")
    assert first.concurrency_key == "thread-1" and first.concurrency_limit == 1

    running = await _claim(bare, store, first)
    assert running.status is ClaimStatus.CLAIMED
    held = await _claim(bare, store, second)
    assert held.status is ClaimStatus.HELD
    waiting = await client.get(second.name)
    assert waiting.state is JobState.QUEUED
    assert waiting.waiting_code == WaitingCode.CONCURRENCY_LIMIT
    assert first.name in waiting.waiting_reason
    # Held: no dispatch is due, nothing goes through the broker meanwhile.
    assert await _dispatch(bare, second) is None

    await store.succeed(running.attempt, {})
    released = await client.get(second.name)
    assert released.state is JobState.QUEUED and await _dispatch(bare, second) is not None
    claimed = await _claim(bare, store, second)
    assert claimed.status is ClaimStatus.CLAIMED
    assert (await client.get(second.name)).waiting_code == ""


async def test_other_keys_and_jobs_without_a_key_are_not_held(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    a = await client.submit("demo.echo", {}, concurrency_key="a")
    b = await client.submit("demo.echo", {}, concurrency_key="b")
    plain = await client.submit("demo.echo", {})
    for job in (a, b, plain):
        assert (await _claim(bare, store, job)).status is ClaimStatus.CLAIMED


async def test_keys_are_per_tenant(bare: Stack) -> None:
    store = AttemptStore(bare.db, lease_seconds=30.0)
    mine = await bare.client().submit("demo.echo", {}, concurrency_key="k")
    theirs = await bare.client(await bare.new_key("globex")).submit(
        "demo.echo", {}, concurrency_key="k"
    )
    assert (await _claim(bare, store, mine)).status is ClaimStatus.CLAIMED
    envelope = await bare.envelope(theirs.id)
    tenant = await bare.scalar("SELECT tenant_id FROM jobs WHERE id = :id", id=theirs.id)
    claim = await store.claim(
        envelope.__class__(
            envelope.event_id, envelope.job_id, uuid.UUID(str(tenant)), envelope.job_type
        )
    )
    assert claim.status is ClaimStatus.CLAIMED


async def test_a_limit_above_one_runs_that_many_and_releases_in_order(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    jobs = [
        await client.submit("demo.echo", {"i": i}, concurrency_key="k", concurrency_limit=2)
        for i in range(5)
    ]
    claims = [await _claim(bare, store, job) for job in jobs]
    assert [c.status for c in claims] == [ClaimStatus.CLAIMED] * 2 + [ClaimStatus.HELD] * 3

    await store.fail(claims[0].attempt, "BROKEN", "broken", retryable=False)
    # The oldest held job is due again, not the others.
    assert [await _dispatch(bare, job) is not None for job in jobs[2:]] == [True, False, False]
    # A newer job's delivery cannot jump ahead of the one made due.
    late = await client.submit("demo.echo", {}, concurrency_key="k", concurrency_limit=2)
    assert (await _claim(bare, store, late)).status is ClaimStatus.HELD
    assert (await _claim(bare, store, jobs[2])).status is ClaimStatus.CLAIMED


async def test_a_dead_holder_frees_its_key_when_its_lease_expires(bare: Stack) -> None:
    client = bare.client()
    short = AttemptStore(bare.db, lease_seconds=0.2)
    first = await client.submit("demo.echo", {}, concurrency_key="k", max_attempts=1)
    second = await client.submit("demo.echo", {}, concurrency_key="k")
    assert (await _claim(bare, short, first)).status is ClaimStatus.CLAIMED
    assert (await _claim(bare, short, second)).status is ClaimStatus.HELD
    await asyncio.sleep(0.5)

    sweeps = SweepStore(bare.engine)
    repair = await sweeps.expire_leases(grace=0.0, limit=10, decide=_fail_now)
    assert repair.failed == 1
    # The expiry released the key itself: the held job is due, nothing is left held.
    assert await _dispatch(bare, second) is not None
    assert await sweeps.release_held(limit=10) == 0
    assert (await _claim(bare, short, second)).status is ClaimStatus.CLAIMED


async def test_the_sweeper_releases_a_key_that_sorts_after_a_page_of_keys(
    bare: Stack,
) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    for i in range(101):  # more keys with held jobs than one page: still full
        holder, held = [
            await client.submit("demo.echo", {}, concurrency_key=f"k{i:03}") for _ in range(2)
        ]
        assert (await _claim(bare, store, holder)).status is ClaimStatus.CLAIMED
        assert (await _claim(bare, store, held)).status is ClaimStatus.HELD
    holder, held = [await client.submit("demo.echo", {}, concurrency_key="zzz") for _ in range(2)]
    running = await _claim(bare, store, holder)
    assert (await _claim(bare, store, held)).status is ClaimStatus.HELD
    lost = AttemptStore(bare.db, lease_seconds=30.0)

    async def _lose(keys: Any) -> None:
        """A crash between the end's commit and its key's release."""

    lost.release_keys = _lose  # type: ignore[method-assign]
    await lost.succeed(running.attempt, {})
    assert await _dispatch(bare, held) is None

    assert await SweepStore(bare.engine).release_held(limit=100) == 1
    assert (await _claim(bare, store, held)).status is ClaimStatus.CLAIMED


def _fail_now(lease: Any) -> Any:
    from jobplane.attempt_end import Fail

    return Fail("LEASE_EXPIRED", "the worker stopped", {})


async def test_cancelling_a_held_job_frees_its_place(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    first, second, third = [
        await client.submit("demo.echo", {}, concurrency_key="k") for _ in range(3)
    ]
    running = await _claim(bare, store, first)
    assert (await _claim(bare, store, second)).status is ClaimStatus.HELD
    assert (await _claim(bare, store, third)).status is ClaimStatus.HELD

    cancelled = await client.cancel(second.name)
    assert cancelled.state is JobState.CANCELLED
    await store.succeed(running.attempt, {})
    assert (await _claim(bare, store, third)).status is ClaimStatus.CLAIMED


async def test_reject_mode_refuses_a_full_key_naming_its_holder(bare: Stack) -> None:
    client = bare.client()
    first = await client.submit("demo.echo", {}, concurrency_key="t", concurrency_mode="reject")
    before = await bare.counts()
    with pytest.raises(ConcurrencyLimitReached) as refused:
        await client.submit("demo.echo", {}, concurrency_key="t", concurrency_mode="reject")
    assert refused.value.holders == [first.name]
    assert refused.value.code.name == "ABORTED"
    assert await bare.counts() == before
    # The same request again is a replay, not a second job in flight.
    again = await client.submit(
        "demo.echo",
        {},
        request_id=first.request_id,
        concurrency_key="t",
        concurrency_mode="reject",
    )
    assert again.name == first.name


async def test_reject_mode_under_concurrent_submits_lets_exactly_the_limit_in(
    bare: Stack,
) -> None:
    client = bare.client()

    async def submit(i: int) -> Job | None:
        try:
            return await client.submit(
                "demo.echo",
                {"i": i},
                concurrency_key="burst",
                concurrency_limit=3,
                concurrency_mode="reject",
            )
        except ConcurrencyLimitReached:
            return None

    results = await asyncio.gather(*(submit(i) for i in range(20)))
    assert sum(r is not None for r in results) == 3


async def test_a_claim_group_leaves_keyed_jobs_to_claims_alone_which_keep_the_limit(
    bare: Stack,
) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    jobs = [
        await client.submit("demo.echo", {}, concurrency_key="g", concurrency_limit=2)
        for _ in range(5)
    ]
    requests = [store.claim_request(await bare.envelope(job.id)) for job in jobs]
    # The group takes no key's lock: each keyed job is claimed alone.
    assert await store.claim_many(requests) == [None] * 5
    refused = [await store.refused_claim(r) for r in requests]
    assert [r.status for r in refused] == [ClaimStatus.CLAIMED] * 2 + [ClaimStatus.HELD] * 3
    running = await bare.scalar(
        "SELECT count(*) FROM jobs WHERE concurrency_key = 'g' AND state = 'running'"
    )
    assert running == 2


async def test_worker_service_claims_are_held_and_released_by_the_same_rule(
    bare: Stack,
) -> None:
    client = bare.client()
    key = (await bare.server.keys.create_worker()).key
    metadata = (("authorization", f"Bearer {key}"),)
    first = await client.submit("demo.echo", {}, concurrency_key="ws")
    second = await client.submit("demo.echo", {}, concurrency_key="ws")
    async with grpc.aio.insecure_channel(bare.server.address) as channel:
        stub: workers_pb2_grpc.WorkerServiceAsyncStub = workers_pb2_grpc.WorkerServiceStub(channel)

        async def claim(job: Job) -> workers_pb2.ClaimJobResponse:
            envelope = await bare.envelope(job.id)
            request = workers_pb2.ClaimJobRequest(message_body=envelope.encode())
            return await stub.ClaimJob(request, metadata=metadata)

        running = await claim(first)
        assert running.status == workers_pb2.ClaimJobResponse.STATUS_CLAIMED
        # Held: its delivery is stale now, to be acked.
        held = await claim(second)
        assert held.status == workers_pb2.ClaimJobResponse.STATUS_STALE
        assert (await client.get(second.name)).waiting_code == "CONCURRENCY_LIMIT"
        await stub.CompleteJob(
            workers_pb2.CompleteJobRequest(attempt=running.attempt), metadata=metadata
        )
        assert (await claim(second)).status == workers_pb2.ClaimJobResponse.STATUS_CLAIMED


async def test_a_worker_that_starts_leaves_held_jobs_held(bare: Stack) -> None:
    # Parked jobs (no dispatch, no live worker) are dispatched again when a
    # worker starts; a held job has no dispatch either, but waits for its key.
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    first = await client.submit("demo.echo", {}, concurrency_key="k")
    second = await client.submit("demo.echo", {}, concurrency_key="k")
    assert (await _claim(bare, store, first)).status is ClaimStatus.CLAIMED
    assert (await _claim(bare, store, second)).status is ClaimStatus.HELD
    queue = await bare.scalar("SELECT queue FROM jobs WHERE id = :id", id=second.id)
    assert await store.unpark(["demo.echo"], [queue]) == 0
    assert await _dispatch(bare, second) is None
    assert (await client.get(second.name)).waiting_code == WaitingCode.CONCURRENCY_LIMIT


async def test_a_batch_over_a_full_key_is_refused_whole_naming_its_request(bare: Stack) -> None:
    client = bare.client()
    spec = {"type": "demo.echo", "concurrency_key": "b", "concurrency_mode": "reject"}
    before = await bare.counts()
    with pytest.raises(ConcurrencyLimitReached) as refused:
        await client.submit_many([{"type": "demo.echo"}, spec, spec])
    assert refused.value.metadata["index"] == "2"
    assert refused.value.holders == []  # the one in flight is the batch's own, not written
    assert await bare.counts() == before
