"""The fair claim's cost (ADR-0042): the tenants waiting and the credit, never the backlog.

A tenant whose few dispatches wait behind another tenant's long backlog (or
a high queue's behind a low one's) must not make every claim read the
backlog: the claim runs every 0.1 s while credit is spent. Each test reads
the plan the database chose (EXPLAIN ANALYZE, after an ANALYZE as the
sweeper's would run) and counts the rows its scans read.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobSpec
from jobplane.store.db import Database
from jobplane.store.fair import FAIR_CLAIM, FairRound
from jobplane.topology import Topology
from tests.support import services
from tests.support.parts import Started
from tests.support.priorities import two_class_topology
from tests.support.stack import Stack, start_stack

WORK = "fair.work"
BACKLOG = 1000
CREDIT = 8


def _rows_read(node: dict[str, Any]) -> int:
    """Rows the plan's scans produced or removed by a filter, over all their loops."""
    own = 0
    if "Scan" in node["Node Type"] and node["Node Type"] not in ("CTE Scan", "WorkTable Scan"):
        per_loop = int(node.get("Actual Rows", 0)) + int(node.get("Rows Removed by Filter", 0))
        own = per_loop * int(node.get("Actual Loops", 1))
    return own + sum(_rows_read(child) for child in node.get("Plans", []))


async def _claim_plan(db: Database, credits: dict[str, tuple[int, int]]) -> dict[str, Any]:
    binds = FairRound().binds(credits, limit=100)
    binds["skip"] = []
    async with db.begin() as conn:
        await conn.execute("ANALYZE outbox")
        plan = await conn.fetch("EXPLAIN (ANALYZE, FORMAT JSON) " + FAIR_CLAIM.text, binds)
    found: dict[str, Any] = plan[0][0][0]["Plan"]
    return found


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
    await stack.client().submit_many([JobSpec(WORK) for _ in range(BACKLOG)])
    other = stack.client(await stack.new_key("globex"))
    await other.submit_many([JobSpec(WORK) for _ in range(3)])

    plan = await _claim_plan(db, {topology.queues[0].name: (CREDIT, 1)})

    # Each tenant's share, counted and locked: both tenants were served.
    assert plan["Actual Rows"] == CREDIT
    # A few index entries per waiting tenant and per credit; the old claim
    # walked acme's whole backlog by due time to find globex's three.
    read = _rows_read(plan)
    assert read <= 10 * CREDIT, (read, plan)


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
    assert plan["Actual Rows"] == 3 + CREDIT
    read = _rows_read(plan)
    assert read <= 10 * CREDIT, (read, plan)
