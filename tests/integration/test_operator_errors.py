"""Operator commands say in one line what is wrong when a service is down or refuses."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.keys import KeyStore
from tests.support import services

# Nothing listens on port 1 of loopback.
PG_DOWN = "postgresql://postgres:hunter2@127.0.0.1:1/jobplane"
AMQP_DOWN = "amqp://guest:hunter2@127.0.0.1:1/"
AMQP_BAD_LOGIN = f"{services.AMQP_BASE.replace('guest:guest', 'guest:hunter2')}/"


async def run(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["migrate"], {"JOBPLANE_DATABASE_URL": PG_DOWN}, "cannot reach Postgres"),
        (["keys", "create", "--tenant", "t"], {"JOBPLANE_DATABASE_URL": PG_DOWN}, "Postgres"),
        (["dlq", "list"], {"JOBPLANE_AMQP_URL": AMQP_DOWN}, "cannot reach RabbitMQ"),
        (["topology", "apply"], {"JOBPLANE_AMQP_URL": AMQP_DOWN}, "cannot reach RabbitMQ"),
        (["topology", "apply"], {"JOBPLANE_AMQP_URL": AMQP_BAD_LOGIN}, "refused the login"),
    ],
)
async def test_a_service_that_is_down_or_refuses_is_one_line(
    args: list[str], env: dict[str, str], says: str
) -> None:
    code, out, err = await run(*args, env=env)
    assert code == 1, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and says in lines[0], err
    assert "hunter2" not in err


async def test_an_unmigrated_database_says_to_migrate(run_id: str) -> None:
    name = f"jp_{run_id}_empty"
    await services.create_database(name)
    try:
        code, _out, err = await run(
            "keys", "create", "--tenant", "t", env={"JOBPLANE_DATABASE_URL": services.pg_url(name)}
        )
    finally:
        await services.drop_database(name)
    assert code == 1
    assert err.strip().splitlines() == [
        f"error: the database at {services.pg_url(name)} has no jobplane tables: "
        "run `jobplane migrate`"
    ]


async def test_version() -> None:
    from importlib.metadata import version

    code, out, _err = await run("--version", env={})
    assert code == 0
    assert out.strip() == f"jobplane {version('jobplane')}"


async def test_a_reader_that_goes_away_is_no_traceback(
    database_url: str, engine: AsyncEngine
) -> None:
    keys = KeyStore(engine)
    for n in range(3):
        await keys.create_key(f"tenant-{n}")
    read, write = os.pipe()
    os.close(read)  # `| head` that has already exited
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jobplane",
            "keys",
            "list",
            env={**os.environ, "JOBPLANE_DATABASE_URL": database_url},
            stdout=write,
            stderr=asyncio.subprocess.PIPE,
        )
    finally:
        os.close(write)
    _out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 1
    assert "Traceback" not in err.decode(), err.decode()
