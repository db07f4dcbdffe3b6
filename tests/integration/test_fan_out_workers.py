"""Fan-out and join run by workers through the broker (ADR-0047): the Python
worker (``ctx.spawn``, a returned list, ``ctx.results``) and a WorkerService
worker (``fans_out``, ``items``, ``results``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState, StageState
from jobplane.convert import dict_from_struct, struct_from_dict
from jobplane.topology import Topology
from jobplane.v1 import workers_pb2, workers_pb2_grpc
from jobplane.workers.handlers import JobContext, PermanentError, Registry
from tests.integration.test_cli_and_sync import jobplane
from tests.support import services
from tests.support.answers import check_refusal
from tests.support.dashboard import browserless, ui_stack
from tests.support.fan_out import fan_topology
from tests.support.stack import Stack, start_stack

pytestmark = pytest.mark.integration


@pytest.fixture
async def fans(amqp_url: str) -> AsyncIterator[Topology]:
    names = fan_topology(f"w{uuid.uuid4().hex[:6]}.")
    yield names
    await services.delete_topology(amqp_url, names)


@pytest.fixture
async def fstack(
    engine: AsyncEngine, database_url: str, amqp_url: str, fans: Topology
) -> AsyncIterator[Stack]:
    """Server and relay on the fan-out topology; the test starts its workers."""
    running = await start_stack(engine, database_url, amqp_url, fans, worker=False)
    yield running
    await running.close()


def _documents() -> Registry:
    """split → embed (one child per batch) → index, the example of docs/workflows.md."""
    registry = Registry()

    @registry.handler("docs.split")
    async def split(ctx: JobContext) -> list[dict[str, Any]]:
        words = ctx.payload["text"].split()
        # The first batch by spawn, the rest as the list returned: one list.
        ctx.spawn({"batch": words[:2]})
        return [{"batch": words[i : i + 2]} for i in range(2, len(words), 2)]

    @registry.handler("docs.embed")
    async def embed(ctx: JobContext) -> dict[str, Any]:
        await ctx.progress(0.5, "embedding")
        if "bad" in ctx.payload["batch"]:
            raise PermanentError("cannot embed", code="EMBED_FAILED")
        await asyncio.sleep(0.05 * (3 - len(ctx.payload["batch"][0]) % 3))
        return {"vectors": [len(w) for w in ctx.payload["batch"]]}

    @registry.handler("docs.index")
    async def index(ctx: JobContext) -> dict[str, Any]:
        return {
            "vectors": [v for r in ctx.results if r.ok and r.result for v in r.result["vectors"]],
            "failed": [r.index for r in ctx.results if not r.ok],
            "errors": [r.error.code for r in ctx.results if r.error],
        }

    return registry


async def test_a_python_worker_runs_split_embed_and_index_with_results_in_order(
    fstack: Stack,
) -> None:
    await fstack.start_worker(_documents(), concurrency=4)
    client = fstack.client()
    job = await client.submit("docs.ingest", {"text": "a bb ccc dddd eeeee"})
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result == {"vectors": [1, 2, 3, 4, 5], "failed": [], "errors": []}
    assert [s.state for s in done.stages] == [StageState.SUCCEEDED] * 3
    assert done.fan_out is not None
    assert (done.fan_out.stage, done.fan_out.children, done.fan_out.ended) == ("embed", 3, 3)
    page = await client.list(parent=job.name)
    assert [c.state for c in page.jobs] == [JobState.SUCCEEDED] * 3
    # Its events: the stage handoffs, and a progress event as each child ended.
    events = [e async for e in client.watch(job.name)]
    assert [e.progress for e in events] == sorted(e.progress for e in events)
    ended = [e for e in events if e.data.get("children") == 3 and "ended" in e.data]
    assert [e.data["ended"] for e in ended] == [1, 2, 3]

    tolerant = await client.submit("docs.tolerant", {"text": "a bb bad dd"})
    done = await client.wait(tolerant.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result == {"vectors": [1, 2], "failed": [1], "errors": ["EMBED_FAILED"]}


async def test_a_handler_that_returns_no_list_fails_its_stage(fstack: Stack) -> None:
    registry = Registry()

    @registry.handler("docs.split")
    async def split(ctx: JobContext) -> dict[str, Any]:
        return {"batches": 2}

    await fstack.start_worker(registry)
    client = fstack.client()
    job = await client.submit("docs.ingest", {"text": "a b"})
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.FAILED and done.stage == "split"
    assert done.error is not None and done.error.code == "FAN_OUT_REFUSED"
    assert not (await client.list(parent=job.name)).jobs


async def _claim(stack: Stack, stub: Any, metadata: Any) -> workers_pb2.ClaimJobResponse:
    """The next message of the topology's queue, claimed."""
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel()
        source = await channel.get_queue(stack.topology.queues[0].name)
        for _ in range(400):
            message = await source.get(fail=False)
            if message is not None:
                await message.ack()
                request = workers_pb2.ClaimJobRequest(message_body=message.body)
                claim: workers_pb2.ClaimJobResponse = await stub.ClaimJob(
                    request, metadata=metadata
                )
                assert claim.status == workers_pb2.ClaimJobResponse.STATUS_CLAIMED
                return claim
            await asyncio.sleep(0.05)
    raise AssertionError("no message")


