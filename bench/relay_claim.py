"""`python -m bench.relay_claim`: the relay's claim as one statement against its two parts.

ADR-0053 made the relay's claim one statement (`outbox._FAIR_CLAIM_BOTH`):
the fair claim of dispatches and the claim of the other rows, which ran as
two statements, each a round trip. The relay no longer runs those two: they
are kept here (`_FAIR_CLAIM`, `_OTHERS_CLAIM`) to compare. Both arms run on
one connection to a database of their own (migrated, no server, relay or
worker), over ``--due`` due dispatches, in transactions as the relay's
(BEGIN, the claim, COMMIT; nothing is marked, so every claim finds the same
rows), alternating which goes first. Printed: each arm's wall time per
claim, p50 and mean, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import Any

import asyncpg
from sqlalchemy import text

from jobplane.store import fair, outbox
from jobplane.store.db import Sql, positional
from jobplane.store.engine import asyncpg_dsn, migrate
from tests.support import services

# The claim as two statements, as before ADR-0053: the fair claim of dispatches,
# then the claim of the other rows.
_FAIR_CLAIM = text(f"{fair.FAIR_CTES} SELECT * FROM claimed ORDER BY {fair.FAIR_ORDER}")
_OTHERS_CLAIM = text(outbox._CLAIM_SQL.format(where=f"available_at <= now() AND {outbox._OTHERS}"))
_DUE = """
    INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id, queue)
    SELECT gen_random_uuid(), $1, gen_random_uuid(), 'bench.noop', '', 'default'
    FROM generate_series(1, $2)
"""


async def _claim(conn: asyncpg.Connection, parts: list[tuple[Sql, dict[str, Any]]]) -> float:
    """Seconds of one claim made of ``parts``, in a transaction of its own."""
    started = time.perf_counter()
    async with conn.transaction():
        for sql, binds in parts:
            await conn.fetch(sql.text, *sql.args(binds))
    return time.perf_counter() - started


async def measure(due: int, claims: int, limit: int) -> dict[str, list[float]]:
    """Each arm's seconds per claim over ``due`` due dispatches."""
    name = f"jp_bench_claim_{uuid.uuid4().hex[:10]}"
    await services.create_database(name)
    url = services.pg_url(name)
    try:
        await migrate(url)
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            tenant = uuid.uuid4()
            await conn.execute("INSERT INTO tenants (id, name) VALUES ($1, 'bench')", tenant)
            # The dispatches name no job: no foreign key is checked for them.
            await conn.execute("SET session_replication_role = replica")
            await conn.execute(_DUE, tenant, due)
            await conn.execute("SET session_replication_role = origin")
            await conn.execute("ANALYZE outbox")
            credits = {"default": (limit, 1)}
            one, binds = outbox.claim_statement(
                limit, fair=fair.FairClaim(fair.FairRound(), credits)
            )
            arms: dict[str, list[tuple[Sql, dict[str, Any]]]] = {
                "two statements": [
                    (positional(_FAIR_CLAIM), binds),
                    (positional(_OTHERS_CLAIM), {"limit": limit}),
                ],
                "one statement": [(positional(one), binds)],
            }
            seconds: dict[str, list[float]] = {arm: [] for arm in arms}
            order = list(arms)
            for _ in range(claims):
                for arm in order:
                    seconds[arm].append(await _claim(conn, arms[arm]))
                order.reverse()
            return seconds
        finally:
            await conn.close()
    finally:
        await services.drop_database(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--due", type=int, default=1, help="due dispatches in the outbox")
    parser.add_argument("--claims", type=int, default=500, help="claims of each arm")
    parser.add_argument("--limit", type=int, default=100, help="the relay's batch size")
    args = parser.parse_args()
    seconds = asyncio.run(measure(args.due, args.claims, args.limit))
    p50 = {arm: statistics.median(s) * 1000 for arm, s in seconds.items()}
    for arm, values in seconds.items():
        mean = statistics.mean(values) * 1000
        print(f"{arm}: p50 {p50[arm]:.3f} ms, mean {mean:.3f} ms, {len(values)} claims")
    print(f"one / two statements, p50: {p50['one statement'] / p50['two statements']:.3f}")


if __name__ == "__main__":
    main()
