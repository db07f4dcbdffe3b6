"""A worker started while the broker is down waits for it instead of exiting."""

from __future__ import annotations

import asyncio
import threading
from urllib.parse import urlsplit

import aiormq
import pytest
import uvloop
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.client import JobState
from jobplane.topology import Topology
from jobplane.workers.demo import registry as demo_registry
from jobplane.workers.runtime import Worker
from tests.support.proxy import CuttableProxy, HangingUpListener, HangUp
from tests.support.stack import start_stack


async def test_a_worker_started_while_the_broker_is_down_waits_for_it(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    target = urlsplit(amqp_url)
    proxy = CuttableProxy(target.hostname or "127.0.0.1", target.port or 5672)
    await proxy.start()
    await proxy.cut()  # the broker is unreachable from the start
    proxied = amqp_url.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")

    stack = await start_stack(engine, database_url, amqp_url, topology, worker=False)
    worker = Worker(engine, database_url, proxied, topology, demo_registry, lease_seconds=5.0)
    starting = asyncio.create_task(worker.start())
    try:
        client = stack.client()
        job = await client.submit("demo.echo", {"waited": True})
        await asyncio.sleep(1.0)
        assert not starting.done()  # still waiting, not failed
        await proxy.start()  # the broker is back
        await asyncio.wait_for(starting, timeout=30)
        done = await asyncio.wait_for(client.wait(job.name), timeout=20)
        assert done.state is JobState.SUCCEEDED
    finally:
        if starting.done() and starting.exception() is None:
            await worker.stop(grace=1.0)
        else:
            starting.cancel()
        await stack.close()
        await proxy.cut()


@pytest.mark.parametrize("how", ["close", "reset"])
def test_an_address_that_accepts_and_hangs_up_is_the_broker_down(how: HangUp) -> None:
    # Under uvloop (the processes' loop) a hang-up often reaches the stream
    # before aiormq reads its first frame, and aiormq then stops iterating
    # (StopAsyncIteration) instead of raising a connection error. Connections
    # at once make that all but certain; each must read as the broker down.
    errors: list[BaseException] = []

    async def connect_all(port: int) -> None:
        url = f"amqp://guest:guest@127.0.0.1:{port}/"

        async def one(robust: bool) -> None:
            try:
                await broker.connect(url, timeout=10, robust=robust)
            except Exception as exc:
                errors.append(exc)

        await asyncio.gather(*(one(robust) for robust in (False, True) for _ in range(50)))

    with HangingUpListener(how) as listener:
        # A thread of its own: uvloop.run sets the thread's event loop, which
        # must not be the test session's.
        runner = threading.Thread(target=uvloop.run, args=(connect_all(listener.port),))
        runner.start()
        runner.join(timeout=60)
    assert not runner.is_alive()
    assert len(errors) == 100
    assert [e for e in errors if not broker.broker_down(e)] == []
    # Said as a connection error (a loaded machine may time one out), never as
    # the iterator's end.
    assert not [e for e in errors if isinstance(e, StopAsyncIteration)]
    assert any(isinstance(e, aiormq.exceptions.AMQPConnectionError) for e in errors)


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_worker_and_relay_wait_out_an_address_that_hangs_up_then_run_a_job(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, how: HangUp
) -> None:
    target = urlsplit(amqp_url)
    proxy = CuttableProxy(target.hostname or "127.0.0.1", target.port or 5672)
    proxy.hang_up = how  # a load balancer in front of a broker that is down
    await proxy.start()
    proxied = amqp_url.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")

    stack = await start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    worker = Worker(engine, database_url, proxied, topology, demo_registry, lease_seconds=5.0)
    starting = asyncio.create_task(worker.start())
    try:
        relay = await stack.start_relay(proxied)  # waits for the broker in the background
        client = stack.client()
        job = await client.submit("demo.echo", {"waited": True})
        await asyncio.sleep(2.0)
        assert not starting.done()  # still waiting, not failed
        assert not relay.connected
        proxy.hang_up = None  # the broker is back behind the address
        await asyncio.wait_for(starting, timeout=30)
        done = await asyncio.wait_for(client.wait(job.name), timeout=30)
        assert done.state is JobState.SUCCEEDED
        assert relay.connected
    finally:
        if starting.done() and starting.exception() is None:
            await worker.stop(grace=1.0)
        else:
            starting.cancel()
        await stack.close()
        await proxy.cut()
