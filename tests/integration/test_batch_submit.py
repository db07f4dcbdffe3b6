"""BatchSubmitJobs: many jobs in one transaction, each checked and idempotent as SubmitJob's.

Only the server runs (no relay, no worker) except where a test says so: the
counts of rows are then the batch's alone.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from jobplane.client import (
    InvalidArgument,
    JobNotFound,
    JobSpec,
    JobState,
    RequestIdReused,
    TenantLimitExceeded,
)
from jobplane.client.aio import MAX_RECEIVE_BYTES
from jobplane.convert import struct_from_dict
from jobplane.server.limits import TenantLimits
from jobplane.server.service import MAX_BATCH_REQUEST_BYTES
from jobplane.v1 import jobs_pb2, jobs_pb2_grpc
from tests.integration.test_cli_and_sync import jobplane
from tests.support.answers import check_refusal
from tests.support.stack import Stack, eventually

pytestmark = pytest.mark.stack(relay=False, worker=False)


def item(request_id: str = "", job_type: str = "demo.echo", **payload: Any) -> Any:
    return jobs_pb2.SubmitJobRequest(
        type=job_type, payload=struct_from_dict(payload), request_id=request_id
    )


@pytest.fixture(autouse=True)
def unlimited(stack: Stack) -> None:
    """No submit rate here but where a test sets one: the batches are large."""
    stack.server.limiter.limits = TenantLimits(submits_per_second=0)


@pytest.fixture
async def stub(stack: Stack) -> AsyncIterator[jobs_pb2_grpc.JobServiceAsyncStub]:
    # The reply of a batch holds every payload: read as much as the SDK reads.
    options = [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]
    async with grpc.aio.insecure_channel(stack.server.address, options=options) as channel:
        yield jobs_pb2_grpc.JobServiceStub(channel)


async def batch(
    stack: Stack,
    stub: jobs_pb2_grpc.JobServiceAsyncStub,
    requests: list[Any],
    key: str | None = None,
) -> list[jobs_pb2.Job]:
    reply = await stub.BatchSubmitJobs(
        jobs_pb2.BatchSubmitJobsRequest(requests=requests),
        metadata=(("authorization", f"Bearer {key or stack.key}"),),
    )
    return list(reply.jobs)


async def refused(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub, requests: list[Any]
) -> tuple[grpc.StatusCode, str, str | None]:
    """The batch is refused precisely, and writes nothing: (code, reason, field)."""
    before = await stack.counts()
    events = await stack.scalar("SELECT count(*) FROM events")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await batch(stack, stub, requests)
    refusal = check_refusal(info.value)
    assert await stack.counts() == before
    assert await stack.scalar("SELECT count(*) FROM events") == events
    return refusal.code, refusal.reason, refusal.field


async def test_the_jobs_come_back_in_order_with_their_events_and_dispatches(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    requests = [item(f"r-{i}", n=i) for i in range(50, 0, -1)]
    jobs = await batch(stack, stub, requests)
    assert [j.request_id for j in jobs] == [r.request_id for r in requests]
    assert [dict(j.payload)["n"] for j in jobs] == [50 - i for i in range(50)]
    assert {j.state for j in jobs} == {jobs_pb2.Job.STATE_QUEUED}
    assert len({j.name for j in jobs}) == 50
    assert await stack.counts() == {"jobs": 50, "job_events": 50, "outbox": 50}
    # Each its own job.queued lifecycle event, in the same transaction.
    assert await stack.scalar("SELECT count(*) FROM events WHERE event_type = 'job.queued'") == 50
    got = await stack.client().get(jobs[7].name)
    assert got.request_id == "r-43" and got.payload == {"n": 43}


@pytest.mark.stack(relay=True, worker=True)
async def test_every_job_of_a_batch_runs(stack: Stack) -> None:
    client = stack.client()
    specs = [JobSpec("demo.echo", {"i": i}) for i in range(40)]
    jobs = await client.submit_many([*specs, {"type": "demo.fail", "max_attempts": 1}])
    assert len(jobs) == 41

    async def ended() -> bool:
        states = [(await client.get(j.name)).state for j in jobs]
        return all(s.terminal for s in states)

    await eventually(ended, timeout=30)
    done = [await client.get(j.name) for j in jobs]
    assert [j.state for j in done] == [JobState.SUCCEEDED] * 40 + [JobState.FAILED]
    assert [j.result for j in done[:40]] == [{"i": i} for i in range(40)]


async def submit_refusal(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub, request: Any
) -> tuple[grpc.StatusCode, str, str | None]:
    """What SubmitJob answers ``request``."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.SubmitJob(request, metadata=(("authorization", f"Bearer {stack.key}"),))
    refusal = check_refusal(info.value)
    return refusal.code, refusal.reason, refusal.field


