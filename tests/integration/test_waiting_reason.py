"""A job the broker cannot route says why it waits, and stops saying so once routed.

The server accepts a type its topology routes; the broker's bindings are the
operator's and may differ (not applied yet, a binding deleted). Each publish
then comes back unroutable: the relay keeps retrying and the job shows
``waiting_code`` UNROUTABLE with the fix (GetJob, ListJobs, the CLI, the
dashboard) — until the topology is applied and the dispatch goes out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aio_pika
import pytest
import structlog
from markupsafe import escape
from sqlalchemy import text
from structlog.testing import capture_logs

from jobplane.client import JobState
from jobplane.observe.metrics import Metrics, watch_outbox
from jobplane.store.engine import create_engine, migrate
from jobplane.store.keys import KeyStore
from jobplane.topology import Topology, declare
from jobplane.types import Job, WaitingCode
from jobplane.workers import relay_record
from tests.integration.test_cli_and_sync import jobplane
from tests.integration.test_observability import samples
from tests.support import services
from tests.support.dashboard import UiStack, browserless, ui_stack
from tests.support.rows import insert_job
from tests.support.stack import Stack, eventually

pytestmark = [pytest.mark.stack(relay=False, worker=False), pytest.mark.timeout(180)]


async def _apply(stack: Stack) -> None:
    """What ``jobplane topology apply`` does: declare the whole topology, bindings too."""
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        await declare(await connection.channel(), stack.topology)


async def _unbind(stack: Stack) -> None:
    """Take away the broker's only route for job dispatches (the default queue's ``#``)."""
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(stack.topology.queues[0].name)
        assert stack.topology.queues[0].bindings == ("#",)
        await queue.unbind(stack.topology.exchange, routing_key="#")


async def _unroutable(stack: Stack) -> Job:
    """A demo.echo job whose dispatches the broker returns, once it says so."""
    job = await stack.client().submit("demo.echo", {"n": 1})

    async def says_why() -> bool:
        current = await stack.client().get(job.name)
        return current.waiting_code == WaitingCode.UNROUTABLE

    await eventually(says_why, timeout=30)
    return await stack.client().get(job.name)


async def _routeless(stack: Stack) -> None:
    """The topology on the broker without its route, and a relay publishing to it."""
    await _apply(stack)
    await _unbind(stack)
    await stack.start_relay()


