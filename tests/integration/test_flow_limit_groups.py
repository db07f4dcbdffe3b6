"""Claim groups under flow limits and concurrency keys: a group and a claim alone
that need the same two advisory locks (a concurrency key's, a queue's per-tenant
budget's) never deadlock, and a group decides a limit only for its own rows."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.envelope import Envelope
from jobplane.store.attempts import AttemptStore, ClaimStatus
from jobplane.topology import Topology
from tests.support.parts import Started
from tests.support.stack import one_running_per_tenant

_ROW = text("SELECT dispatch_id, tenant_id, type FROM jobs WHERE id = :id")


async def _envelope(engine: AsyncEngine, job_id: str) -> Envelope:
    async with engine.connect() as conn:
        row = (await conn.execute(_ROW, {"id": job_id})).one()
    return Envelope(uuid.UUID(str(row[0])), uuid.UUID(job_id), uuid.UUID(str(row[1])), row[2])


async def _claim_group(store: AttemptStore, engine: AsyncEngine, ids: list[str]) -> list[Any]:
    requests = [store.claim_request(await _envelope(engine, i)) for i in ids]
    claimed = await store.claim_many(requests)
    return [
        c.status if c is not None else (await store.refused_claim(r)).status
        for r, c in zip(requests, claimed, strict=True)
    ]


async def test_a_claim_group_and_a_claim_alone_do_not_deadlock(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await one_running_per_tenant(engine, database_url, amqp_url, topology, started)
    client = stack.client()
    plain = await client.submit("cross.op", {})
    keyed, alone_keyed = [await client.submit("cross.op", {}, concurrency_key="k") for _ in "ab"]
    store = AttemptStore(stack.db, lease_seconds=30.0)
    async with engine.connect() as blocker:
        # Holds the key's lock: a keyed job's claim alone waits for it, then for
        # the tenant's budget; the group takes the budget (its plain job), then
        # waits for the key (its keyed job).
        await blocker.execute(
            text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 40))"),
            {"key": f"{stack.tenant_id}/k"},
        )
        alone = asyncio.create_task(store.claim(await _envelope(engine, alone_keyed.id)))
        await asyncio.sleep(0.3)
        group = asyncio.create_task(_claim_group(store, engine, [plain.id, keyed.id]))
        await asyncio.sleep(0.3)
        await blocker.rollback()
    one, two = await asyncio.gather(alone, group)
    # One RUNNING of the tenant; the others held.
    assert sorted(s.value for s in [one.status, *two]) == ["claimed", "held", "held"]


async def test_a_group_decides_a_limit_only_for_its_own_rows(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await one_running_per_tenant(engine, database_url, amqp_url, topology, started)
    client = stack.client()
    mine = [await client.submit("own.op", {}) for _ in range(2)]
    store = AttemptStore(stack.db, lease_seconds=30.0)
    async with engine.connect() as blocker:
        # Another's budget is busy: a group that asks about jobs of that tenant
        # it was not given would wait here.
        other = await stack.new_key("globex")
        their = stack.client(other)
        job = await their.submit("own.op", {})
        globex = (await _envelope(engine, job.id)).tenant_id
        queue = topology.queues[0].name
        await blocker.execute(
            text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 43))"),
            {"key": f"queue/{queue}/{globex}"},
        )
        claimed = await asyncio.wait_for(_claim_group(store, engine, [j.id for j in mine]), 20)
        await blocker.rollback()
    # The tenant's budget allows one.
    assert claimed == [ClaimStatus.CLAIMED, ClaimStatus.HELD]
