"""Engines, connections, database creation and migrations.

Every connection is opened by ``asyncpg.connect`` from the DSN
:func:`jobplane.store.dsn.connect_options` makes of the configured URL, so
libpq's URL forms (sslmode, several hosts, target_session_attrs) work the same
for SQLAlchemy's pool, the hot statements' pool and the LISTEN connection.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

import asyncpg
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

from jobplane.store.dsn import connect_options, database_name, with_database


def asyncpg_dsn(url: str) -> str:
    """``url`` (libpq's form, or ``postgresql+asyncpg://…``) as the DSN asyncpg parses."""
    return connect_options(url).dsn


def _engine_url(url: str) -> str:
    """What the engine shows as its URL (it never connects by it: see create_engine).

    A URL SQLAlchemy cannot parse (several hosts) shows as the bare dialect.
    """
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return "postgresql+asyncpg://"
    return parsed.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)


def create_engine(url: str, *, pool_size: int = 10, **kwargs: Any) -> AsyncEngine:
    """The SQLAlchemy async engine every jobplane process uses for its SQL.

    The pool has a fixed size: under load, callers wait for a pooled
    connection instead of opening (and closing) overflow ones, each of which
    costs Postgres a new backend process. A failing statement's error never
    carries its parameters (tenants' payloads) into a message or a log.

    A pooled connection the server has closed while it sat idle (a restart,
    a failover, ``pg_terminate_backend``) is not handed out: the pool checks
    asyncpg's own view of the socket at checkout, which costs no round trip,
    and connects again instead of failing the caller's statement.

    Connections are opened by asyncpg from the libpq-style URL (module
    docstring): SQLAlchemy would hand the URL's parameters (``sslmode``) to
    asyncpg as keyword arguments it does not take.

    Through PgBouncer in transaction pooling (``pgbouncer=true``) the
    dialect keeps no prepared statement either, and prepares each one
    unnamed: a named one would stay on the server connection PgBouncer lent
    for one transaction, and the next statement may get another.
    """
    options = connect_options(url)

    async def connect() -> asyncpg.Connection:
        conn: asyncpg.Connection = await asyncpg.connect(options.dsn, **options.kwargs)
        return conn

    dialect_args: dict[str, Any] = {"async_creator_fn": connect}
    if options.pgbouncer:
        dialect_args["prepared_statement_cache_size"] = 0
        dialect_args["prepared_statement_name_func"] = _unnamed

    def creator() -> Any:
        # What async_creator= does, with the dialect's arguments passed on too.
        return engine.sync_engine.dialect.dbapi.connect(**dialect_args)  # type: ignore[union-attr]

    engine = create_async_engine(
        _engine_url(url),
        creator=creator,
        pool_size=pool_size,
        max_overflow=0,
        pool_pre_ping=False,
        hide_parameters=True,
        **kwargs,
    )
    event.listen(engine.sync_engine.pool, "checkout", _refuse_closed)
    return engine


def _unnamed() -> str:
    # asyncpg prepares a statement named "" as the unnamed one, and prepares it
    # again after a type introspection (whose Sync would let PgBouncer hand the
    # server connection to another client) replaced it.
    return ""


def _refuse_closed(
    dbapi_connection: Any, record: ConnectionPoolEntry, proxy: PoolProxiedConnection
) -> None:
    raw = record.driver_connection
    if isinstance(raw, asyncpg.Connection) and raw.is_closed():
        # The pool discards the connection and connects again in its place.
        raise DisconnectionError("the server closed this pooled connection")


async def connect_raw(url: str) -> asyncpg.Connection:
    """A dedicated asyncpg connection (for LISTEN), outside the pool."""
    options = connect_options(url)
    conn: asyncpg.Connection = await asyncpg.connect(options.dsn, **options.kwargs)
    return conn


async def ensure_database(url: str) -> bool:
    """Create the database named in ``url`` when it is missing; True if created."""
    name = database_name(url)
    if not name:
        raise ValueError("the database URL names no database")
    admin = await connect_raw(with_database(url, "postgres"))
    try:
        exists = await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if exists:
            return False
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        except asyncpg.DuplicateDatabaseError:
            return False
        return True
    finally:
        await admin.close()


def _alembic_upgrade(url: str, revision: str) -> None:
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(resources.files("jobplane.migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.upgrade(config, revision)


async def migrate(url: str, *, revision: str = "head", create: bool = True) -> None:
    """Create the database if asked, then run the Alembic migrations to ``revision``."""
    if create:
        await ensure_database(url)
    # Alembic's env.py runs its own event loop; keep it off ours.
    await asyncio.to_thread(_alembic_upgrade, url, revision)


def autocommit(engine: AsyncEngine) -> AsyncEngine:
    """``engine`` (same pool) running each statement in a transaction of its own.

    For work that is one statement: it saves the BEGIN and COMMIT (or
    ROLLBACK) round trips an explicit transaction costs.
    """
    return engine.execution_options(isolation_level="AUTOCOMMIT")
