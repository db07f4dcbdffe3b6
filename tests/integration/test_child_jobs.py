"""Child jobs on the real stack: ``ctx.submit``, ``SubmitChildJob``, the fence,
one child per key across attempts, and a parent's cancel reaching its tree
(docs/workflows.md, ADR-0046)."""

from __future__ import annotations

import asyncio
import functools
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from sqlalchemy import text

from jobplane import txn
from jobplane.client import Job, JobState
from jobplane.convert import struct_from_dict
from jobplane.errors import (
    ChildLimitReached,
    FailedPrecondition,
    InvalidArgument,
    RequestIdReused,
)
from jobplane.store import children as children_module
from jobplane.store.attempts import Attempt, AttemptStore, ClaimStatus, LeaseLost
from jobplane.store.children import ChildStore, ParentFence, child_request_id
from jobplane.v1 import workers_pb2, workers_pb2_grpc
from jobplane.workers.children import ChildRequest, child_job, fence_of
from jobplane.workers.handlers import JobContext, Registry, RetryableError
from tests.integration.test_cli_and_sync import jobplane
from tests.support.answers import check_refusal
from tests.support.dashboard import browserless, ui_stack
from tests.support.stack import Stack, eventually

pytestmark = pytest.mark.stack(worker=False)


async def _ended(client: Any, name: str) -> bool:
    return bool((await client.get(name)).state.terminal)


async def _children_rows(stack: Stack, parent: str) -> int:
    return int(
        await stack.scalar(
            "SELECT count(*) FROM jobs WHERE parent_id = :id", id=parent.removeprefix("jobs/")
        )
    )


# -- ctx.submit in a Python worker ---------------------------------------------------


async def test_a_handler_submits_children_that_run_and_are_listed_by_parent(
    stack: Stack,
) -> None:
    registry = Registry()

    @registry.handler("fan.out")
    async def fan_out(ctx: JobContext) -> dict[str, Any]:
        names = [
            await ctx.submit("fan.leaf", {"i": i}, key=f"chunk-{i}")
            for i in range(ctx.payload["n"])
        ]
        return {"children": names}

    @registry.handler("fan.leaf")
    async def leaf(ctx: JobContext) -> dict[str, Any]:
        return {"square": ctx.payload["i"] ** 2}

    await stack.start_worker(registry)
    client = stack.client()
    parent = await client.submit("fan.out", {"n": 3})
    await eventually(lambda: _ended(client, parent.name))
    done = await client.get(parent.name)
    assert done.state is JobState.SUCCEEDED and done.parent == ""
    assert done.result is not None
    names = done.result["children"]
    assert len(set(names)) == 3

    listed = await client.list(parent=parent.name)
    assert sorted(j.name for j in listed.jobs) == sorted(names)
    assert {j.parent for j in listed.jobs} == {parent.name}
    # Other jobs are not its children; the filter is the parent's alone.
    other = await client.submit("fan.leaf", {"i": 9})
    assert other.name not in {j.name for j in (await client.list(parent=parent.name)).jobs}
    for name in names:
        await eventually(functools.partial(_ended, client, name))
    leaves = [await client.get(n) for n in names]
    assert sorted(leaf.result["square"] for leaf in leaves if leaf.result) == [0, 1, 4]
    # A page at a time, with its token tied to the filter.
    first = await client.list(parent=parent.name, page_size=2)
    assert len(first.jobs) == 2 and first.next_page_token
    rest = await client.list(parent=parent.name, page_size=2, page_token=first.next_page_token)
    assert len(rest.jobs) == 1 and not rest.next_page_token


async def test_a_handler_run_again_after_a_crash_gets_the_same_children(stack: Stack) -> None:
    registry = Registry()
    seen: dict[int, list[str]] = {}

    @registry.handler("fan.crashy")
    async def crashy(ctx: JobContext) -> dict[str, Any]:
        seen[ctx.attempt] = [
            await ctx.submit("fan.leaf", {"i": i}, key=f"chunk-{i}") for i in range(3)
        ]
        if ctx.attempt == 1:
            raise RetryableError("crashed after submitting", delay=0.0)
        return {}

    @registry.handler("fan.leaf")
    async def leaf(ctx: JobContext) -> dict[str, Any]:
        return {}

    await stack.start_worker(registry)
    client = stack.client()
    parent = await client.submit("fan.crashy", {}, max_attempts=3)
    await eventually(lambda: _ended(client, parent.name))
    assert (await client.get(parent.name)).state is JobState.SUCCEEDED
    assert sorted(seen) == [1, 2]
    assert seen[1] == seen[2]
    assert await _children_rows(stack, parent.name) == 3


