"""Database sessions terminated under load: callers see UNAVAILABLE, never INTERNAL.

``pg_terminate_backend`` is what a failover or an operator does to every
session at once. The server must call that "unavailable" (which the SDK
repeats and resumes), not "internal" (which it treats as final); worker, relay
and the LISTEN connections reconnect, and every job still ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections import Counter
from pathlib import Path

import asyncpg
import grpc
import pytest
from sqlalchemy.engine import make_url

from jobplane.client import JobState
from jobplane.store.down import database_down
from jobplane.store.engine import create_engine
from jobplane.topology import Topology
from jobplane.v1 import jobs_pb2, jobs_pb2_grpc
from tests.faults.cluster import topology_toml
from tests.support import services
from tests.support.parts import Started
from tests.support.proxy import PostgresProxy
from tests.support.stack import Stack, start_stack


async def _terminate_sessions(database: str) -> int:
    admin = await asyncpg.connect(services.PG_ADMIN_URL)
    try:
        killed = await admin.fetchval(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = $1 AND pid <> pg_backend_pid()",
            database,
        )
    finally:
        await admin.close()
    return int(killed or 0)


async def _keep_terminating(database: str, rounds: list[int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        rounds.append(await _terminate_sessions(database))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.25)


async def test_terminated_sessions_reach_callers_only_as_unavailable(stack: Stack) -> None:
    database = make_url(stack.database_url).database
    assert database
    client = stack.client()
    # Warm every part up so each holds sessions worth terminating.
    first = await client.submit("demo.echo", {"warm": True})
    assert (await client.wait(first.name, timeout=20)).state is JobState.SUCCEEDED

    channel = grpc.aio.insecure_channel(stack.server.address)
    stub = jobs_pb2_grpc.JobServiceStub(channel)
    metadata = (("authorization", f"Bearer {stack.key}"),)
    codes: Counter[str] = Counter()
    names: list[str] = []

    async def raw_calls(n: int) -> None:
        # The SDK hides UNAVAILABLE by repeating; raw calls show the status itself.
        for i in range(n):
            request_id = f"raw-{i}-{uuid.uuid4()}"
            request = jobs_pb2.SubmitJobRequest(type="demo.echo", request_id=request_id)
            while True:
                try:
                    job = await stub.SubmitJob(request, metadata=metadata, timeout=10)
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] += 1
                    await asyncio.sleep(0.05)
                    continue
                codes["OK"] += 1
                names.append(job.name)
                try:
                    await stub.GetJob(
                        jobs_pb2.GetJobRequest(name=job.name), metadata=metadata, timeout=10
                    )
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] += 1
                break

    async def sdk_job(i: int) -> JobState:
        # What a user writes, with no retry loop of their own: the SDK repeats
        # what is safe to repeat (submit has a request_id; watch resumes by seq).
        job = await client.submit(
            "demo.progress", {"steps": 5, "interval_ms": 20}, request_id=f"sdk-{i}"
        )
        seqs = [event.seq async for event in client.watch(job.name)]
        assert seqs == list(range(1, len(seqs) + 1)), seqs
        return (await client.wait(job.name, timeout=60)).state

    stop = asyncio.Event()
    rounds: list[int] = []
    killer = asyncio.create_task(_keep_terminating(database, rounds, stop))
    try:
        states = await asyncio.wait_for(
            asyncio.gather(raw_calls(40), *(sdk_job(i) for i in range(8))), timeout=90
        )
    finally:
        stop.set()
        await killer
        await channel.close()

    assert sum(rounds) > 0, "no session was terminated: the test proved nothing"
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes
    assert states[1:] == [JobState.SUCCEEDED] * 8
    for name in names:
        assert (await client.wait(name, timeout=60)).state is JobState.SUCCEEDED


async def test_database_down_tells_a_lost_session_from_a_refused_statement(stack: Stack) -> None:
    database = make_url(stack.database_url).database
    assert database
    conn = await asyncpg.connect(stack.database_url)
    try:
        with pytest.raises(asyncpg.PostgresError) as refused:
            await conn.execute("SELECT 1/0")
        assert not database_down(refused.value)
        pid = await conn.fetchval("SELECT pg_backend_pid()")
        sleeper = asyncio.create_task(conn.execute("SELECT pg_sleep(5)"))
        await asyncio.sleep(0.2)
        admin = await asyncpg.connect(services.PG_ADMIN_URL)
        try:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
        finally:
            await admin.close()
        with pytest.raises(Exception) as lost:  # noqa: PT011 - the driver's class is tested
            await sleeper
        assert database_down(lost.value), repr(lost.value)
    finally:
        await conn.close()


async def test_a_database_starting_up_is_unavailable_to_callers_and_waited_out(
    database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    # 57P03 ("the database system is starting up") is what every restart and
    # failover answers new sessions for a while: the database is down.
    target = make_url(database_url)
    database = target.database
    assert database
    proxy = PostgresProxy(target.host or "127.0.0.1", target.port or 5432)
    await proxy.start()
    started.callback(proxy.cut)
    proxied = target.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    engine = create_engine(proxied, pool_size=4)
    started.callback(engine.dispose)
    stack = await started(start_stack(engine, proxied, amqp_url, topology))
    channel = await started(grpc.aio.insecure_channel(stack.server.address))
    client = stack.client()
    first = await client.submit("demo.echo", {"warm": True})
    assert (await client.wait(first.name, timeout=20)).state is JobState.SUCCEEDED

    proxy.starting_up = True
    assert await _terminate_sessions(database) > 0  # the restart: every session ends
    stub = jobs_pb2_grpc.JobServiceStub(channel)
    metadata = (("authorization", f"Bearer {stack.key}"),)
    codes: Counter[str] = Counter()
    for i in range(10):
        request = jobs_pb2.SubmitJobRequest(type="demo.echo", request_id=f"starting-{i}")
        try:
            await stub.SubmitJob(request, metadata=metadata, timeout=10)
            codes["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] += 1
        try:
            await stub.GetJob(
                jobs_pb2.GetJobRequest(name=first.name), metadata=metadata, timeout=10
            )
            codes["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] += 1
        await asyncio.sleep(0.1)
    assert proxy.refused > 0, "no session was refused: the test proved nothing"
    assert codes["UNAVAILABLE"] > 0
    assert set(codes) <= {"OK", "UNAVAILABLE"}, codes

    proxy.starting_up = False  # the database is up again
    job = await client.submit("demo.echo", {"after": True})
    assert (await client.wait(job.name, timeout=60)).state is JobState.SUCCEEDED


async def _line_with(stream: asyncio.StreamReader, text: str, seen: list[str]) -> None:
    while True:
        line = (await stream.readline()).decode()
        if not line:
            raise AssertionError(f"the process ended before saying {text!r}: {seen}")
        seen.append(line)
        if text in line:
            return


async def test_the_sweep_loop_waits_out_a_database_starting_up(
    database_url: str, amqp_url: str, topology: Topology, tmp_path: Path
) -> None:
    target = make_url(database_url)
    proxy = PostgresProxy(target.host or "127.0.0.1", target.port or 5432)
    proxy.starting_up = True
    await proxy.start()
    path = tmp_path / "topology.toml"
    path.write_text(topology_toml(topology))
    env = {
        **os.environ,
        "JOBPLANE_DATABASE_URL": target.set(host="127.0.0.1", port=proxy.port).render_as_string(
            False
        ),
        "JOBPLANE_AMQP_URL": amqp_url,
        "JOBPLANE_TOPOLOGY": str(path),
        "JOBPLANE_METRICS_LISTEN": "off",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jobplane", "sweep", "--interval", "0.2",
        env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    seen: list[str] = []
    try:
        await asyncio.wait_for(_line_with(process.stderr, "database unavailable", seen), 60)
        proxy.starting_up = False
        await asyncio.wait_for(_line_with(process.stderr, "leases: 0 requeued", seen), 60)
        assert process.returncode is None
        assert proxy.refused > 0
    finally:
        if process.returncode is None:
            process.terminate()
        await asyncio.wait_for(process.wait(), 30)
        await proxy.cut()
