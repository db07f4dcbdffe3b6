"""``pgbouncer=true`` on the real Postgres: sessions keep no prepared statement (ADR-0048).

PgBouncer in transaction pooling lends a server connection for one transaction:
a statement prepared by name on it may be gone (or another client's) by the
next. With the parameter, neither pool leaves a named statement behind, and
values still come and go as on the direct path.
"""

from __future__ import annotations

import uuid

from sqlalchemy import text

from jobplane.store.db import Database
from jobplane.store.engine import autocommit, create_engine

PREPARED = "SELECT count(*) FROM pg_prepared_statements"


def _pooled(url: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}pgbouncer=true"


async def test_the_hot_pool_prepares_nothing_by_name(database_url: str) -> None:
    for url, named in ((database_url, True), (_pooled(database_url), False)):
        async with Database(url, size=1) as db, db.connect() as conn:
            for n in range(3):
                row = await conn.fetchrow(
                    "SELECT CAST(:doc AS jsonb) AS doc, CAST(:id AS uuid) AS id",
                    {"doc": f'{{"n": {n}}}', "id": str(uuid.UUID(int=n))},
                )
                assert row is not None
                assert row["doc"] == {"n": n}
                assert row["id"] == uuid.UUID(int=n)
            assert (await conn.fetchval(PREPARED) > 0) is named, url


async def test_the_engine_prepares_nothing_by_name(database_url: str) -> None:
    for url, named in ((database_url, True), (_pooled(database_url), False)):
        engine = create_engine(url, pool_size=1)
        try:
            for each in (engine, autocommit(engine)):
                async with each.connect() as conn:
                    for n in range(3):
                        doc = await conn.scalar(text("SELECT CAST(:doc AS jsonb)"), {"doc": "[1]"})
                        assert doc == [1], n
                    assert ((await conn.scalar(text(PREPARED)) or 0) > 0) is named, url
        finally:
            await engine.dispose()
