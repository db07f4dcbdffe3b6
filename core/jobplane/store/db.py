"""The hot statements' way to Postgres: an asyncpg pool, no ORM layer in between.

Every job passes through a handful of statements — submit, claim, progress,
outcome, the relay's claim and mark, the watch read — and each of them through
SQLAlchemy's execution layer cost 200-300 µs of the caller's CPU (building an
execution context, result metadata for a textual statement on every call, a
greenlet switch into the driver and back), several times what asyncpg itself
spends on the statement (docs/performance.md). Those statements run here,
straight on asyncpg (ADR-0030):

- The SQL is the same text: ``:name`` binds (as in SQLAlchemy's ``text()``,
  whose rules they follow) are rewritten to ``$n`` once per statement and
  the binds are passed by position from then on.
- asyncpg prepares each statement once per connection and keeps it for
  half a minute (the cache is sized for every statement the machine
  compiles, however long): then it is planned again for the tables as they
  have grown.
- json and jsonb come and go as SQLAlchemy's asyncpg dialect passes them: a
  value bound to one is JSON text already (``rows.dumps``); a column read is
  decoded. The same statement gives the same values on either path.
- A failure is raised as SQLAlchemy's ``DBAPIError`` family (``IntegrityError``
  for class 23), carrying asyncpg's error as ``orig`` and never the binds:
  the callers' one vocabulary of database errors, and ``store.down``'s
  classification, work unchanged whichever path ran the statement.
- A connection goes back to the pool without asyncpg's reset statement (no
  statement here leaves session state behind; an open transaction is still
  rolled back), which would cost a round trip per use.
- JIT compilation is off for these sessions: the statements are short, and
  a plan Postgres misestimates as costly would be compiled on every run.

Each part that runs hot statements (the server, a worker, a relay) takes a
:class:`Database` from its caller, as it takes the engine (the commands make
one in their lifespan), or owns one of its own: opened when it starts, closed
when it stops, like its LISTEN connections.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeAlias

import asyncpg
import structlog
from asyncpg.pool import PoolConnectionProxy
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.sql.elements import TextClause

from jobplane.store.down import PoolExhausted
from jobplane.store.dsn import ConnectOptions, connect_options

log = structlog.get_logger("jobplane.db")

# The bind syntax of SQLAlchemy's text() (its own two expressions): ":name",
# not "::type", and "\:name" for a colon that is not a bind.
_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?![:\w])")
_ESCAPED = re.compile(r"\\(:\w*)(?![:\w])")

#: Prepared statements kept per connection: every statement of the hot paths
#: and the machine's compiled transitions, with room to spare.
STATEMENT_CACHE_SIZE = 512
#: The longest statement text kept prepared (a grouped transition's is ~20 KiB).
MAX_CACHEABLE_STATEMENT = 1024 * 1024
#: Seconds a prepared statement is kept before it is prepared again. Postgres
#: settles on a generic plan after a statement's first runs, costed for the
#: tables as they are then: made while a new deployment's jobs table held a
#: few rows, a plan that scans it stays cheap-looking as it grows to millions.
#: Prepared again, the statement is planned for the tables as they are now.
STATEMENT_LIFETIME = 30


@dataclass(frozen=True, slots=True)
class Sql:
    """A statement with ``$n`` placeholders and the bind name each stands for."""

    text: str
    names: tuple[str, ...]

    def args(self, binds: Mapping[str, Any]) -> list[Any]:
        """The positional arguments for ``binds`` (a missing one is a KeyError)."""
        return [binds[name] for name in self.names]


_COMPILED: dict[str, Sql] = {}
#: A connection of the pool, as asyncpg hands it out.
Raw: TypeAlias = "PoolConnectionProxy[asyncpg.Record]"


def positional(statement: TextClause | str) -> Sql:
    """``statement`` with its ``:name`` binds as ``$1``, ``$2`` …; computed once per text.

    A name bound twice is one placeholder, as in SQLAlchemy's ``text()``.
    """
    source = statement.text if isinstance(statement, TextClause) else statement
    found = _COMPILED.get(source)
    if found is not None:
        return found
    order: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        index = order.setdefault(match[1], len(order) + 1)
        return f"${index}"

    sql = _ESCAPED.sub(lambda m: m[1], _BIND.sub(number, source))
    compiled = Sql(sql, tuple(order))
    _COMPILED[source] = compiled
    return compiled


def _wrapped(exc: BaseException, sql: str, conn: Raw | None) -> DBAPIError:
    """``exc`` as the DBAPIError SQLAlchemy would have raised for it (binds hidden).

    A connection it left unusable is closed here, so the pool replaces it
    instead of handing it to the next caller.
    """
    state = getattr(exc, "sqlstate", None)
    kind = IntegrityError if isinstance(state, str) and state.startswith("23") else DBAPIError
    lost = isinstance(exc, _LOST) or (conn is not None and _closed(conn))
    if lost and conn is not None and not _closed(conn):
        conn.terminate()
    return kind(sql, None, exc, hide_parameters=True, connection_invalidated=lost)


def _closed(conn: Raw) -> bool:
    """Whether ``conn`` is closed: a connection lost mid-statement may have been
    handed back to the pool already, and its proxy answers nothing more."""
    try:
        return conn.is_closed()
    except asyncpg.InterfaceError:
        return True


# The connection is gone (the statement may be fine). asyncpg's internal
# error is a protocol caught in a state it should not be in: after a session
# the server ended mid-statement, say.
_LOST: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.InternalClientError,
)
# What a statement on asyncpg can raise besides a cancellation: Postgres's
# refusals, the driver's own, and the socket's (TimeoutError is an OSError).
_FAILURES: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
)


class Conn:
    """One pooled connection: statements with ``:name`` binds, rows as asyncpg Records.

    A Record reads like SQLAlchemy's RowMapping: ``row["column"]``.
    """

    __slots__ = ("raw",)

    def __init__(self, raw: Raw) -> None:
        self.raw = raw

    async def fetch(
        self, statement: TextClause | str, binds: Mapping[str, Any] | None = None
    ) -> list[asyncpg.Record]:
        """Every row ``statement`` returns."""
        sql = positional(statement)
        try:
            rows: list[asyncpg.Record] = await self.raw.fetch(sql.text, *sql.args(binds or {}))
        except _FAILURES as exc:
            raise _wrapped(exc, sql.text, self.raw) from exc
        return rows

    async def fetchrow(
        self, statement: TextClause | str, binds: Mapping[str, Any] | None = None
    ) -> asyncpg.Record | None:
        """The first row, or None."""
        rows = await self.fetch(statement, binds)
        return rows[0] if rows else None

    async def fetchval(
        self, statement: TextClause | str, binds: Mapping[str, Any] | None = None
    ) -> Any:
        """The first column of the first row, or None."""
        row = await self.fetchrow(statement, binds)
        return None if row is None else row[0]

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Conn]:
        """A transaction on this connection (out of one: a savepoint inside one),
        committed when the block ends normally."""
        transaction = self.raw.transaction()
        try:
            await transaction.start()
        except _FAILURES as exc:
            raise _wrapped(exc, "BEGIN", self.raw) from exc
        try:
            yield self
        except BaseException:
            if not _closed(self.raw):
                with suppress(*_FAILURES):
                    await transaction.rollback()
            raise
        try:
            await transaction.commit()
        except _FAILURES as exc:
            raise _wrapped(exc, "COMMIT", self.raw) from exc

    async def execute(
        self, statement: TextClause | str, binds: Mapping[str, Any] | None = None
    ) -> None:
        """Run ``statement`` for its effect."""
        sql = positional(statement)
        try:
            await self.raw.execute(sql.text, *sql.args(binds or {}))
        except _FAILURES as exc:
            raise _wrapped(exc, sql.text, self.raw) from exc


def _json_text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a json bind takes JSON text (rows.dumps), not {type(value).__name__}")
    return value


def _pool_options(connect: ConnectOptions) -> dict[str, Any]:
    """asyncpg's pool arguments for ``connect``: the statement cache and session settings.

    Through PgBouncer in transaction pooling (``pgbouncer=true``) a session
    keeps nothing between transactions: no statement is cached (each is
    prepared unnamed in the round trip that runs it) and no setting is sent
    at connect (PgBouncer would refuse one it does not know).
    """
    if connect.pgbouncer:
        return {**connect.kwargs, "statement_cache_size": 0}
    return {
        **connect.kwargs,
        "statement_cache_size": STATEMENT_CACHE_SIZE,
        "max_cacheable_statement_size": MAX_CACHEABLE_STATEMENT,
        "max_cached_statement_lifetime": STATEMENT_LIFETIME,
        # Short statements: compiling one (JIT) costs more than it saves, and
        # a misestimated plan would pay it every time.
        "server_settings": {"jit": "off"},
    }


async def _init(conn: asyncpg.Connection) -> None:
    # As SQLAlchemy's asyncpg dialect: JSON text in, decoded values out.
    for name in ("json", "jsonb"):
        await conn.set_type_codec(
            name, schema="pg_catalog", encoder=_json_text, decoder=json.loads, format="text"
        )


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Nothing: statements here leave no session state (see the module's docstring)."""


