"""Per-tenant limits: watch streams held, submits per second."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest
from google.rpc import error_details_pb2
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import AsyncClient, JobEvent, RetryPolicy, TenantLimitExceeded
from jobplane.client._errors import rich_status
from jobplane.config import MAX_PAYLOAD_BYTES_LIMIT, Settings
from jobplane.server.limits import TenantLimits
from jobplane.topology import Topology
from jobplane.v1 import jobs_pb2, jobs_pb2_grpc
from tests.support.servers import Servers
from tests.support.stack import eventually

# A watch that gives up at once: these tests look at the server's refusal,
# which the SDK would otherwise wait out within its watch budget.
NO_WAIT = RetryPolicy(max_elapsed=0)


@pytest.fixture
async def servers(
    engine: AsyncEngine, database_url: str, topology: Topology
) -> AsyncIterator[Servers]:
    running = Servers(engine, database_url, topology)
    yield running
    await running.close()


async def _jobs(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM jobs"))).scalar_one())


class OpenWatch:
    """A watch stream held open (its job never ends: no worker runs)."""

    def __init__(self, client: AsyncClient, name: str) -> None:
        self._events = client.watch(name)
        self.first: JobEvent | None = None

    async def open(self) -> OpenWatch:
        # The first event means the server admitted the stream.
        self.first = await anext(self._events)
        return self

    async def close(self) -> None:
        await self._events.aclose()


async def test_a_tenant_at_its_stream_limit_does_not_stop_another_tenant(
    servers: Servers,
) -> None:
    server = await servers.start(limits=TenantLimits(max_streams=3, submits_per_second=0))
    a_key, a_tenant = await server.keys.create_key("greedy")
    b_key, _b_tenant = await server.keys.create_key("modest")
    a = servers.client(server, a_key, watch_retry=NO_WAIT)
    b = servers.client(server, b_key, watch_retry=NO_WAIT)
    job = await a.submit("demo.echo", {})
    held = [await OpenWatch(a, job.name).open() for _ in range(3)]
    assert server.limiter.streams(a_tenant) == 3

    with pytest.raises(TenantLimitExceeded) as info:
        await OpenWatch(a, job.name).open()
    assert info.value.limit == "watch_streams"
    assert info.value.metadata["max"] == "3"
    assert info.value.retry_delay is not None and info.value.retry_delay > 0
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

    # The other tenant submits, reads and watches as usual meanwhile.
    theirs = await b.submit("demo.echo", {"mine": True})
    assert (await b.get(theirs.name)).payload == {"mine": True}
    assert [j.name for j in (await b.list()).jobs] == [theirs.name]
    watch = await OpenWatch(b, theirs.name).open()
    assert watch.first is not None and watch.first.seq == 1
    await watch.close()
    # And the greedy tenant's other calls are not limited by its streams.
    assert (await a.get(job.name)).name == job.name

    # A closed stream gives its slot back.
    await held.pop().close()

    async def slot_free() -> bool:
        return server.limiter.streams(a_tenant) == 2

    await eventually(slot_free)
    held.append(await OpenWatch(a, job.name).open())
    for stream in held:
        await stream.close()
    await eventually(lambda: _no_streams(server.limiter.streams(a_tenant)))


async def _no_streams(count: int) -> bool:
    return count == 0


async def test_submits_over_the_rate_are_refused_with_retry_info(servers: Servers) -> None:
    # 3 at once, then one every 100 s: the 4th is refused with a delay too
    # long for the SDK to wait on its own.
    server = await servers.start(limits=TenantLimits(submits_per_second=0.01, submit_burst=3))
    a_key, _tenant = await server.keys.create_key("busy")
    b_key, _tenant = await server.keys.create_key("quiet")
    a = servers.client(server, a_key)
    for i in range(3):
        await a.submit("demo.echo", {"i": i})
    with pytest.raises(TenantLimitExceeded) as info:
        await a.submit("demo.echo", {"i": 3})
    assert info.value.limit == "submits_per_second"
    assert info.value.retry_delay is not None and 50 < info.value.retry_delay <= 100
    assert await _jobs(servers.engine) == 3

    # On the wire: RESOURCE_EXHAUSTED with ErrorInfo and RetryInfo.
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await stub.SubmitJob(
                jobs_pb2.SubmitJobRequest(type="demo.echo"),
                metadata=(("authorization", f"Bearer {a_key}"),),
            )
    assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rich_status(raw.value)
    assert status is not None
    kinds = {d.type_url.rsplit("/", 1)[-1] for d in status.details}
    assert kinds == {"google.rpc.ErrorInfo", "google.rpc.RetryInfo"}
    info_pb = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info_pb)
    assert info_pb.reason == "TENANT_LIMIT_EXCEEDED"
    assert info_pb.metadata["limit"] == "submits_per_second"

    # Another tenant has a bucket of its own.
    await servers.client(server, b_key).submit("demo.echo", {})
    assert await _jobs(servers.engine) == 4


async def test_the_sdk_waits_out_a_short_retry_delay(servers: Servers) -> None:
    # One token, one more each second: the second submit is refused with
    # about a second to wait, which the SDK waits and then repeats the call
    # (safe: it carries the same request_id).
    server = await servers.start(limits=TenantLimits(submits_per_second=1, submit_burst=1))
    key, _tenant = await server.keys.create_key("steady")
    client = servers.client(server, key)
    first, second = await asyncio.gather(
        client.submit("demo.echo", {"n": 1}), client.submit("demo.echo", {"n": 2})
    )
    assert first.name != second.name
    assert await _jobs(servers.engine) == 2


async def test_a_stream_refused_for_its_limit_holds_no_slot(servers: Servers) -> None:
    server = await servers.start(limits=TenantLimits(max_streams=1, submits_per_second=0))
    key, tenant = await server.keys.create_key("acme")
    client = servers.client(server, key, watch_retry=NO_WAIT)
    job = await client.submit("demo.echo", {})
    held = await OpenWatch(client, job.name).open()
    for _ in range(5):
        with pytest.raises(TenantLimitExceeded):
            await OpenWatch(client, job.name).open()
    assert server.limiter.streams(tenant) == 1
    await held.close()
    await eventually(lambda: _no_streams(server.limiter.streams(tenant)))


async def test_a_watch_refused_for_the_limit_resumes_when_a_slot_frees(servers: Servers) -> None:
    # As after a server restart: its watchers come to a server where the
    # tenant's slots are taken, and get in as streams end there.
    server = await servers.start(limits=TenantLimits(max_streams=1, submits_per_second=0))
    key, tenant = await server.keys.create_key("acme")
    client = servers.client(server, key)
    job = await client.submit("demo.echo", {})
    held = await OpenWatch(client, job.name).open()
    waiting = asyncio.ensure_future(OpenWatch(client, job.name).open())
    await asyncio.sleep(0.3)
    assert not waiting.done()  # refused, and asking again rather than raising
    await held.close()
    admitted = await asyncio.wait_for(waiting, timeout=30)
    assert admitted.first is not None and admitted.first.seq == 1
    assert server.limiter.streams(tenant) == 1
    await admitted.close()


async def test_a_job_at_the_payload_ceiling_reads_back_through_the_sdk(servers: Servers) -> None:
    server = await servers.start(max_payload_bytes=MAX_PAYLOAD_BYTES_LIMIT)
    key, _tenant = await server.keys.create_key("bulky")
    client = servers.client(server, key)
    # Payload and result each just under 4 MiB: the Job is twice gRPC's
    # default receive limit.
    filler = MAX_PAYLOAD_BYTES_LIMIT - 64
    job = await client.submit("demo.echo", {"blob": "p" * filler})
    # The outcome a worker writes, whose result is held to the same limit.
    async with servers.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE jobs SET state = 'succeeded', result = CAST(:result AS jsonb), "
                "end_time = now() WHERE id = CAST(:id AS uuid)"
            ),
            {"result": json.dumps({"blob": "r" * filler}), "id": job.name.split("/", 1)[1]},
        )
    got = await client.get(job.name)
    assert got.result == {"blob": "r" * filler}
    assert got.payload == {"blob": "p" * filler}
    listed = (await client.list()).jobs
    assert [j.name for j in listed] == [job.name]
    assert listed[0].result == got.result


async def test_a_tenant_alone_meets_no_submit_limit_on_the_defaults(servers: Servers) -> None:
    # As `jobplane serve` starts with no JOBPLANE_TENANT_* set: 64 callers
    # submitting as fast as one server takes them are never refused. Raw
    # stubs, since the SDK would wait out a short refusal and hide it.
    server = await servers.start(limits=TenantLimits.from_settings(Settings.from_env({})))
    # The limiter's clock stands still: every submit counts as arriving at
    # one instant, so what passes does not depend on how fast this machine
    # takes them (a loaded one would stay under any rate).
    server.limiter._clock = lambda: 0.0
    key, _tenant = await server.keys.create_key("alone")
    metadata = (("authorization", f"Bearer {key}"),)
    callers, each = 64, 32
    refused: list[grpc.StatusCode] = []
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)

        async def caller(c: int) -> None:
            for n in range(each):
                try:
                    await stub.SubmitJob(
                        jobs_pb2.SubmitJobRequest(type="demo.echo", request_id=f"{c}-{n}"),
                        metadata=metadata,
                    )
                except grpc.aio.AioRpcError as exc:
                    refused.append(exc.code())

        await asyncio.gather(*(caller(c) for c in range(callers)))
    assert refused == []
    assert await _jobs(servers.engine) == callers * each
