"""The SQL API's files (``jobplane/store/sql``) are what the migrations leave in a database.

A migrated database's functions in schema ``jobplane`` (and their triggers)
are read back as Postgres prints them; then every file is installed over
them (``CREATE OR REPLACE``) in a transaction that is rolled back, and read
back again. The two readings are equal only when each file defines its
objects exactly as the last migration that touched them did: an edited
file without a migration fails, as does a migration whose file was left
behind (docs/adr/0035-sql-api-as-files.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from jobplane.store.engine import asyncpg_dsn
from jobplane.store.sqlapi import sql_files

# Every object of the schema, as Postgres prints it back: a function's whole
# CREATE statement (arguments, defaults, options such as search_path, body)
# and who may execute it; a trigger on a jobplane function, whole.
_FUNCTIONS = """
SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid), coalesce(p.proacl::text, '')
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'jobplane'
"""
_TRIGGERS = """
SELECT t.tgname, pg_get_triggerdef(t.oid), ''
FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE n.nspname = 'jobplane' AND NOT t.tgisinternal
"""


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to a database the test run migrated to head."""
    connection: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(database_url))
    yield connection
    await connection.close()


async def _definitions(conn: asyncpg.Connection) -> dict[str, tuple[str, str]]:
    rows = [*await conn.fetch(_FUNCTIONS), *await conn.fetch(_TRIGGERS)]
    return {row[0]: (row[1], row[2]) for row in rows}


async def _drift(conn: asyncpg.Connection, files: dict[str, str]) -> list[str]:
    """The objects whose definition ``files`` change (or add) in the migrated database."""
    migrated = await _definitions(conn)
    transaction = conn.transaction()
    await transaction.start()
    try:
        for sql in files.values():
            await conn.execute(sql)
        installed = await _definitions(conn)
    finally:
        await transaction.rollback()
    return sorted(
        name
        for name in migrated.keys() | installed.keys()
        if migrated.get(name) != installed.get(name)
    )


async def _schema(conn: asyncpg.Connection) -> str:
    """The schema the migrations ran in, quoted as they fixed it in search_path."""
    schema: str = await conn.fetchval("SELECT quote_ident(current_schema())")
    return schema


async def test_a_migrated_database_defines_the_sql_api_as_its_files(
    conn: asyncpg.Connection,
) -> None:
    files = sql_files(await _schema(conn))
    assert {"submit_job", "publish_event"} <= files.keys()
    drift = await _drift(conn, files)
    assert not drift, (
        f"{drift} differ between jobplane/store/sql and the migrations: a change to a "
        "file is a new migration that installs a frozen copy of it "
        "(migrations/jobplane/migrations/sql/)"
    )


async def test_every_function_of_the_schema_has_its_file(conn: asyncpg.Connection) -> None:
    names = {
        row[0]
        for row in await conn.fetch(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'jobplane'"
        )
    }
    assert names == sql_files(await _schema(conn)).keys()


async def test_an_edit_to_a_file_alone_is_drift(conn: asyncpg.Connection) -> None:
    """The check sees a change inside a body, and one in a function's options."""
    files = sql_files(await _schema(conn))
    body = dict(files, submit_job=files["submit_job"].replace("RETURN v_id;", "RETURN (v_id);"))
    assert await _drift(conn, body) == [
        "jobplane.submit_job(text,text,jsonb,text,text,integer,jsonb,double precision,"
        "timestamp with time zone,interval,text,integer,text,timestamp with time zone,interval,"
        "uuid[],text)"
    ]
    options = dict(files, publish_event=files["publish_event"].replace("SECURITY DEFINER\n", ""))
    assert len(await _drift(conn, options)) == 1
    trigger = dict(
        files,
        record_job_blobs=files["record_job_blobs"].replace(
            "strpos(NEW.payload::text, 'blobs/') > 0", "strpos(NEW.payload::text, 'blob/') > 0"
        ),
    )
    assert await _drift(conn, trigger) == ["jobs_record_blobs_insert"]
