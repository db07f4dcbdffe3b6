"""Database URLs as Postgres (libpq) writes them, made into what asyncpg is given.

Managed Postgres hands out URLs in libpq's form: ``?sslmode=require``,
``sslrootcert=…``, several hosts (``postgresql://u@h1:5432,h2:5433/db``),
``target_session_attrs=read-write``. asyncpg parses those itself, so every
connection of every process (SQLAlchemy's pool, the hot statements' pool,
the LISTEN connection, migrations) is opened by ``asyncpg.connect`` from the
one DSN made here; SQLAlchemy, which would pass query parameters on as
keyword arguments asyncpg does not take, never parses it.

What asyncpg does not take is translated or refused here, once:
``connect_timeout`` becomes asyncpg's ``timeout``; ``channel_binding=disable``
or ``prefer`` is dropped (asyncpg authenticates with SCRAM without channel
binding), ``require`` is refused, since it could not be honoured. Anything
else asyncpg does not know it sends to the server as a setting
(``application_name=…``), as libpq does.

``pgbouncer=true`` is jobplane's own parameter, never sent: the URL leads to
PgBouncer in transaction pooling, where a session's prepared statements do
not outlive its transaction (PgBouncer 1.18 keeps none across server
connections). asyncpg is then told to cache none (``statement_cache_size=0``:
it prepares each statement unnamed, in the round trip that runs it) and
SQLAlchemy's dialect likewise (``ConnectOptions.pgbouncer``; ADR-0048).

Nothing here imports a driver: the configuration checks a URL with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

SCHEMES = frozenset({"postgresql", "postgres", "postgresql+asyncpg"})
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
SESSION_ATTRS = ("any", "primary", "standby", "prefer-standby", "read-write", "read-only")


@dataclass(frozen=True, slots=True)
class ConnectOptions:
    """The DSN and keyword arguments for ``asyncpg.connect`` (and ``create_pool``)."""

    dsn: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: The URL leads to PgBouncer in transaction pooling (``pgbouncer=true``).
    pgbouncer: bool = False


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _params(query: str) -> list[tuple[str, str, str]]:
    """``(name, value, raw pair)`` for each parameter, the raw text kept as written."""
    found = []
    for pair in query.split("&"):
        if pair:
            name, _, value = pair.partition("=")
            found.append((unquote(name), unquote(value), pair))
    return found


def connect_options(url: str) -> ConnectOptions:
    """``url`` (libpq's URL form, or SQLAlchemy's ``postgresql+asyncpg://``) for asyncpg.

    A URL that cannot work is a ValueError saying why, before any connection.
    """
    parts = urlsplit(url.strip())
    if parts.scheme not in SCHEMES:
        raise ValueError(
            f"a database URL starts with postgresql:// (or postgres://), not {parts.scheme!r}://"
        )
    kwargs: dict[str, Any] = {}
    kept: list[str] = []
    pgbouncer = False
    _named_database(parts.path, parts.query)
    for name, value, pair in _params(parts.query):
        if name == "pgbouncer":
            if value.lower() not in _TRUE + _FALSE:
                raise ValueError(f"pgbouncer must be true or false, not {value!r}")
            pgbouncer = value.lower() in _TRUE
            continue
        if name == "connect_timeout":
            try:
                seconds = float(value)
            except ValueError:
                raise ValueError(f"connect_timeout must be seconds, not {value!r}") from None
            if seconds > 0:  # libpq: 0 (or less) is no limit; asyncpg keeps its own
                kwargs["timeout"] = max(seconds, 2.0)  # libpq's floor
            continue
        if name == "channel_binding":
            if value == "require":
                raise ValueError(
                    "channel_binding=require is not supported (asyncpg authenticates "
                    "with SCRAM without channel binding); use sslmode=verify-full"
                )
            if value not in ("disable", "prefer"):
                raise ValueError(
                    f"channel_binding must be disable, prefer or require, not {value!r}"
                )
            continue
        if name == "sslmode" and value not in SSL_MODES:
            raise ValueError(f"sslmode must be one of {', '.join(SSL_MODES)}, not {value!r}")
        if name == "target_session_attrs" and value not in SESSION_ATTRS:
            raise ValueError(
                f"target_session_attrs must be one of {', '.join(SESSION_ATTRS)}, not {value!r}"
            )
        kept.append(pair)
    dsn = urlunsplit(("postgresql", parts.netloc, parts.path, "&".join(kept), parts.fragment))
    if pgbouncer:
        kwargs["statement_cache_size"] = 0
    return ConnectOptions(dsn, kwargs, pgbouncer)


def database_name(url: str) -> str | None:
    """The database ``url`` names (its path, or a ``dbname`` parameter); None if none."""
    parts = urlsplit(url.strip())
    return _named_database(parts.path, parts.query)


def _named_database(path: str, query: str) -> str | None:
    """The one database of a URL's path and query; a ValueError if they name more.

    asyncpg takes the path's over a parameter's, and one parameter over the
    other: with two, the database ``ensure_database`` creates would not be the
    one every connection goes to.
    """
    named = [value for name, value, _pair in _params(query) if name in ("dbname", "database")]
    named = [value for value in [unquote(path.lstrip("/")), *named] if value]
    if len(named) > 1:
        raise ValueError("the database is named more than once (path, dbname, database)")
    return named[0] if named else None


def with_database(url: str, database: str) -> str:
    """``url`` naming ``database`` instead (hosts, user and parameters kept)."""
    parts = urlsplit(url.strip())
    query = "&".join(
        pair for name, _v, pair in _params(parts.query) if name not in ("dbname", "database")
    )
    path = "/" + quote(database, safe="")
    return urlunsplit((parts.scheme, parts.netloc, path, query, parts.fragment))


_SECRETS = frozenset({"password", "sslpassword"})


def redacted(url: str) -> str:
    """``url`` fit to show: its password, in the user part or a parameter, as ``***``."""
    parts = urlsplit(url.strip())
    netloc = parts.netloc
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}"
    query = "&".join(
        f"{pair.partition('=')[0]}=***" if name in _SECRETS else pair
        for name, _value, pair in _params(parts.query)
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
