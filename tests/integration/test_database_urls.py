"""Database URLs as managed Postgres hands them out, used by every process."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest
from sqlalchemy import text

from jobplane.client import JobState
from jobplane.store.engine import create_engine
from jobplane.topology import Topology
from tests.support import services
from tests.support.parts import Started
from tests.support.ports import free_port
from tests.support.stack import start_stack


def _dead_port() -> int:
    """A loopback port nothing listens on (a host of the URL that is down)."""
    return free_port()


async def _migrate(url: str) -> tuple[int, str]:
    """``jobplane migrate`` with ``url``: its exit code and stderr."""
    env = {**os.environ, "JOBPLANE_DATABASE_URL": url, "JOBPLANE_METRICS_LISTEN": "off"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jobplane", "migrate",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode is not None
    return process.returncode, err.decode()


@pytest.fixture
async def database_name(run_id: str) -> AsyncIterator[str]:
    """A database name nobody uses; dropped after the test (``jobplane migrate`` creates it)."""
    name = f"jp_{run_id}_urls_{os.urandom(3).hex()}"
    yield name
    await services.drop_database(name)


@pytest.mark.parametrize("sslmode", ["disable", "prefer"])
async def test_a_url_of_two_hosts_with_libpq_parameters_migrates_and_runs_a_job(
    database_name: str, amqp_url: str, topology: Topology, sslmode: str, started: Started
) -> None:
    server = urlsplit(services.PG_ADMIN_URL)
    live = f"{server.hostname}:{server.port or 5432}"
    url = (
        f"postgresql://{server.username}@127.0.0.1:{_dead_port()},{live}/{database_name}"
        f"?sslmode={sslmode}&target_session_attrs=read-write&application_name=jp-urls"
        "&connect_timeout=10"
    )
    code, err = await _migrate(url)
    assert code == 0, err

    engine = create_engine(url, pool_size=2)
    started.callback(engine.dispose)
    stack = await started(start_stack(engine, url, amqp_url, topology))
    client = stack.client()
    job = await client.submit("demo.echo", {"url": "libpq"})
    assert (await client.wait(job.name, timeout=60)).state is JobState.SUCCEEDED
    # The URL's server settings reached the sessions of every pool.
    async with engine.connect() as conn:
        names = await conn.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = :db AND application_name = 'jp-urls'"
            ),
            {"db": database_name},
        )
    assert names and names >= 3  # this engine's, the hot pools', the LISTENs'


async def test_sslmode_require_against_a_server_without_tls_is_one_line(
    database_name: str,
) -> None:
    server = urlsplit(services.PG_ADMIN_URL)
    url = (
        f"postgresql://{server.username}@{server.hostname}:{server.port or 5432}/"
        f"{database_name}?sslmode=require"
    )
    code, err = await _migrate(url)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    # The server's answer, said once as a refusal (it is the same at every try).
    assert lines[0].startswith("error: Postgres at "), err
    assert "rejected SSL upgrade" in lines[0]