async def test_a_worker_service_worker_fans_out_and_joins(fstack: Stack) -> None:
    key = (await fstack.server.keys.create_worker()).key
    metadata = (("authorization", f"Bearer {key}"),)
    client = fstack.client()
    job = await client.submit("docs.tolerant", {"text": "x"})
    async with grpc.aio.insecure_channel(fstack.server.address) as channel:
        stub: Any = workers_pb2_grpc.WorkerServiceStub(channel)
        split = await _claim(fstack, stub, metadata)
        assert split.stage == "split" and split.fans_out and not split.results
        before = await fstack.counts()
        refusals = [
            ("result", workers_pb2.CompleteJobRequest(result=struct_from_dict({"a": 1}))),
        ]
        for field, request in refusals:
            request.attempt.CopyFrom(split.attempt)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.CompleteJob(request, metadata=metadata)
            answer = check_refusal(refused.value)
            assert (answer.code, answer.field) == (grpc.StatusCode.INVALID_ARGUMENT, field)
        assert await fstack.counts() == before
        items = [struct_from_dict({"n": n}) for n in range(3)]
        await stub.CompleteJob(
            workers_pb2.CompleteJobRequest(attempt=split.attempt, items=items), metadata=metadata
        )
        for _ in range(3):
            child = await _claim(fstack, stub, metadata)
            assert child.stage == "" and not child.fans_out
            n = int(dict_from_struct(child.payload)["n"])
            if n == 1:
                bad = workers_pb2.CompleteJobRequest(attempt=child.attempt, items=items[:1])
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.CompleteJob(bad, metadata=metadata)
                assert check_refusal(refused.value).field == "items"
                await stub.FailJob(
                    workers_pb2.FailJobRequest(
                        attempt=child.attempt, code="EMBED_FAILED", message="no", retryable=False
                    ),
                    metadata=metadata,
                )
                continue
            await stub.CompleteJob(
                workers_pb2.CompleteJobRequest(
                    attempt=child.attempt, result=struct_from_dict({"n2": n * n})
                ),
                metadata=metadata,
            )
        join = await _claim(fstack, stub, metadata)
        assert join.stage == "index" and not join.fans_out
        assert [(r.index, r.state, r.error_code) for r in join.results] == [
            (0, "SUCCEEDED", ""),
            (1, "FAILED", "EMBED_FAILED"),
            (2, "SUCCEEDED", ""),
        ]
        assert [dict_from_struct(r.result) for r in join.results] == [{"n2": 0}, {}, {"n2": 4}]
        await stub.CompleteJob(
            workers_pb2.CompleteJobRequest(attempt=join.attempt, result=struct_from_dict({})),
            metadata=metadata,
        )
    assert (await client.get(job.name)).state is JobState.SUCCEEDED


async def test_the_cli_and_the_dashboard_show_a_fan_out_and_its_children(
    template_db: str, run_id: str, amqp_url: str
) -> None:
    async with ui_stack(template_db, run_id, amqp_url, topology=fan_topology("")) as ui:
        await ui.stack.start_worker(_documents())
        client = ui.stack.client()
        job = await client.submit("docs.tolerant", {"text": "a bb bad dd"})
        done = await client.wait(job.name, timeout=30)
        assert done.state is JobState.SUCCEEDED, done.error
        children = (await client.list(parent=job.name)).jobs
        code, out, _err = await jobplane(ui.stack, "get", job.name)
        assert code == 0, _err
        assert "fan-out:" in out and "stage embed: 2 of 2 children ended, 1 did not succeed" in out
        async with (
            browserless(ui.url, ui.stack.key) as http,
            http.get(f"/jobs/{job.id}") as page,
        ):
            assert page.status == 200
            body = await page.text()
    assert 'id="job-fan-out"' in body and "1 did not succeed" in body
    assert 'class="fan-out">fan-out, tolerates 1</small>' in body
    assert 'id="children"' in body
    for child in children:
        assert f'href="/jobs/{child.id}"' in body
    listed = body.partition('id="children"')[2].partition("</table>")[0]
    assert listed.count('class="state state-failed"') == 1
    # The tree draws the job and its two children, the failed one among them.
    drawn = body.partition('id="tree"')[2].partition("</ul>\n")[0]
    assert drawn.count('class="state state-failed"') == 1
    assert all(f'data-job="{c.id}"' in drawn for c in [*children, job])
