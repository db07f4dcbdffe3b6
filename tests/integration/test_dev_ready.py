"""Ready means usable: `jobplane dev` and `jobplane serve` report SERVING only once
the topology they run is on the broker, and `jobplane dev` applies its own
topology (its bindings too) over one declared before on the same vhost."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aio_pika
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jobplane import broker
from jobplane.client import AsyncClient
from jobplane.topology import declare, load_topology
from tests.support import services
from tests.support.ports import free_port
from tests.support.serve import interrupt

EVENTS_EXCHANGE = "jobplane.events"


@pytest.fixture
def vhost_url() -> Iterator[str]:
    """A vhost of its own, empty: nothing is declared in it before the command runs."""
    name = f"jobplane-ready-{uuid.uuid4().hex[:8]}"
    yield services.create_vhost(name)
    services.delete_vhost(name)


@asynccontextmanager
async def _command(
    args: list[str], env: dict[str, str], output: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``jobplane ARGS`` with its output in ``output``; SIGINT, then SIGKILL, at the end."""
    with output.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "jobplane", *args, env=env, stdout=out, stderr=out
        )
        try:
            yield process
        finally:
            await interrupt(process)


def _text(path: Path) -> str:
    return path.read_text(errors="replace")


async def _until_serving(address: str, process: asyncio.subprocess.Process, output: Path) -> None:
    """Ask the health service as often as it answers until it says SERVING."""
    async with grpc.aio.insecure_channel(address) as channel:
        health: Any = health_pb2_grpc.HealthStub(channel)
        async with asyncio.timeout(90):
            while True:
                assert process.returncode is None, _text(output)
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                except grpc.aio.AioRpcError:
                    reply = None  # not listening yet
                if reply is not None and reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                await asyncio.sleep(0.01)


async def _bind_to_events(amqp_url: str) -> None:
    """What a consumer does first: bind a queue of its own to the events exchange."""
    connection = await broker.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue("", exclusive=True)
        await queue.bind(EVENTS_EXCHANGE, routing_key="#")


def _env(database_url: str, amqp_url: str, address: str, **more: str) -> dict[str, str]:
    return {
        **os.environ,
        "JOBPLANE_DATABASE_URL": database_url,
        "JOBPLANE_AMQP_URL": amqp_url,
        "JOBPLANE_LISTEN": address,
        "JOBPLANE_UI_LISTEN": "off",
        **more,
    }


async def test_dev_says_serving_only_once_its_topology_exists(
    database_url: str, vhost_url: str, tmp_path: Path
) -> None:
    address = f"127.0.0.1:{free_port()}"
    output = tmp_path / "dev.log"
    # The relay (which used to declare the topology) in a process of its own.
    args = ["dev", "--processes", "3"]
    async with _command(args, _env(database_url, vhost_url, address), output) as process:
        await _until_serving(address, process, output)
        await _bind_to_events(vhost_url)


async def test_serve_says_serving_only_once_the_topology_exists(
    database_url: str, vhost_url: str, tmp_path: Path
) -> None:
    address = f"127.0.0.1:{free_port()}"
    output = tmp_path / "serve.log"
    async with _command(["serve"], _env(database_url, vhost_url, address), output) as process:
        await _until_serving(address, process, output)
        await _bind_to_events(vhost_url)


TOPOLOGY = """
[[queues]]
name = "jobplane.default"
bindings = {bindings}
"""


async def test_dev_applies_its_topology_over_another_one(
    database_url: str, vhost_url: str, tmp_path: Path
) -> None:
    # One topology declared on the vhost first: its queue takes demo.progress only.
    first, second = tmp_path / "first.toml", tmp_path / "second.toml"
    first.write_text(TOPOLOGY.format(bindings='["demo.progress"]'))
    second.write_text(TOPOLOGY.format(bindings='["demo.progress", "demo.echo"]'))
    connection = await aio_pika.connect(vhost_url)
    async with connection:
        await declare(await connection.channel(), load_topology(first))
    # jobplane dev with the other one, which routes demo.echo to the same queue.
    address = f"127.0.0.1:{free_port()}"
    output = tmp_path / "dev.log"
    env = _env(database_url, vhost_url, address, JOBPLANE_TOPOLOGY=str(second))
    async with _command(["dev", "--processes", "1"], env, output) as process:
        await _until_serving(address, process, output)
        key = await _api_key(output)
        async with AsyncClient(address, key) as client:
            job = await client.submit("demo.echo", {"routed": True})
            done = await client.wait(job.name, timeout=60)
        assert done.state.name == "SUCCEEDED", _text(output)
        assert done.result == {"routed": True}


async def _api_key(output: Path) -> str:
    """The API key `jobplane dev` printed (it prints it once it serves)."""
    async with asyncio.timeout(30):
        while True:
            for line in _text(output).splitlines():
                if line.strip().startswith("api key:"):
                    return line.split()[2]
            await asyncio.sleep(0.1)