async def test_an_unroutable_dispatch_says_why_until_the_topology_routes_it(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A logger not yet used, so that capture_logs sees the relay's lines.
    monkeypatch.setattr(relay_record, "log", structlog.get_logger("jobplane.relay"))
    with capture_logs() as logs:
        job = await _says_why_until_routed(stack)
    # Logged once, when the reason is set, not at each return (docs/operations.md).
    (line,) = [line for line in logs if line["event"] == "job.waiting"]
    dispatch = await stack.scalar("SELECT dispatch_id FROM jobs WHERE id = :id", id=job.id)
    assert line == {
        "event": "job.waiting",
        "log_level": "warning",
        "job": job.name,
        "event_id": str(dispatch),
        "code": "UNROUTABLE",
        "type": "demo.echo",
        "exchange": stack.topology.exchange,
    }


async def _says_why_until_routed(stack: Stack) -> Job:
    await _routeless(stack)
    job = await _unroutable(stack)
    assert job.state is JobState.QUEUED and job.error is None
    # The cause and the fix, naming what an operator looks for.
    assert "no queue is bound for routing key 'demo.echo'" in job.waiting_reason
    assert f"on exchange {stack.topology.exchange!r}" in job.waiting_reason
    assert "`jobplane topology apply`" in job.waiting_reason
    listed = (await stack.client().list()).jobs
    assert [(j.name, j.waiting_code) for j in listed] == [(job.name, "UNROUTABLE")]
    assert listed[0].waiting_reason == job.waiting_reason
    metrics = Metrics()
    watch_outbox(metrics, stack.engine)
    assert await _waiting(metrics) == {
        "UNROUTABLE": 1.0,
        "NO_LIVE_WORKER": 0.0,
        "HANDED_BACK": 0.0,
        "CONCURRENCY_LIMIT": 0.0,
        "RATE_LIMITED": 0.0,
        "TENANT_LIMIT": 0.0,
        "DEPENDENCIES": 0.0,
    }
    # A fact about now, not history: no event in the job's stream.
    assert await stack.scalar("SELECT last_seq FROM jobs") == 1
    # Still retried on its schedule, not given up on.
    retried = "SELECT failed_at IS NULL AND returns >= 1 FROM outbox WHERE job_id = :id"
    assert await stack.scalar(retried, id=job.id) is True

    await _apply(stack)

    async def published() -> bool:
        return bool(
            await stack.scalar(
                "SELECT published_at IS NOT NULL FROM outbox WHERE job_id = :id", id=job.id
            )
        )

    await eventually(published, timeout=60)
    # Out of the relay's hands now, waiting for a worker: no reason is left.
    cleared = await stack.client().get(job.name)
    assert cleared.state is JobState.QUEUED
    assert (cleared.waiting_code, cleared.waiting_reason) == ("", "")
    assert await stack.scalar("SELECT waiting_code IS NULL FROM jobs") is True
    assert (await _waiting(metrics))["UNROUTABLE"] == 0

    await stack.start_worker()
    done = await asyncio.wait_for(stack.client().wait(job.name), timeout=30)
    assert done.state is JobState.SUCCEEDED
    return job


async def _waiting(metrics: Metrics) -> dict[str, float]:
    """``jobplane_jobs_waiting`` by code, as a scrape reads it."""
    await metrics.refresh()
    found = samples((await metrics.exposition()).decode())
    return {
        dict(labels)["code"]: count
        for (name, labels), count in found.items()
        if name == "jobplane_jobs_waiting"
    }


async def test_the_cli_shows_why_a_job_waits(stack: Stack) -> None:
    await _routeless(stack)
    job = await _unroutable(stack)

    code, out, err = await jobplane(stack, "get", job.name)
    assert code == 0, err
    waiting = [line for line in out.splitlines() if line.startswith("waiting:")]
    assert len(waiting) == 1, out
    assert waiting[0].split(None, 1)[1] == f"UNROUTABLE: {job.waiting_reason}"

    code, out, err = await jobplane(stack, "list", "--json")
    assert code == 0, err
    [listed] = json.loads(out)["jobs"]
    assert (listed["waiting_code"], listed["waiting_reason"]) == (
        "UNROUTABLE",
        job.waiting_reason,
    )
    # Cancelled, it waits for nothing any more.
    await stack.client().cancel(job.name)
    assert await stack.scalar("SELECT waiting_code IS NULL AND waiting_reason IS NULL FROM jobs")


@pytest.fixture
async def ui(template_db: str, run_id: str, amqp_url: str) -> AsyncIterator[UiStack]:
    """A jobplane and dashboard of this test's own (its broker route is taken away)."""
    async with ui_stack(template_db, run_id, amqp_url) as running:
        yield running


async def test_the_dashboard_shows_why_a_job_waits(ui: UiStack) -> None:
    await _unbind(ui.stack)
    job = await _unroutable(ui.stack)
    async with browserless(ui.url, ui.stack.key) as http:
        async with http.get(f"/jobs/{job.id}") as response:
            assert response.status == 200
            page = await response.text()
        async with http.get("/jobs") as response:
            listing = await response.text()
    assert '<p class="waiting" id="job-waiting"><code>UNROUTABLE</code> ' in page
    assert escape(job.waiting_reason) in page
    assert f'title="{escape(job.waiting_reason)}">UNROUTABLE</small>' in listing


async def test_reasons_written_before_0016_get_their_codes(run_id: str, topology: Topology) -> None:
    async with services.database_at(run_id, "0015") as url:
        engine = create_engine(url, pool_size=2)
        try:
            keys = KeyStore(engine)
            _key, tenant = await keys.create_key("acme")
            await keys.close()
            queue = topology.queues[0].name
            parked, _ = await insert_job(engine, tenant, queue, "demo.echo")
            handed, _ = await insert_job(engine, tenant, queue, "demo.echo")
            plain, _ = await insert_job(engine, tenant, queue, "demo.echo")
            async with engine.begin() as conn:
                # As the hand-back statement of 0015's code left them.
                await conn.execute(
                    text(
                        "UPDATE jobs SET waiting_reason = 'why', dispatch_id = CASE "
                        "WHEN id = :parked THEN NULL ELSE dispatch_id END WHERE id <> :plain"
                    ),
                    {"parked": parked, "plain": plain},
                )
            await migrate(url, create=False)
            async with engine.connect() as conn:
                found = await conn.execute(text("SELECT id, waiting_code FROM jobs"))
                codes = {row.id: row.waiting_code for row in found}
        finally:
            await engine.dispose()
    assert codes == {parked: "NO_LIVE_WORKER", handed: "HANDED_BACK", plain: None}