# -- the store's fence, key and cap --------------------------------------------------


async def _running(stack: Stack, store: AttemptStore, job: Job) -> Attempt:
    claim = await store.claim(await stack.envelope(job.id))
    assert claim.status is ClaimStatus.CLAIMED and claim.attempt is not None
    return claim.attempt


def _leaf(stack: Stack, key: str, **payload: Any) -> tuple[str, Any]:
    request = ChildRequest(key=key, type="fan.leaf", payload=payload)
    new = child_job(stack.topology, request, parent_correlation_id="", max_payload_bytes=256 * 1024)
    return key, new


async def test_a_stale_attempt_cannot_submit_a_child(bare: Stack) -> None:
    store = AttemptStore(bare.db, lease_seconds=0.3)
    children = ChildStore(bare.db)
    job = await bare.client().submit("fan.out", {})
    first = await _running(bare, store, job)
    wrong = ParentFence(first.tenant_id, first.job_id, first.attempt, uuid.uuid4())
    with pytest.raises(LeaseLost):
        await children.submit(wrong, *_leaf(bare, "a"))
    other_tenant = ParentFence(uuid.uuid4(), first.job_id, first.attempt, first.lease_token)
    with pytest.raises(LeaseLost):
        await children.submit(other_tenant, *_leaf(bare, "a"))

    # Its lease runs out and a redelivery starts attempt 2: attempt 1 is fenced out.
    await asyncio.sleep(0.5)
    second = await _running(bare, store, job)
    assert second.attempt == first.attempt + 1
    with pytest.raises(LeaseLost):
        await children.submit(fence_of(first), *_leaf(bare, "a"))
    assert await _children_rows(bare, job.name) == 0
    child, created = await children.submit(fence_of(second), *_leaf(bare, "a"))
    assert created and child.parent == job.name

    # Ended, the job submits nothing more.
    await store.succeed(second, {})
    with pytest.raises(LeaseLost):
        await children.submit(fence_of(second), *_leaf(bare, "b"))
    assert await _children_rows(bare, job.name) == 1


async def test_a_key_is_one_child_and_a_different_request_under_it_is_refused(
    bare: Stack,
) -> None:
    store = AttemptStore(bare.db, lease_seconds=30.0)
    children = ChildStore(bare.db)
    attempt = await _running(bare, store, await bare.client().submit("fan.out", {}))
    made, created = await children.submit(fence_of(attempt), *_leaf(bare, "k", i=1))
    again, created_again = await children.submit(fence_of(attempt), *_leaf(bare, "k", i=1))
    assert (created, created_again) == (True, False) and again.name == made.name
    with pytest.raises(RequestIdReused) as reused:
        await children.submit(fence_of(attempt), *_leaf(bare, "k", i=2))
    assert reused.value.field == "key"
    assert await _children_rows(bare, f"jobs/{attempt.job_id}") == 1


