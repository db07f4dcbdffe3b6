"""The door under load: made-up keys cost bounded database work, and every
admitted call is served as its own caller although handlers are shared."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobNotFound
from jobplane.observe import tracing
from jobplane.topology import Topology
from jobplane.v1 import jobs_pb2, jobs_pb2_grpc
from tests.support.servers import Servers
from tests.support.statements import counting

# In the key store's resolve statement only.
RESOLVE = "SET last_used_time = now()"


@pytest.fixture
async def servers(
    engine: AsyncEngine, database_url: str, topology: Topology
) -> AsyncIterator[Servers]:
    running = Servers(engine, database_url, topology)
    yield running
    await running.close()


async def test_a_flood_of_made_up_keys_leaves_a_tenant_served(servers: Servers) -> None:
    server = await servers.start()
    # Not cached by the server yet: its first call needs a lookup mid-flood.
    key, _tenant = await server.keys.create_key("acme")
    client = servers.client(server, key)
    flood_size = 600

    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)

        async def made_up() -> grpc.StatusCode:
            forged = "jp_" + secrets.token_urlsafe(32)
            try:
                await stub.GetJob(
                    jobs_pb2.GetJobRequest(name="jobs/x"),
                    metadata=(("authorization", f"Bearer {forged}"),),
                    timeout=60,
                )
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        async def tenant() -> list[str]:
            names = []
            for i in range(5):
                job = await client.submit("demo.echo", {"i": i})
                assert (await client.get(job.name)).payload == {"i": i}
                names.append(job.name)
            return names

        with counting(servers.engine, RESOLVE) as statements:
            flood = [asyncio.ensure_future(made_up()) for _ in range(flood_size)]
            await asyncio.sleep(0)
            names = await tenant()
            codes = await asyncio.gather(*flood)

    assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
    assert sorted(j.name for j in (await client.list()).jobs) == sorted(names)
    # Key lookups never held more than their two connections of the pool,
    # and keys arriving together shared statements (one statement per key would
    # be flood_size + 1; how many share one depends on how busy the machine is).
    assert statements.most_at_once <= 2
    assert statements.sent < flood_size // 2


async def test_each_call_is_served_as_its_own_caller(servers: Servers) -> None:
    server = await servers.start()
    a_key, a_tenant = await server.keys.create_key("a")
    b_key, b_tenant = await server.keys.create_key("b")
    a, b = servers.client(server, a_key), servers.client(server, b_key)
    a_job = await a.submit("demo.echo", {"owner": "a"})
    b_job = await b.submit("demo.echo", {"owner": "b"})

    # Interleaved calls of two tenants share the server's handlers; each
    # sees its own caller (a stray identity would make some NOT_FOUND).
    async def read(client_job: tuple[object, str], owner: str) -> str:
        client, name = client_job
        job = await client.get(name)  # type: ignore[attr-defined]
        return str(job.payload["owner"]) if job.payload["owner"] == owner else "stray"

    calls = []
    for _ in range(100):
        calls.append(read((a, a_job.name), "a"))
        calls.append(read((b, b_job.name), "b"))
    assert await asyncio.gather(*calls) == ["a", "b"] * 100
    with pytest.raises(JobNotFound):
        await b.get(a_job.name)

    # A watch holds a stream slot of its own caller's tenant.
    events = a.watch(a_job.name)
    assert (await anext(events)).seq == 1
    assert (server.limiter.streams(a_tenant), server.limiter.streams(b_tenant)) == (1, 0)
    await events.aclose()


@pytest.mark.parametrize("traced", [False, True], ids=["tracing-off", "tracing-on"])
async def test_a_refused_stream_gives_its_own_code_with_tracing_on_or_off(
    servers: Servers, monkeypatch: pytest.MonkeyPatch, traced: bool
) -> None:
    if traced:
        provider = TracerProvider()
        monkeypatch.setattr(tracing, "ENABLED", True)
        monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("test"))
    server = await servers.start()
    worker = await server.keys.create_worker()
    forged = "jp_" + secrets.token_urlsafe(32)

    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)

        async def watch(key: str) -> grpc.StatusCode:
            call = stub.WatchJob(
                jobs_pb2.WatchJobRequest(name="jobs/x"),
                metadata=(("authorization", f"Bearer {key}"),),
                timeout=30,
            )
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        assert await watch(forged) == grpc.StatusCode.UNAUTHENTICATED
        assert await watch(worker.key) == grpc.StatusCode.PERMISSION_DENIED
