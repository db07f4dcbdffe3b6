"""A worker started while the broker is down waits for it instead of exiting."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState
from jobplane.topology import Topology
from jobplane.workers.demo import registry as demo_registry
from jobplane.workers.runtime import Worker
from tests.support.proxy import CuttableProxy
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
