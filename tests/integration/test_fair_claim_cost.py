"""The fair claim's cost (ADR-0042): the tenants waiting and the credit, never the backlog.

A tenant whose few dispatches wait behind another tenant's long backlog (or
a high queue's behind a low one's) must not make every claim read the
backlog: the claim runs every 0.1 s while credit is spent. Each test reads
the plan the database chose for the relay's claim (its one statement and
binds, EXPLAIN ANALYZE, after an ANALYZE as the sweeper's would run) and
counts, in the part of the plan that claims dispatches, the rows its scans
read and the pages it touched.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobSpec
from jobplane.store.db import Database
from jobplane.store.fair import FairClaim, FairRound
from jobplane.store.outbox import claim_statement
from jobplane.topology import Topology
from tests.support import services
from tests.support.parts import Started
from tests.support.plans import dispatch_parts, part, rows_read
from tests.support.priorities import two_class_topology
from tests.support.stack import Stack, start_stack

WORK = "fair.work"
BACKLOG = 1000
CREDIT = 8
# One tenant's backlog, and the few dispatches of another queued behind it.
TENANT_BACKLOG = 20_000
FEW = 5


async def _one_time_each(db: Database, tenant: uuid.UUID) -> None:
    """Give the tenant's dispatches a due time each, a millisecond apart, as dispatches
    submitted one by one have: a batch's share its commit's time, and the index
    holds equal keys as one entry, which hides how much of it a scan passes over."""
    async with db.begin() as conn:
        await conn.execute(
            "UPDATE outbox o SET available_at = o.available_at - n.k * interval '1 ms' "
            "FROM (SELECT id, row_number() OVER (ORDER BY id) AS k FROM outbox "
            "      WHERE tenant_id = :tenant AND kind = 'job.dispatch') n "
            "WHERE o.id = n.id",
            {"tenant": tenant},
        )


async def _claim_plan(db: Database, credits: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """The plan of the relay's fair claim (its statement and binds: OutboxStore's)."""
    statement, binds = claim_statement(100, fair=FairClaim(FairRound(), credits))
    async with db.begin() as conn:
        await conn.execute("ANALYZE outbox")
        plan = await conn.fetch("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement.text, binds)
    found: dict[str, Any] = plan[0][0][0]["Plan"]
    return found


def _cost(plan: dict[str, Any]) -> tuple[int, int]:
    """Rows the claim's dispatches' part read, and its buffers (index pages a scan
    passes over inside the index count here, not in the rows)."""
    nodes = dispatch_parts(plan)
    buffers = sum(n["Shared Hit Blocks"] + n.get("Shared Read Blocks", 0) for n in nodes)
    return sum(rows_read(n) for n in nodes), buffers


async def test_a_tenant_behind_anothers_backlog_costs_a_claim_the_credit_not_the_backlog(
    engine: AsyncEngine,
    db: Database,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
) -> None:
    stack: Stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    key, other = await stack.server.keys.create_key("globex")
    # The backlog goes to the tenant after the other in outbox_dispatch_fair: a
    # scan of the few that did not stop at their end would pass over all of it.
    clients = {stack.tenant_id: stack.client(), other: stack.client(key)}
    first, last = sorted(clients)
    for _ in range(0, TENANT_BACKLOG, 1000):
        await clients[last].submit_many([JobSpec(WORK) for _ in range(1000)])
    await _one_time_each(db, last)
    await clients[first].submit_many([JobSpec(WORK) for _ in range(FEW)])

    plan = await _claim_plan(db, {topology.queues[0].name: (CREDIT, 1)})

    # Each tenant's share, counted and locked: both tenants were served.
    assert part(plan, "claimed")["Actual Rows"] == CREDIT
    # A few index entries per waiting tenant and per credit: the old claim
    # walked the backlog by due time to find the other tenant's five. And a
    # few pages: a range of outbox_dispatch_fair that does not stop at the
    # tenant's end passes over the backlog's entries inside the index (a few
    # hundred pages, and no row of it in the plan's counts).
    read, buffers = _cost(plan)
    assert read <= 10 * CREDIT, (read, plan)
    assert buffers < 100, (buffers, plan)


async def test_a_high_queues_jobs_behind_a_low_backlog_cost_a_claim_the_credit_not_the_backlog(
    engine: AsyncEngine,
    db: Database,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
) -> None:
    pair = two_class_topology(topology)
    stack: Stack = await started(
        start_stack(engine, database_url, amqp_url, pair, relay=False, worker=False)
    )
    try:
        client = stack.client()
        await client.submit_many([JobSpec("lo.work") for _ in range(BACKLOG)])
        await client.submit_many([JobSpec("hi.a.work") for _ in range(3)])
        high, low = pair.queues
        plan = await _claim_plan(db, {high.name: (CREDIT, 0), low.name: (CREDIT, 2)})
    finally:
        await services.delete_topology(amqp_url, pair)

    # The high queue's three, and the low queue's credit.
    assert part(plan, "claimed")["Actual Rows"] == 3 + CREDIT
    read, _ = _cost(plan)
    assert read <= 10 * CREDIT, (read, plan)