async def test_a_key_whose_request_id_a_job_of_the_tenant_took_is_refused_by_key(
    bare: Stack,
) -> None:
    """A job the tenant submitted in its own transaction before migration 0028 holds the
    request_id of the key's child: ``jobplane.submit_job`` took the system's prefixes
    until then, and refuses them now. The row is made as it wrote it, its request_id
    set afterwards."""
    store = AttemptStore(bare.db, lease_seconds=30.0)
    children = ChildStore(bare.db)
    attempt = await _running(bare, store, await bare.client().submit("fan.out", {}))
    request_id = child_request_id(attempt.job_id, "k")
    async with bare.engine.begin() as conn:
        with pytest.raises(InvalidArgument) as refused:
            async with conn.begin_nested():
                await txn.submit_job(conn, tenant="acme", type="fan.leaf", request_id=request_id)
        assert refused.value.field == "request_id"
        other = await txn.submit_job(conn, tenant="acme", type="fan.leaf", request_id="before")
        await conn.execute(
            text("UPDATE jobs SET request_id = :request_id WHERE id = :id"),
            {"request_id": request_id, "id": other},
        )
    with pytest.raises(RequestIdReused) as reused:
        await children.submit(fence_of(attempt), *_leaf(bare, "k"))
    assert reused.value.field == "key"
    assert str(reused.value) == (
        f"the request_id of key 'k' was taken by a job that is not a child of jobs/{attempt.job_id}"
    )
    assert await _children_rows(bare, f"jobs/{attempt.job_id}") == 0
    assert await bare.scalar("SELECT parent_id FROM jobs WHERE id = :id", id=other) is None


