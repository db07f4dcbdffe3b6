"""Idempotency, tenant walls, authentication, bad input and atomic intent."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import (
    InvalidArgument,
    JobNotFound,
    JobState,
    PayloadTooLarge,
    RequestIdReused,
    Unauthenticated,
)
from jobplane.errors import InternalError
from jobplane.faults import FaultPoints
from jobplane.topology import Topology
from jobplane.v1 import jobs_pb2, jobs_pb2_grpc
from tests.support.parts import Started
from tests.support.stack import Stack, start_stack


async def test_request_id_replay_returns_the_same_job(stack: Stack) -> None:
    client = stack.client()
    first = await client.submit("demo.echo", {"a": 1}, request_id="order-42")
    again = await client.submit("demo.echo", {"a": 1}, request_id="order-42")
    assert again.name == first.name
    assert again.request_id == "order-42"
    assert (await stack.counts())["jobs"] == 1

    with pytest.raises(RequestIdReused) as info:
        await client.submit("demo.echo", {"a": 2}, request_id="order-42")
    assert info.value.reason == "REQUEST_ID_REUSED"
    with pytest.raises(RequestIdReused):
        await client.submit("demo.progress", {"a": 1}, request_id="order-42")
    assert (await stack.counts())["jobs"] == 1


async def test_fifty_concurrent_identical_submits_make_one_job(stack: Stack) -> None:
    client = stack.client()
    jobs = await asyncio.gather(
        *(client.submit("demo.echo", {"same": True}, request_id="burst") for _ in range(50))
    )
    assert len({j.name for j in jobs}) == 1
    counts = await stack.counts()
    assert counts["jobs"] == 1
    assert counts["outbox"] == 1


async def test_sdk_fills_request_id(stack: Stack) -> None:
    client = stack.client()
    a = await client.submit("demo.echo", {})
    b = await client.submit("demo.echo", {})
    assert a.request_id and b.request_id and a.request_id != b.request_id
    assert a.name != b.name


async def test_tenants_cannot_see_each_other(stack: Stack) -> None:
    mine = stack.client()
    theirs = stack.client(await stack.new_key("globex"))
    job = await mine.submit("demo.progress", {"steps": 3, "interval_ms": 10})

    with pytest.raises(JobNotFound):
        await theirs.get(job.name)
    with pytest.raises(JobNotFound):
        await theirs.cancel(job.name)
    with pytest.raises(JobNotFound):
        await theirs.retry(job.name)
    with pytest.raises(JobNotFound):
        async for _event in theirs.watch(job.name):
            pass
    assert (await theirs.list()).jobs == []

    # The same request_id in another tenant is another job.
    a = await mine.submit("demo.echo", {}, request_id="shared-id")
    b = await theirs.submit("demo.echo", {}, request_id="shared-id")
    assert a.name != b.name
    assert [j.name for j in (await theirs.list()).jobs] == [b.name]
    assert (await mine.get(job.name)).name == job.name


@pytest.mark.parametrize("key", [None, "", "jp_not-a-real-key", "garbage"])
async def test_missing_or_wrong_key_is_unauthenticated(stack: Stack, key: str | None) -> None:
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        stub = jobs_pb2_grpc.JobServiceStub(channel)
        metadata = None if key is None else (("authorization", f"Bearer {key}"),)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SubmitJob(jobs_pb2.SubmitJobRequest(type="demo.echo"), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ListJobs(jobs_pb2.ListJobsRequest(), metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    client = stack.client(key="jp_wrong")
    with pytest.raises(Unauthenticated):
        await client.list()
    assert (await stack.counts())["jobs"] == 0


@pytest.mark.parametrize(
    ("job_type", "field"),
    [
        ("", "type"),
        ("Upper.Case", "type"),
        ("has space", "type"),
        ("trailing.", "type"),
        (".leading", "type"),
        ("a..b", "type"),
        ("x" * 129, "type"),
        ("emoji.\u2603", "type"),
    ],
)
async def test_bad_job_type_is_refused_and_writes_nothing(
    stack: Stack, job_type: str, field: str
) -> None:
    with pytest.raises(InvalidArgument) as info:
        await stack.client().submit(job_type, {})
    assert info.value.field == field
    assert await stack.counts() == {"jobs": 0, "job_events": 0, "outbox": 0}


async def test_oversized_payload_is_refused(stack: Stack) -> None:
    with pytest.raises(PayloadTooLarge) as info:
        await stack.client().submit("demo.echo", {"blob": "x" * (256 * 1024 + 1)})
    assert info.value.reason == "PAYLOAD_TOO_LARGE"
    assert info.value.field == "payload"
    assert await stack.counts() == {"jobs": 0, "job_events": 0, "outbox": 0}


@pytest.mark.parametrize(
    ("call", "field"),
    [
        ({"page_size": -1}, "page_size"),
        ({"page_token": "not-a-token"}, "page_token"),
        ({"page_token": "eyJ0IjogMX0"}, "page_token"),
    ],
)
async def test_bad_list_arguments(stack: Stack, call: dict[str, Any], field: str) -> None:
    await stack.client().submit("demo.echo", {})
    with pytest.raises(InvalidArgument) as info:
        await stack.client().list(**call)
    assert info.value.field == field


@pytest.mark.parametrize(
    "name", ["", "jobs/", "jobs/123", "job/0d2b1b7e-9c1f-4c39-8f3a-1ad1e5f1c111", "jobs/../etc"]
)
async def test_malformed_names_are_invalid(stack: Stack, name: str) -> None:
    client = stack.client()
    for call in (client.get, client.cancel, client.retry):
        with pytest.raises(InvalidArgument) as info:
            await call(name)
        assert info.value.field == "name"
    with pytest.raises(InvalidArgument):
        async for _event in client.watch(name):
            pass


async def test_unknown_job_is_not_found(stack: Stack) -> None:
    with pytest.raises(JobNotFound):
        await stack.client().get("jobs/0d2b1b7e-9c1f-4c39-8f3a-1ad1e5f1c111")


async def test_unroutable_type_is_refused(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    from dataclasses import replace

    narrow = replace(topology, queues=(replace(topology.queues[0], bindings=("reports.*",)),))
    stack = await started(
        start_stack(engine, database_url, amqp_url, narrow, relay=False, worker=False)
    )
    client = stack.client()
    with pytest.raises(InvalidArgument) as info:
        await client.submit("billing.charge", {})
    assert info.value.reason == "JOB_TYPE_UNROUTABLE"
    job = await client.submit("reports.render", {})
    assert job.state is JobState.QUEUED
    assert (await stack.counts())["jobs"] == 1


async def test_failure_at_the_outbox_insert_leaves_no_job_and_no_event(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    # The database refuses the last insert of the submit (the outbox row): the
    # job row and its first event, written just before, must go with it.
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'outbox refused'; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER refuse BEFORE INSERT ON outbox "
                "FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        )
    stack = await start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    try:
        with pytest.raises(InternalError):
            await stack.client().submit("demo.echo", {"x": 1})
        assert await stack.counts() == {"jobs": 0, "job_events": 0, "outbox": 0}
    finally:
        await stack.close()
        async with engine.begin() as conn:
            await conn.execute(text("DROP TRIGGER refuse ON outbox"))


async def test_a_submit_whose_reply_is_lost_is_found_again_by_its_request_id(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(
            engine,
            database_url,
            amqp_url,
            topology,
            relay=False,
            worker=False,
            faults=FaultPoints({"submit.after_commit"}),
        )
    )
    client = stack.client()
    with pytest.raises(InternalError):
        await client.submit("demo.echo", {"x": 1}, request_id="lost-reply")
    assert await stack.counts() == {"jobs": 1, "job_events": 1, "outbox": 1}
    # The same request again finds the committed job instead of a second one.
    again = await client.submit("demo.echo", {"x": 1}, request_id="lost-reply")
    assert again.request_id == "lost-reply"
    assert await stack.counts() == {"jobs": 1, "job_events": 1, "outbox": 1}