class Database:
    """A pool of asyncpg connections for one part of a process (server, worker, relay).

    The pool is made at :meth:`open` (or at first use) and connects on
    demand, so a database that is down now is an error of the statements
    that need it, not of the start. Its owner closes it; a later use opens
    it again.
    """

    def __init__(self, url: str, *, size: int = 10, acquire_timeout: float = 30.0) -> None:
        self._connect = connect_options(url)
        self._size = size
        self._acquire_timeout = acquire_timeout
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()

    async def __aenter__(self) -> Database:
        await self.open()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    @property
    def size(self) -> int:
        """The most connections the pool holds."""
        return self._size

    async def open(self) -> None:
        """Make the pool (it connects on first use)."""
        await self._opened()

    async def close(self) -> None:
        """Close every connection (a statement still running is waited for, briefly)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                await asyncio.wait_for(pool.close(), timeout=10)
            except Exception:
                pool.terminate()

    async def _opened(self) -> asyncpg.Pool:
        pool = self._pool
        if pool is not None:
            return pool
        async with self._opening:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    self._connect.dsn,
                    **_pool_options(self._connect),
                    min_size=0,
                    max_size=self._size,
                    init=_init,
                    reset=_keep_session,
                )
            return self._pool

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[Conn]:
        """A connection in autocommit: each statement its own transaction."""
        pool = await self._opened()
        try:
            raw = await pool.acquire(timeout=self._acquire_timeout)
        except TimeoutError as exc:
            if pool.get_size() < self._size or pool.get_idle_size():
                # A connection was being made, not waited for: the database.
                raise _wrapped(exc, "(connect)", None) from exc
            log.warning("database.pool.exhausted", size=self._size, waited=self._acquire_timeout)
            exhausted = PoolExhausted(
                f"no connection of the pool's {self._size} came free "
                f"in {self._acquire_timeout:g} s (JOBPLANE_DB_POOL_SIZE)"
            )
            raise DBAPIError("(connect)", None, exhausted, hide_parameters=True) from exhausted
        except _FAILURES as exc:
            raise _wrapped(exc, "(connect)", None) from exc
        try:
            yield Conn(raw)
        finally:
            await pool.release(raw)

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[Conn]:
        """A connection in a transaction, committed when the block ends normally."""
        async with self.connect() as conn, conn.transaction():
            yield conn

    async def fetch(
        self, statement: TextClause | str, binds: Mapping[str, Any] | None = None
    ) -> list[asyncpg.Record]:
        """One statement in a transaction of its own; its rows."""
        async with self.connect() as conn:
            return await conn.fetch(statement, binds)
