"""Database URLs in libpq's form, made into what asyncpg is given."""

from __future__ import annotations

import pytest

from jobplane.config import ConfigError, Settings
from jobplane.store.dsn import connect_options, database_name, redacted, with_database


@pytest.mark.parametrize(
    ("url", "dsn"),
    [
        ("postgresql://u:p@h/db", "postgresql://u:p@h/db"),
        ("postgres://u@h:5433/db?sslmode=require", "postgresql://u@h:5433/db?sslmode=require"),
        ("postgresql+asyncpg://u@h/db", "postgresql://u@h/db"),
        (
            "postgresql://u@h1:5432,h2:5433/db?target_session_attrs=read-write",
            "postgresql://u@h1:5432,h2:5433/db?target_session_attrs=read-write",
        ),
        (
            "postgresql://u@h/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem"
            "&sslcert=/c.pem&sslkey=/k.pem",
            "postgresql://u@h/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem"
            "&sslcert=/c.pem&sslkey=/k.pem",
        ),
        # libpq's own parameters asyncpg does not take are translated or dropped.
        (
            "postgresql://u@h/db?sslmode=require&channel_binding=prefer&connect_timeout=10",
            "postgresql://u@h/db?sslmode=require",
        ),
    ],
)
def test_a_libpq_url_becomes_a_dsn_asyncpg_parses(url: str, dsn: str) -> None:
    assert connect_options(url).dsn == dsn


def test_connect_timeout_becomes_asyncpgs_timeout() -> None:
    assert connect_options("postgresql://h/db?connect_timeout=10").kwargs == {"timeout": 10.0}
    assert connect_options("postgresql://h/db?connect_timeout=0").kwargs == {}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://h/db", "starts with postgresql://"),
        ("postgresql://h/db?sslmode=on", "sslmode must be one of"),
        ("postgresql://h/db?target_session_attrs=primary-ish", "target_session_attrs must be"),
        ("postgresql://h/db?channel_binding=require", "channel_binding=require is not supported"),
        ("postgresql://h/db?connect_timeout=soon", "connect_timeout must be seconds"),
        ("postgresql://h/a?dbname=b", "database is named more than once"),
        ("postgresql://h/a?database=a", "database is named more than once"),
        ("postgresql://h/?dbname=a&database=b", "database is named more than once"),
    ],
)
def test_a_url_that_cannot_work_is_refused_before_connecting(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        connect_options(url)


def test_the_configuration_refuses_such_a_url_without_quoting_it() -> None:
    url = "postgresql://u:secret@h/db?sslmode=on"
    with pytest.raises(ConfigError, match="JOBPLANE_DATABASE_URL: sslmode") as refused:
        Settings.from_env({"JOBPLANE_DATABASE_URL": url})
    assert "secret" not in str(refused.value)
    ok = "postgresql://u@h1:5432,h2:5433/db?sslmode=prefer&target_session_attrs=read-write"
    assert Settings.from_env({"JOBPLANE_DATABASE_URL": ok}).database_url == ok


def test_the_database_of_a_url_of_several_hosts() -> None:
    url = "postgresql://u@h1:5432,h2:5433/jobs?sslmode=require"
    assert database_name(url) == "jobs"
    assert (
        with_database(url, "postgres") == "postgresql://u@h1:5432,h2:5433/postgres?sslmode=require"
    )
    assert database_name("postgresql://u@h/?dbname=other") == "other"
    assert (
        with_database("postgresql://u@h/?dbname=other", "postgres") == "postgresql://u@h/postgres"
    )


def test_a_database_named_twice_is_refused_where_it_is_read() -> None:
    # asyncpg connects to the path's database: ensure_database must never
    # create another one from the parameter.
    with pytest.raises(ValueError, match="named more than once"):
        database_name("postgresql://h/a?dbname=b")
    with pytest.raises(ConfigError, match="JOBPLANE_DATABASE_URL: the database is named"):
        Settings.from_env({"JOBPLANE_DATABASE_URL": "postgresql://h/a?dbname=b"})


def test_a_url_is_shown_without_its_passwords() -> None:
    url = "postgresql://u:s3cret@h1:5432,h2:5433/db?sslpassword=k3y&sslmode=require"
    shown = redacted(url)
    assert shown == "postgresql://u:***@h1:5432,h2:5433/db?sslpassword=***&sslmode=require"
    assert redacted("postgresql://u@h/db?password=s3cret") == "postgresql://u@h/db?password=***"


BOUNCER = "postgresql://u@bouncer:6432/db?pgbouncer=true&sslmode=require"
DIRECT = "postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write"


@pytest.mark.parametrize("value", ["true", "1", "yes", "on", "TRUE"])
def test_pgbouncer_turns_off_the_statement_cache_and_is_never_sent(value: str) -> None:
    options = connect_options(f"postgresql://u@bouncer/db?pgbouncer={value}&sslmode=require")
    assert options.pgbouncer
    assert options.kwargs == {"statement_cache_size": 0}
    assert options.dsn == "postgresql://u@bouncer/db?sslmode=require"


def test_without_pgbouncer_the_statement_cache_is_asyncpgs() -> None:
    for url in ("postgresql://u@h/db", "postgresql://u@h/db?pgbouncer=false"):
        options = connect_options(url)
        assert not options.pgbouncer
        assert "statement_cache_size" not in options.kwargs
        assert "pgbouncer" not in options.dsn


def test_a_pgbouncer_value_that_is_no_yes_or_no_is_refused() -> None:
    with pytest.raises(ValueError, match="pgbouncer must be true or false, not 'maybe'"):
        connect_options("postgresql://u@h/db?pgbouncer=maybe")


def test_the_direct_url_defaults_to_the_database_url() -> None:
    settings = Settings.from_env({"JOBPLANE_DATABASE_URL": DIRECT})
    assert settings.database_direct_url is None
    assert settings.direct_url == DIRECT


def test_through_pgbouncer_listen_and_migrations_take_the_direct_url() -> None:
    settings = Settings.from_env(
        {"JOBPLANE_DATABASE_URL": BOUNCER, "JOBPLANE_DATABASE_DIRECT_URL": DIRECT}
    )
    assert settings.database_url == BOUNCER
    assert settings.direct_url == DIRECT


def test_pgbouncer_without_a_direct_url_is_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="JOBPLANE_DATABASE_DIRECT_URL is needed"):
        Settings.from_env({"JOBPLANE_DATABASE_URL": BOUNCER})


@pytest.mark.parametrize(
    ("direct", "reason"),
    [
        (BOUNCER, "not through PgBouncer"),
        ("postgresql://u@h/db?sslmode=on", "sslmode must be one of"),
        ("mysql://u@h/db", "starts with postgresql://"),
    ],
)
def test_a_direct_url_that_cannot_work_is_refused_at_start(direct: str, reason: str) -> None:
    env = {"JOBPLANE_DATABASE_URL": BOUNCER, "JOBPLANE_DATABASE_DIRECT_URL": direct}
    with pytest.raises(ConfigError, match=f"JOBPLANE_DATABASE_DIRECT_URL: .*{reason}"):
        Settings.from_env(env)