async def test_past_the_cap_a_new_child_is_refused_and_a_known_key_still_answers(
    bare: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(children_module, "MAX_CHILDREN", 2)
    store = AttemptStore(bare.db, lease_seconds=30.0)
    children = ChildStore(bare.db)
    attempt = await _running(bare, store, await bare.client().submit("fan.out", {}))
    first, _ = await children.submit(fence_of(attempt), *_leaf(bare, "a"))
    await children.submit(fence_of(attempt), *_leaf(bare, "b"))
    with pytest.raises(ChildLimitReached) as capped:
        await children.submit(fence_of(attempt), *_leaf(bare, "c"))
    assert capped.value.metadata["max"] == "2"
    replay, created = await children.submit(fence_of(attempt), *_leaf(bare, "a"))
    assert replay.name == first.name and not created
    assert await _children_rows(bare, f"jobs/{attempt.job_id}") == 2


# -- cancel ------------------------------------------------------------------------------


async def test_cancel_of_a_parent_cancels_its_queued_and_running_descendants(
    bare: Stack,
) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    children = ChildStore(bare.db)
    parent = await client.submit("fan.out", {})
    running_parent = await _running(bare, store, parent)
    queued, _ = await children.submit(fence_of(running_parent), *_leaf(bare, "queued"))
    busy, _ = await children.submit(fence_of(running_parent), *_leaf(bare, "busy"))
    done, _ = await children.submit(fence_of(running_parent), *_leaf(bare, "done"))
    running_busy = await _running(bare, store, busy)
    grandchild, _ = await children.submit(fence_of(running_busy), *_leaf(bare, "deeper"))
    await store.succeed(await _running(bare, store, done), {})

    pending = "SELECT count(*) FROM outbox WHERE job_id = :id AND published_at IS NULL"
    assert await bare.scalar(pending, id=queued.id) == 1
    cancelled = await client.cancel(parent.name, reason="no longer needed")
    assert cancelled.cancel_requested and cancelled.state is JobState.RUNNING
    states = {j.name: await client.get(j.name) for j in (queued, busy, done, grandchild)}
    assert states[queued.name].state is JobState.CANCELLED
    assert states[grandchild.name].state is JobState.CANCELLED
    assert states[busy.name].state is JobState.RUNNING and states[busy.name].cancel_requested
    assert states[done.name].state is JobState.SUCCEEDED
    # A QUEUED child's dispatch went with it: nothing of it is left to publish.
    assert await bare.scalar(pending, id=queued.id) == 0
    # Asked to cancel, the parent's attempt submits no more children.
    with pytest.raises(FailedPrecondition):
        await children.submit(fence_of(running_parent), *_leaf(bare, "late"))
    assert await _children_rows(bare, parent.name) == 3


async def test_a_grandchild_committed_while_the_cancel_waits_is_cancelled_too(
    bare: Stack,
) -> None:
    """The cancel's walk waits for a child's lock, held by a transaction that
    makes a grandchild of it; once that commits, the grandchild is cancelled too."""
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    children = ChildStore(bare.db)
    parent = await client.submit("fan.out", {})
    running_parent = await _running(bare, store, parent)
    child, _ = await children.submit(fence_of(running_parent), *_leaf(bare, "child"))
    await _running(bare, store, child)
    loose = await client.submit("demo.echo", {})
    async with bare.engine.connect() as holder:
        transaction = await holder.begin()
        await holder.execute(
            text("SELECT 1 FROM jobs WHERE id = :id FOR NO KEY UPDATE"), {"id": child.id}
        )
        # As a submit of the child's attempt would: a new job under it, not committed.
        await holder.execute(
            text("UPDATE jobs SET parent_id = :parent WHERE id = :id"),
            {"parent": child.id, "id": loose.id},
        )
        cancel = asyncio.create_task(client.cancel(parent.name, reason="stop"))

        async def blocked() -> bool:
            waiting = await bare.scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
            return bool(waiting)

        await eventually(blocked)
        await transaction.commit()
    await asyncio.wait_for(cancel, timeout=30)
    assert (await client.get(child.name)).cancel_requested
    assert (await client.get(loose.name)).state is JobState.CANCELLED


async def test_a_parent_that_ends_on_its_own_leaves_its_children_running(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    children = ChildStore(bare.db)
    parent = await _running(bare, store, await client.submit("fan.out", {}))
    child, _ = await children.submit(fence_of(parent), *_leaf(bare, "a"))
    await store.fail(parent, "BROKEN", "broken", retryable=False)
    assert (await client.get(child.name)).state is JobState.QUEUED


# -- WorkerService.SubmitChildJob ------------------------------------------------------


@pytest.fixture
async def workers(stack: Stack) -> AsyncIterator[tuple[Any, Any]]:
    key = (await stack.server.keys.create_worker()).key
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        stub: workers_pb2_grpc.WorkerServiceAsyncStub = workers_pb2_grpc.WorkerServiceStub(channel)
        yield stub, (("authorization", f"Bearer {key}"),)


async def _claimed(stack: Stack, stub: Any, metadata: Any) -> tuple[Job, Any]:
    job = await stack.client().submit("reports.render", {"x": 1}, correlation_id="order-7")
    envelope = await stack.envelope(job.id)
    claim = await stub.ClaimJob(
        workers_pb2.ClaimJobRequest(
            event_id=str(envelope.event_id),
            job_id=str(envelope.job_id),
            tenant_id=str(envelope.tenant_id),
            type=envelope.job_type,
        ),
        metadata=metadata,
    )
    assert claim.status == workers_pb2.ClaimJobResponse.STATUS_CLAIMED
    return job, claim.attempt


async def test_a_worker_service_worker_submits_a_child(
    stack: Stack, workers: tuple[Any, Any]
) -> None:
    stub, metadata = workers
    parent, attempt = await _claimed(stack, stub, metadata)
    request = workers_pb2.SubmitChildJobRequest(
        attempt=attempt, key="page-1", type="reports.page", payload=struct_from_dict({"p": 1})
    )
    made = await stub.SubmitChildJob(request, metadata=metadata)
    again = await stub.SubmitChildJob(request, metadata=metadata)
    assert made.created and not again.created and again.name == made.name
    child = await stack.client().get(made.name)
    assert child.parent == parent.name and child.type == "reports.page"
    assert child.payload == {"p": 1} and child.correlation_id == "order-7"
    assert child.state is JobState.QUEUED

    stale = workers_pb2.AttemptRef(
        job=attempt.job, attempt=attempt.attempt, lease_token=str(uuid.uuid4())
    )
    with pytest.raises(grpc.aio.AioRpcError) as lost:
        await stub.SubmitChildJob(
            workers_pb2.SubmitChildJobRequest(attempt=stale, key="page-2", type="reports.page"),
            metadata=metadata,
        )
    answer = check_refusal(lost.value)
    assert (answer.code, answer.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "LEASE_LOST")
    assert await _children_rows(stack, parent.name) == 1


def _bad_children(attempt: Any) -> list[tuple[str, workers_pb2.SubmitChildJobRequest]]:
    def make(**fields: Any) -> workers_pb2.SubmitChildJobRequest:
        values: dict[str, Any] = {"attempt": attempt, "key": "k", "type": "reports.page"}
        return workers_pb2.SubmitChildJobRequest(**{**values, **fields})

    both = make()
    both.schedule_delay.FromSeconds(5)
    both.schedule_time.FromSeconds(2_000_000_000)
    return [
        ("type", make(type="Not A Type")),
        ("type", make(type="")),
        ("key", make(key="")),
        ("key", make(key="k" * 201)),
        ("key", make(key="tab\there")),
        ("max_attempts", make(max_attempts=101)),
        ("correlation_id", make(correlation_id="c" * 256)),
        ("schedule_delay", both),
        ("attempt", workers_pb2.SubmitChildJobRequest(key="k", type="reports.page")),
    ]


async def test_bad_children_are_refused_whole_with_the_field(
    stack: Stack, workers: tuple[Any, Any]
) -> None:
    stub, metadata = workers
    parent, attempt = await _claimed(stack, stub, metadata)
    before = await stack.counts()
    for field_name, request in _bad_children(attempt):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SubmitChildJob(request, metadata=metadata)
        answer = check_refusal(refused.value)
        assert (answer.code, answer.field) == (grpc.StatusCode.INVALID_ARGUMENT, field_name), (
            field_name,
            answer,
        )
    assert await stack.counts() == before
    assert await _children_rows(stack, parent.name) == 0


# -- the CLI ---------------------------------------------------------------------------


async def test_the_cli_shows_the_parent_and_lists_the_children(bare: Stack) -> None:
    store = AttemptStore(bare.db, lease_seconds=30.0)
    children = ChildStore(bare.db)
    parent = await bare.client().submit("fan.out", {})
    attempt = await _running(bare, store, parent)
    made = [(await children.submit(fence_of(attempt), *_leaf(bare, k)))[0] for k in "ab"]

    code, out, _err = await jobplane(bare, "get", parent.name)
    assert code == 0
    assert _line(out, "children:") == f"2 (jobplane list --parent {parent.name})"
    assert _line(out, "parent:") is None
    code, out, _err = await jobplane(bare, "get", made[0].id)
    assert code == 0 and _line(out, "parent:") == parent.name
    assert _line(out, "children:") is None
    code, out, _err = await jobplane(bare, "list", "--parent", parent.id, "--json")
    assert code == 0
    listed = json.loads(out)["jobs"]
    assert sorted(j["name"] for j in listed) == sorted(c.name for c in made)
    assert {j["parent"] for j in listed} == {parent.name}
    code, _out, err = await jobplane(bare, "list", "--parent", "jobs/not-a-uuid")
    assert code != 0 and "parent" in err


def _line(out: str, label: str) -> str | None:
    """The value of ``get``'s line ``label``, or None without one."""
    found = [line[len(label) :].strip() for line in out.splitlines() if line.startswith(label)]
    return found[0] if found else None


# -- the dashboard ---------------------------------------------------------------------


async def test_the_dashboard_links_the_parent_and_lists_the_children(
    template_db: str, run_id: str, amqp_url: str
) -> None:
    registry = Registry()

    @registry.handler("fan.dash")
    async def fan(ctx: JobContext) -> dict[str, Any]:
        return {"children": [await ctx.submit("demo.echo", {}, key=k) for k in "ab"]}

    async with ui_stack(template_db, run_id, amqp_url) as ui:
        await ui.stack.start_worker(registry)
        client = ui.stack.client()
        parent = await client.submit("fan.dash", {})
        await eventually(lambda: _ended(client, parent.name))
        names = (await client.get(parent.name)).result["children"]  # type: ignore[index]
        async with browserless(ui.url, ui.stack.key) as http:
            async with http.get(f"/jobs/{parent.id}") as page:
                assert page.status == 200
                body = await page.text()
            async with http.get(f"/jobs/{names[0].removeprefix('jobs/')}") as page:
                assert page.status == 200
                child = await page.text()
    assert 'id="children"' in body
    for name in names:
        assert f'href="/jobs/{name.removeprefix("jobs/")}"' in body
    assert 'id="job-parent"' in child and f'href="/jobs/{parent.id}"' in child
    assert 'id="job-parent"' not in body