async def test_a_bad_request_refuses_the_batch_at_its_index(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    good = [item(f"ok-{i}") for i in range(5)]
    timeout = jobs_pb2.SubmitJobRequest(type="demo.echo")
    timeout.timeout.seconds = -1
    nan = jobs_pb2.SubmitJobRequest(type="demo.echo")
    nan.payload["x"] = float("nan")
    bads = [
        item("x", "Not A Type"),
        jobs_pb2.SubmitJobRequest(type="demo.echo", labels={"Bad Key": "v"}),
        jobs_pb2.SubmitJobRequest(type="demo.echo", labels={"k": "\x00"}),
        timeout,
        nan,
        jobs_pb2.SubmitJobRequest(type="demo.echo", max_attempts=101),
        jobs_pb2.SubmitJobRequest(type="demo.echo", correlation_id="c" * 256),
        jobs_pb2.SubmitJobRequest(type="demo.echo", payload_blob="blobs/" + "0" * 64),
        jobs_pb2.SubmitJobRequest(type="demo.echo", blob_references=["nope"]),
    ]
    for k, bad in enumerate(bads):
        code, reason, field = await submit_refusal(stack, stub, bad)
        at = k % 6
        # The answer SubmitJob gives, the field under the request's index.
        assert await refused(stack, stub, [*good[:at], bad, *good[at:]]) == (
            code,
            reason,
            f"requests[{at}].{field}",
        ), bad
    # The first bad request is the one named.
    assert (await refused(stack, stub, [good[0], bads[1], bads[0]]))[2] == "requests[1].labels"


async def test_a_batch_holds_one_to_a_thousand_requests(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    assert (await refused(stack, stub, []))[2] == "requests"
    assert (await refused(stack, stub, [item() for _ in range(1001)]))[2] == "requests"
    jobs = await batch(stack, stub, [item() for _ in range(1000)])
    assert len({j.name for j in jobs}) == 1000
    assert (await stack.counts())["jobs"] == 1000


async def test_a_thousand_jobs_of_16_kib_fit_in_one_call(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    limit = stack.server.max_receive_bytes
    assert limit == MAX_BATCH_REQUEST_BYTES
    requests = [item(text="x" * 16_000) for _ in range(1000)]
    body = jobs_pb2.BatchSubmitJobsRequest(requests=requests)
    assert 0.95 * limit < body.ByteSize() <= limit
    assert len(await batch(stack, stub, requests)) == 1000
    # One more and gRPC refuses the body before reading it.
    before = await stack.counts()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await batch(stack, stub, [*requests[:999], item(text="x" * 800_000)])
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await stack.counts() == before


async def test_two_requests_of_a_batch_may_not_share_a_request_id(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    requests = [item("a"), item("b"), item("c"), item("b")]
    assert (await refused(stack, stub, requests))[::2] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "requests[3].request_id",
    )
    # Empty request_ids are each a fresh one, not a shared one.
    assert len({j.name for j in await batch(stack, stub, [item(), item()])}) == 2


@pytest.mark.parametrize("reserved", ["fan:x:1:1:0", "child:y:k"])
async def test_a_request_id_in_the_systems_space_is_refused_by_submit_and_batch(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub, reserved: str
) -> None:
    assert (await refused(stack, stub, [item("a"), item(reserved)]))[::2] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "requests[1].request_id",
    )
    before = await stack.counts()
    with pytest.raises(InvalidArgument) as single:
        await stack.client().submit("demo.echo", {}, request_id=reserved)
    assert single.value.field == "request_id" and "system" in str(single.value)
    assert await stack.counts() == before
    # Only the prefix is the system's: the same words elsewhere are the caller's.
    assert len(await batch(stack, stub, [item(f"my-{reserved}"), item("fan")])) == 2


async def test_a_replayed_batch_returns_the_same_jobs_and_creates_nothing(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    first = await batch(stack, stub, [item(f"r{i}", i=i) for i in range(10)])
    counts = await stack.counts()
    # Key order and 1 vs 1.0 are the same request, as for SubmitJob.
    again = await batch(stack, stub, [item(f"r{i}", i=float(i)) for i in range(10)])
    assert [j.name for j in again] == [j.name for j in first]
    assert await stack.counts() == counts
    # Part replayed, part new: the old ones are the stored jobs, the new ones created.
    mixed = await batch(
        stack, stub, [item("new-1"), item("r3", i=3), item("new-2"), item("r0", i=0)]
    )
    assert mixed[1].name == first[3].name and mixed[3].name == first[0].name
    assert {mixed[0].name, mixed[2].name}.isdisjoint(j.name for j in first)
    assert (await stack.counts())["jobs"] == counts["jobs"] + 2
    # SubmitJob sees the batch's jobs as its own replays.
    single = await stack.client().submit("demo.echo", {"i": 5}, request_id="r5")
    assert single.name == first[5].name


async def test_a_reused_request_id_refuses_the_batch_as_submit_does(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    await batch(stack, stub, [item("taken", i=1)])
    code, reason, field = await refused(
        stack, stub, [item("fresh-1"), item("fresh-2"), item("taken", i=2), item("fresh-3")]
    )
    assert (code, reason, field) == (
        grpc.StatusCode.ALREADY_EXISTS,
        RequestIdReused.reason,
        "requests[2].request_id",
    )
    # ... which is SubmitJob's answer for the same reuse.
    with pytest.raises(RequestIdReused) as info:
        await stack.client().submit("demo.echo", {"i": 2}, request_id="taken")
    assert info.value.field == "request_id"
    assert await stack.scalar("SELECT count(*) FROM jobs WHERE request_id LIKE 'fresh-%'") == 0


async def test_request_ids_are_the_tenants_own(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    mine = await batch(stack, stub, [item("shared-1"), item("shared-2")])
    other = await stack.new_key("globex")
    theirs = await batch(stack, stub, [item("shared-2"), item("shared-1")], key=other)
    assert {j.name for j in theirs}.isdisjoint(j.name for j in mine)
    assert (await stack.counts())["jobs"] == 4
    with pytest.raises(JobNotFound):
        await stack.client().get(theirs[0].name)
    assert (await stack.client(other).get(theirs[0].name)).request_id == "shared-2"


async def test_concurrent_overlapping_batches_neither_fail_nor_duplicate(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    shuffler = random.Random(7)
    ids = [f"o-{i}" for i in range(300)]
    batches = []
    for _ in range(6):
        chosen = shuffler.sample(ids, 200)
        batches.append([item(rid, rid=rid) for rid in chosen])
    replies = await asyncio.gather(*(batch(stack, stub, b) for b in batches))
    names: dict[str, set[str]] = {}
    for requests, jobs in zip(batches, replies, strict=True):
        for request, job in zip(requests, jobs, strict=True):
            assert job.request_id == request.request_id
            names.setdefault(job.request_id, set()).add(job.name)
    # One job per request_id, whichever batch created it.
    assert all(len(found) == 1 for found in names.values())
    assert (await stack.counts())["jobs"] == len(names)


async def test_a_batch_spends_a_submit_token_a_job(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    stack.server.limiter.limits = TenantLimits(submits_per_second=0.01, submit_burst=10)
    client = stack.client()
    assert len(await client.submit_many([JobSpec("demo.echo")] * 8)) == 8
    # 2 tokens are left: a batch of 3 waits for more than the SDK waits for.
    with pytest.raises(TenantLimitExceeded) as info:
        await client.submit_many([JobSpec("demo.echo")] * 3)
    assert info.value.retry_delay is not None and info.value.retry_delay > 2
    # More than the burst can never pass at once, and says so.
    stack.server.limiter.limits = TenantLimits(submits_per_second=1000, submit_burst=10)
    with pytest.raises(TenantLimitExceeded) as info:
        await client.submit_many([JobSpec("demo.echo")] * 11)
    assert info.value.retry_delay is None and "burst" in info.value.message
    assert (await stack.counts())["jobs"] == 8


class _Counting(grpc.aio.UnaryUnaryClientInterceptor):
    """Counts the BatchSubmitJobs calls and their sizes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method
        if (method.decode() if isinstance(method, bytes) else method).endswith("/BatchSubmitJobs"):
            self.sizes.append(len(request.requests))
        return await continuation(details, request)


async def test_submit_many_splits_and_names_the_callers_index(stack: Stack) -> None:
    counting = _Counting()
    client = stack.client(interceptors=[counting])
    specs = [JobSpec("demo.echo", {"i": i}, request_id=f"s-{i}") for i in range(2500)]
    jobs = await client.submit_many(specs)
    assert counting.sizes == [1000, 1000, 500]
    assert [j.request_id for j in jobs] == [s.request_id for s in specs]
    assert (await stack.counts())["jobs"] == 2500
    # A bad spec in the third call: the index is the caller's, not the call's.
    bad = [*specs[:2100], JobSpec("Not A Type"), *specs[2100:2200]]
    with pytest.raises(InvalidArgument) as info:
        await client.submit_many(bad)
    assert info.value.field == "requests[2100].type"
    assert info.value.metadata["index"] == "2100"
    assert info.value.message.startswith("requests[2100]: ")
    # Every spec before the refused call was a replay: nothing new.
    assert (await stack.counts())["jobs"] == 2500
    # Nothing to submit is no call at all.
    calls = len(counting.sizes)
    assert await client.submit_many([]) == [] and len(counting.sizes) == calls


async def test_submit_many_splits_by_size_too(stack: Stack) -> None:
    counting = _Counting()
    client = stack.client(interceptors=[counting])
    # 60 KiB payloads (below the inline limit): 8 MiB takes about 136 of them.
    jobs = await client.submit_many(
        [{"type": "demo.echo", "payload": {"blob": "x" * 60_000}} for _ in range(300)]
    )
    assert len(jobs) == 300 and len(counting.sizes) == 3
    assert all(size < 150 for size in counting.sizes)


async def test_the_sync_client_submits_many(stack: Stack) -> None:
    from jobplane.client import Client

    def run() -> list[str]:
        with Client(stack.server.address, stack.key) as client:
            return [
                j.request_id
                for j in client.submit_many(
                    [JobSpec("demo.echo", request_id=str(uuid.UUID(int=i))) for i in range(3)]
                )
            ]

    assert await asyncio.to_thread(run) == [str(uuid.UUID(int=i)) for i in range(3)]


async def test_cli_submits_a_jsonl_file_and_names_a_bad_line(stack: Stack, tmp_path: Path) -> None:
    lines = [
        json.dumps({"type": "demo.echo", "payload": {"i": 1}, "request_id": "cli-1"}),
        "",
        json.dumps(
            {"type": "demo.echo", "labels": {"team": "bi"}, "max_attempts": 2, "timeout": 5}
        ),
    ]
    good = tmp_path / "jobs.jsonl"
    good.write_text("\n".join(lines) + "\n")
    code, out, err = await jobplane(stack, "submit", "--from-jsonl", str(good))
    assert code == 0, err
    printed = out.splitlines()
    assert len(printed) == 2 and all(line.endswith(" queued") for line in printed)
    first = await stack.client().get(printed[0].split()[0])
    assert (first.request_id, first.payload) == ("cli-1", {"i": 1})
    second = await stack.client().get(printed[1].split()[0])
    assert (second.labels, second.max_attempts) == ({"team": "bi"}, 2)

    # A line that is no job: its number, and nothing sent.
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], '{"type": "demo.echo", "colour": "red"}']) + "\n")
    code, out, err = await jobplane(stack, "submit", "--from-jsonl", str(bad))
    assert code == 2 and out == ""
    assert "line 2" in err and "colour" in err
    # A line the server refuses: its number, and nothing written.
    jobs = await stack.scalar("SELECT count(*) FROM jobs")
    refused_line = json.dumps({"type": "demo.echo", "max_attempts": 1000})
    bad.write_text("\n".join([lines[2], "", refused_line]) + "\n")
    code, out, err = await jobplane(stack, "submit", "--from-jsonl", str(bad))
    assert code == 1 and out == ""
    assert "line 3" in err and "max_attempts" in err
    assert await stack.scalar("SELECT count(*) FROM jobs") == jobs
    # From stdin, with --json.
    code, out, err = await jobplane(
        stack, "submit", "--from-jsonl", "-", "--json", stdin=lines[0].encode()
    )
    assert code == 0, err
    assert json.loads(out)["name"] == first.name
