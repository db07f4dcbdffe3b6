"""`python -m bench.fair_claim_plans`: what the relay's fair claim reads, backlog by backlog.

Each scenario is a database of its own (migrated, no server, relay or
worker) holding tenants' waiting dispatches in one queue, each dispatch due
at a time of its own (a millisecond apart): a number of them and how far
from now their due times start (negative: due). The relay's claim
(`outbox.claim_statement`, fair, a batch of 100) is EXPLAINed with ANALYZE
and BUFFERS once, after an ANALYZE. Printed per scenario: the rows claimed,
the statement's buffers, and each scan of the outbox in the dispatches' part
(part:index:rows per loop x loops/buffers). The buffers are the figure: an
index scan passes over entries inside the index without counting them as
rows.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg

from jobplane.store import fair, outbox
from jobplane.store.db import positional
from jobplane.store.engine import asyncpg_dsn, migrate
from tests.support import services

_WAITING = """
    INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id, queue, available_at)
    SELECT gen_random_uuid(), $1, gen_random_uuid(), 'bench.noop', '', 'default',
           now() + $3 * interval '1 s' - g * interval '1 ms'
    FROM generate_series(1, $2) g
"""
#: (dispatches, seconds from now to the first one's due time) per tenant, in
#: the tenants' order in outbox_dispatch_fair; the queue's credit.
SCENARIOS: list[tuple[str, list[tuple[int, int]], int]] = [
    ("5 due before another's 20,000 due", [(5, -60), (20_000, -60)], 8),
    ("5 due before another's 20,000 due", [(5, -60), (20_000, -60)], 150),
    ("20,000 due before another's 5 due", [(20_000, -60), (5, -60)], 150),
    ("5 due before another's 20,000 due tomorrow", [(5, -60), (20_000, 86_400)], 150),
    ("1 due before another's 20,000 due", [(1, -60), (20_000, -3600)], 150),
    ("50 tenants, 100 due each", [(100, -60)] * 50, 150),
    ("one tenant, 20,000 due", [(20_000, -60)], 150),
]


def _scans(node: dict[str, Any], found: list[str], part: str = "") -> list[str]:
    name = str(node.get("Subplan Name", ""))
    if name.startswith("CTE "):
        part = name.removeprefix("CTE ")
    if node.get("Relation Name") == "outbox" and "Index Name" in node and part != "others":
        found.append(
            f"{part}:{node['Index Name']}:{node['Actual Rows']}x{node['Actual Loops']}"
            f"/{node['Shared Hit Blocks'] + node.get('Shared Read Blocks', 0)}"
        )
    for child in node.get("Plans", []):
        _scans(child, found, part)
    return found


async def scenario(tenants: list[tuple[int, int]], credit: int) -> dict[str, Any]:
    """The fair claim's plan over these tenants' waiting dispatches."""
    name = f"jp_bench_plans_{uuid.uuid4().hex[:10]}"
    await services.create_database(name)
    url = services.pg_url(name)
    try:
        await migrate(url)
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            # The dispatches name no job: no foreign key is checked for them.
            await conn.execute("SET session_replication_role = replica")
            for i, (count, start) in enumerate(tenants):
                tenant = uuid.UUID(int=i + 1)
                await conn.execute(
                    "INSERT INTO tenants (id, name) VALUES ($1, $2)", tenant, f"t{i}"
                )
                await conn.execute(_WAITING, tenant, count, start)
            await conn.execute("ANALYZE outbox")
            claim = fair.FairClaim(fair.FairRound(), {"default": (credit, 1)})
            statement, binds = outbox.claim_statement(100, fair=claim)
            sql = positional(statement)
            async with conn.transaction():
                answer = await conn.fetchval(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql.text, *sql.args(binds)
                )
            plan: dict[str, Any] = json.loads(answer)[0]["Plan"]
            return plan
        finally:
            await conn.close()
    finally:
        await services.drop_database(name)


async def run() -> None:
    for label, tenants, credit in SCENARIOS:
        plan = await scenario(tenants, credit)
        buffers = plan["Shared Hit Blocks"] + plan.get("Shared Read Blocks", 0)
        print(
            f"{label}, credit {credit}: {plan['Actual Rows']} claimed, {buffers} buffers; "
            + " ".join(_scans(plan, []))
        )


def main() -> None:
    asyncio.run(run())


if __name__ == "__main__":
    main()
