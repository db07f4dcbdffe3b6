"""What the store writes and reads back, field by field, on real Postgres.

Each argument of a store call reaches its row, and each column of a row
reaches what the store returns: a worker's heartbeat, an API key's record,
the state a refused claim reports.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState
from jobplane.store.attempts import AttemptStore, ClaimStatus
from jobplane.store.keys import KeyScope, KeyStore
from jobplane.store.workers import WorkerStore
from tests.support.stack import Stack


async def _register(workers: WorkerStore, worker_id: uuid.UUID, ttl: float) -> None:
    await workers.register(
        worker_id,
        host="h",
        pid=1,
        types=["demo.echo"],
        queues=["jobplane.default"],
        concurrency=1,
        version="v",
        ttl=ttl,
    )


async def _lifetimes(engine: AsyncEngine) -> dict[uuid.UUID, timedelta]:
    """Each worker's registered lifetime: its expiry after its last heartbeat."""
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT id, expire_time - heartbeat_time FROM workers"))
        return {worker_id: lifetime for worker_id, lifetime in rows}


async def test_a_beat_extends_that_worker_by_its_ttl_and_says_when_it_is_gone(
    engine: AsyncEngine,
) -> None:
    workers = WorkerStore(engine)
    beating, other, stopped = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    for worker_id in (beating, other, stopped):
        await _register(workers, worker_id, ttl=5)
    await workers.stop(stopped)

    assert await workers.beat(beating, ttl=3600) is True
    lifetimes = await _lifetimes(engine)
    assert lifetimes[beating] == timedelta(hours=1)
    assert lifetimes[other] == lifetimes[stopped] == timedelta(seconds=5)
    assert await workers.beat(beating, ttl=90) is True
    assert (await _lifetimes(engine))[beating] == timedelta(seconds=90)

    # A stopped worker stays stopped; one never registered (or pruned) is gone.
    assert await workers.beat(stopped, ttl=3600) is False
    assert await workers.beat(uuid.uuid4(), ttl=3600) is False
    assert (await _lifetimes(engine))[stopped] == timedelta(seconds=5)
    assert await workers.renew(stopped, ttl=3600) is None
    assert await workers.renew(other, ttl=60) == (["demo.echo"], ["jobplane.default"])
    assert (await _lifetimes(engine))[other] == timedelta(minutes=1)


async def test_a_keys_record_is_read_back_whole(engine: AsyncEngine) -> None:
    keys = KeyStore(engine)
    tenant_key = await keys.create("acme")
    worker_key = await keys.create_worker()
    async with engine.connect() as conn:
        stored = {
            key_id: (prefix, created)
            for key_id, prefix, created in await conn.execute(
                text("SELECT key_id, prefix, create_time FROM api_keys")
            )
        }

    info = await keys.get_key(tenant_key.key_id)
    assert (info.key_id, info.tenant, info.tenant_id, info.scope) == (
        tenant_key.key_id,
        "acme",
        tenant_key.tenant_id,
        KeyScope.TENANT,
    )
    assert (info.prefix, info.create_time) == stored[tenant_key.key_id]
    assert tenant_key.key.startswith(info.prefix) and len(info.prefix) > 3
    assert (info.revoke_time, info.last_used_time, info.active) == (None, None, True)

    worker = await keys.get_key(worker_key.key_id)
    assert (worker.tenant, worker.tenant_id, worker.scope, worker.active) == (
        "",
        None,
        KeyScope.WORKER,
        True,
    )
    # The new keys say what they are, as their records do.
    assert (tenant_key.tenant, tenant_key.scope) == ("acme", KeyScope.TENANT)
    assert (worker_key.tenant, worker_key.tenant_id, worker_key.scope) == (
        "",
        None,
        KeyScope.WORKER,
    )
    assert (worker.prefix, worker.create_time) == stored[worker_key.key_id]

    # Used: the time of its use; revoked later: not active until then, then not.
    assert await keys.resolve(tenant_key.key) is not None
    used = await keys.get_key(tenant_key.key_id)
    assert used.last_used_time is not None and used.last_used_time >= used.create_time
    later = await keys.revoke(tenant_key.key_id, after=3600)
    assert later.active is True and later.revoke_time is not None
    assert later.revoke_time - later.create_time > timedelta(minutes=59)
    revoked = await keys.revoke(worker_key.key_id)
    assert revoked.active is False and revoked.revoke_time is not None
    listed = {k.key_id: k for k in await keys.list_keys()}
    assert listed[worker_key.key_id] == revoked
    assert listed[tenant_key.key_id] == await keys.get_key(tenant_key.key_id)
    assert [k.key_id for k in await keys.list_keys("acme")] == [tenant_key.key_id]


async def test_a_claim_of_an_ended_or_running_job_says_its_state(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    jobs = [await client.submit("demo.echo", {"n": n}) for n in range(4)]
    envelopes = [await bare.envelope(j.id) for j in jobs]
    attempts = []
    for envelope in envelopes[:3]:
        claim = await store.claim(envelope)
        assert claim.attempt is not None
        attempts.append(claim.attempt)
    await store.succeed(attempts[0], {"ok": True})
    await store.fail(attempts[1], "BAD_INPUT", "no", retryable=False)
    await client.cancel(jobs[3].name)  # while QUEUED

    for envelope, state in zip(
        [envelopes[0], envelopes[1], envelopes[3]],
        [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED],
        strict=True,
    ):
        for claim in (
            await store.claim(envelope),
            await store.refused_claim(store.claim_request(envelope)),
        ):
            assert (claim.status, claim.state, claim.attempt) == (
                ClaimStatus.FINISHED,
                state,
                None,
            )
    running = await store.claim(envelopes[2])
    assert (running.status, running.state, running.attempt) == (
        ClaimStatus.IN_FLIGHT,
        JobState.RUNNING,
        None,
    )
    assert running.lease_expires_at is not None
    assert running.lease_expires_at > datetime.now(UTC) + timedelta(seconds=20)
