"""Isolation on the real services: a database per test, a vhost per run."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator

import asyncpg

from jobplane import broker
from jobplane.store.engine import migrate
from jobplane.topology import Topology

PG_ADMIN_URL = os.environ.get("JOBPLANE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_BASE = os.environ.get("JOBPLANE_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672")


def pg_url(database: str) -> str:
    """The test server's URL for ``database``."""
    base = PG_ADMIN_URL.rsplit("/", 1)[0]
    return f"{base}/{database}"


async def create_database(name: str, template: str | None = None) -> None:
    """CREATE DATABASE ``name`` (from ``template`` when given)."""
    conn = await asyncpg.connect(PG_ADMIN_URL)
    try:
        suffix = f' TEMPLATE "{template}"' if template else ""
        await conn.execute(f'CREATE DATABASE "{name}"{suffix}')
    finally:
        await conn.close()


async def drop_database(name: str) -> None:
    """DROP DATABASE ``name``, ending its sessions first."""
    conn = await asyncpg.connect(PG_ADMIN_URL)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def database_at(run_id: str, revision: str) -> AsyncIterator[str]:
    """A fresh database migrated up to ``revision`` only (its URL), dropped after."""
    name = f"jp_{run_id}_r{uuid.uuid4().hex[:6]}"
    await create_database(name)
    try:
        url = pg_url(name)
        await migrate(url, revision=revision, create=False)
        yield url
    finally:
        await drop_database(name)


def _rabbitmqctl(*args: str) -> None:
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    subprocess.run([ctl, "-q", *args], check=True, capture_output=True, timeout=60)


def create_vhost(name: str) -> str:
    """A fresh vhost the guest user may use; returns its AMQP URL."""
    _rabbitmqctl("add_vhost", name)
    _rabbitmqctl("set_permissions", "-p", name, "guest", ".*", ".*", ".*")
    return f"{AMQP_BASE}/{name}"


def delete_vhost(name: str) -> None:
    """Remove a vhost and everything in it."""
    _rabbitmqctl("delete_vhost", name)


def create_user(
    name: str, password: str, vhost: str, *, configure: str, write: str, read: str
) -> str:
    """A RabbitMQ user with these permissions on ``vhost``; returns its AMQP URL."""
    _rabbitmqctl("add_user", name, password)
    _rabbitmqctl("set_permissions", "-p", vhost, name, configure, write, read)
    host = AMQP_BASE.rsplit("@", 1)[-1]
    return f"amqp://{name}:{password}@{host}/{vhost}"


def close_connections_of(user: str) -> int:
    """Close every broker connection of ``user``; returns how many there were."""
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    listing = subprocess.run(
        [ctl, "-q", "list_connections", "user", "pid"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    pids = [line.split()[1] for line in listing.splitlines() if line.split()[:1] == [user]]
    for pid in pids:
        _rabbitmqctl("close_connection", pid, "closed by a test")
    return len(pids)


def delete_user(name: str) -> None:
    """Remove a RabbitMQ user."""
    _rabbitmqctl("delete_user", name)


def run_id() -> str:
    """A short id that names this run's databases and vhost."""
    return uuid.uuid4().hex[:10]


async def delete_topology(amqp_url: str, topology: Topology) -> None:
    """Delete ``topology``'s queues and exchanges from ``amqp_url``'s vhost (best effort)."""
    try:
        connection = await broker.connect(amqp_url)
    except Exception:  # the broker is down (a fault test); the vhost goes at the end
        return
    async with connection:
        for queue in (
            *(q.name for q in topology.queues),
            topology.failed_queue,
            topology.owner_queue,
        ):
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await channel.queue_delete(queue)
            with contextlib.suppress(Exception):
                await channel.close()
        for exchange in (
            topology.exchange,
            topology.dead_letter_exchange,
            topology.events_exchange,
        ):
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await channel.exchange_delete(exchange)
            with contextlib.suppress(Exception):
                await channel.close()
