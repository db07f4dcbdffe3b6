"""The sweeper analyzes a young table that outgrew its statistics, and Postgres
plans the statements prepared on the empty table again."""

from __future__ import annotations

import re

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.sweeps import HOT_TABLES, SweepStore

TABLE = "t_growing"
# Autovacuum's own ANALYZE of the table mid-test would reset what these count.
NO_AUTOVACUUM = "WITH (autovacuum_enabled = false)"


async def _add_rows(engine: AsyncEngine, first: int, count: int, *, table: str = TABLE) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                f"INSERT INTO {table} SELECT g, 'x' "
                "FROM generate_series(CAST(:a AS int), CAST(:b AS int)) g"
            ),
            {"a": first, "b": first + count - 1},
        )
    # This connection's counts reach the shared statistics now, not within a second.
    async with engine.connect() as conn:
        await conn.execute(text("SELECT pg_stat_force_next_flush()"))
        await conn.commit()


async def _last_analyze(engine: AsyncEngine) -> object:
    async with engine.connect() as conn:
        return (
            await conn.execute(
                text("SELECT last_analyze FROM pg_stat_user_tables WHERE relname = :t"),
                {"t": TABLE},
            )
        ).scalar_one()


async def test_a_table_is_analyzed_when_its_changes_outnumber_its_rows(
    engine: AsyncEngine,
) -> None:
    store = SweepStore(engine)
    async with engine.begin() as conn:
        await conn.execute(
            text(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, v text) " + NO_AUTOVACUUM)
        )
    tables = (TABLE,)
    await _add_rows(engine, 1, 500)
    assert await store.analyze_grown(tables=tables) == []  # under the minimum of changes
    await _add_rows(engine, 501, 1000)
    assert await store.analyze_grown(tables=tables) == [TABLE]
    assert await _last_analyze(engine) is not None
    assert await store.analyze_grown(tables=tables) == []  # nothing changed since
    # 1,500 rows now: 1,000 more changes do not outnumber them; 2,000 do.
    await _add_rows(engine, 1501, 1000)
    assert await store.analyze_grown(tables=tables) == []
    await _add_rows(engine, 2501, 1000)
    assert await store.analyze_grown(tables=tables) == [TABLE]


async def test_the_minimum_is_exactly_1000_changes(engine: AsyncEngine) -> None:
    # docs/testing.md and ADR-0031: at 1,000 changes, not below. Three empty
    # tables given 999, 1,000 and 1,001 rows: every one's changes outnumber
    # its rows (none), so the minimum alone decides.
    tables = {count: f"t_changes_{count}" for count in (999, 1000, 1001)}
    async with engine.begin() as conn:
        for table in tables.values():
            await conn.execute(
                text(f"CREATE TABLE {table} (id int PRIMARY KEY, v text) " + NO_AUTOVACUUM)
            )
    for count, table in tables.items():
        await _add_rows(engine, 1, count, table=table)
    store = SweepStore(engine)
    assert await store.analyze_grown(tables=tuple(tables.values())) == [
        tables[1000],
        tables[1001],
    ]


async def test_a_plan_made_on_the_empty_table_is_made_again(engine: AsyncEngine) -> None:
    store = SweepStore(engine)
    async with engine.connect() as conn:
        await conn.execute(
            text(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, v text) " + NO_AUTOVACUUM)
        )
        await conn.commit()
        # A statement prepared and run while the table is empty, on a generic
        # plan (as the hot pool's statements settle on after five runs; forced
        # here, so the planner's choice between the two is not what is tested).
        await conn.execute(text("SET plan_cache_mode = force_generic_plan"))
        await conn.execute(text(f"PREPARE by_v(text) AS SELECT id FROM {TABLE} WHERE v = $1"))
        await conn.execute(text("EXECUTE by_v('x')"))

        async def estimated_rows() -> int:
            top = (await conn.execute(text("EXPLAIN EXECUTE by_v('x')"))).scalars().first()
            match = re.search(r"rows=(\d+)", top or "")
            assert match is not None, top
            return int(match[1])

        await conn.commit()
        await _add_rows(engine, 1, 50_000)
        # The plan kept is the empty table's: its estimate knows nothing of the rows.
        assert await estimated_rows() < 1_000
        await conn.commit()
        assert await store.analyze_grown(tables=(TABLE,)) == [TABLE]
        # Postgres dropped it with the table's new statistics and planned again.
        assert await estimated_rows() >= 10_000


async def test_the_hot_tables_are_the_schemas(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        found = set(
            (
                await conn.execute(
                    text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
                )
            ).scalars()
        )
    assert set(HOT_TABLES) <= found
    # A migrated, empty database: nothing to analyze, and no error for asking.
    assert await SweepStore(engine).analyze_grown() == []
