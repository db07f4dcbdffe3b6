"""Flow-controlled dispatch (ADR-0042): credit per queue, tenants in turn, high queues first.

Every assertion is on order or counts, never on time: which start a job got,
how many starts each tenant had, how many dispatches wait in Postgres while
the broker's queue holds the credit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import AsyncClient, JobSpec
from jobplane.observe.metrics import Metrics, watch_outbox
from jobplane.topology import Topology
from jobplane.workers.handlers import JobContext, Registry
from jobplane.workers.relay import FairSettings
from tests.support import services
from tests.support.parts import Started
from tests.support.priorities import two_class_topology
from tests.support.queues import ready_count
from tests.support.stack import Stack, eventually, start_stack

# Credit from the consumers alone (no horizon of measured work): a queue's
# target backlog is max(4, consumers * 2), whatever the machine's speed.
FAIR = FairSettings(horizon_seconds=0)
WORK = "fair.work"


class Starts:
    """The jobs a worker started, in order."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def registry(self, *types: str) -> Registry:
        registry = Registry()

        async def handle(ctx: JobContext) -> dict[str, Any]:
            self.order.append(ctx.id)
            return {}

        for job_type in types or (WORK,):
            registry.add(job_type, handle)
        return registry

    async def at_least(self, n: int) -> bool:
        return len(self.order) >= n


async def _backlog(client: AsyncClient, n: int, job_type: str = WORK) -> set[str]:
    return {job.id for job in await client.submit_many([JobSpec(job_type) for _ in range(n)])}


def _bare(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> Awaitable[Stack]:
    """A server alone: the test starts its relays and worker when its backlog is in."""
    return start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)


async def test_a_tenant_behind_anothers_backlog_starts_within_the_next_few_starts(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack: Stack = await started(_bare(engine, database_url, amqp_url, topology))
    starts = Starts()
    await _backlog(stack.client(), 300)
    await stack.start_relay(fair=FAIR)
    await stack.start_worker(starts.registry(), concurrency=1)
    await eventually(lambda: starts.at_least(20), timeout=30)

    other = stack.client(await stack.new_key("globex"))
    job = await other.submit(WORK, {})
    before = len(starts.order)

    async def started_b() -> bool:
        return job.id in starts.order

    await eventually(started_b, timeout=60)
    # Behind at most the queue's credit (4), the worker's prefetch and the
    # batch in flight: not behind the ~280 of acme's backlog still waiting.
    assert starts.order.index(job.id) - before <= 12


async def test_weights_three_to_one_give_three_starts_to_one(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from jobplane.cli import build_parser
    from jobplane.server import admin

    stack: Stack = await started(_bare(engine, database_url, amqp_url, topology))
    starts = Starts()
    acme = await _backlog(stack.client(), 200)
    await _backlog(stack.client(await stack.new_key("globex")), 200)
    # The operator's command, as `jobplane tenants set-weight acme 3` runs it.
    monkeypatch.setenv("JOBPLANE_DATABASE_URL", database_url)
    args = build_parser().parse_args(["tenants", "set-weight", "acme", "3"])
    assert await admin._tenants(args) == 0, capsys.readouterr().err
    bad = build_parser().parse_args(["tenants", "set-weight", "acme", "0"])
    assert await admin._tenants(bad) == 2
    assert "1..1000" in capsys.readouterr().err

    await stack.start_relay(fair=FAIR)
    await stack.start_worker(starts.registry(), concurrency=1)
    await eventually(lambda: starts.at_least(120), timeout=60)
    window = starts.order[20:120]
    share = sum(job in acme for job in window) / len(window)
    # 3:1 is 75 % of the starts while both have a backlog.
    assert 0.65 <= share <= 0.85, share


@pytest.fixture
async def high_and_low(amqp_url: str, topology: Topology) -> AsyncIterator[Topology]:
    """One high queue (``hi.a.#``) and one low queue (``lo.#``), under this test's names."""
    pair = two_class_topology(topology)
    yield pair
    await services.delete_topology(amqp_url, pair)


async def test_a_high_queues_job_is_published_before_an_older_low_backlog(
    engine: AsyncEngine, database_url: str, amqp_url: str, high_and_low: Topology, started: Started
) -> None:
    stack: Stack = await started(_bare(engine, database_url, amqp_url, high_and_low))
    client = stack.client()
    await _backlog(client, 100, "lo.work")
    high = await client.submit("hi.a.work", {})
    # A batch of two: the claim gives the high queue's credit first.
    await stack.start_relay(fair=FAIR, batch_size=2)

    async def published() -> bool:
        return bool(
            await stack.scalar(
                "SELECT published_at IS NOT NULL FROM outbox "
                "WHERE kind = 'job.dispatch' AND job_id = :id",
                id=high.id,
            )
        )

    await eventually(published, timeout=30)
    low_waiting = await stack.scalar(
        "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND queue = :q "
        "AND published_at IS NULL",
        q=high_and_low.queues[1].name,
    )
    assert low_waiting >= 96


async def test_the_broker_queue_holds_no_more_than_the_credit_while_a_backlog_waits(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack: Stack = await started(_bare(engine, database_url, amqp_url, topology))
    queue = topology.queues[0].name
    await _backlog(stack.client(), 300)
    relay = await stack.start_relay(fair=FAIR)
    assert relay.credit is not None
    book = relay.credit.queues[queue]

    reads: list[float] = []

    async def read_again() -> bool:
        if not reads or book.read_at > reads[-1]:
            reads.append(book.read_at)
        return len(reads) > 5

    # Several reads of the queue's counts, each followed by a claim.
    await eventually(read_again, timeout=30)
    assert await ready_count(amqp_url, queue) <= FAIR.min_backlog
    waiting = await stack.scalar(
        "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
    )
    assert waiting >= 300 - FAIR.min_backlog
    # What an operator sees of it: the queue's due dispatches, at scrape time.
    metrics = Metrics()
    watch_outbox(metrics, engine)
    await metrics.refresh()
    shown = metrics.registry.get_sample_value("jobplane_dispatch_waiting_rows", {"queue": queue})
    assert shown is not None and shown >= 300 - FAIR.min_backlog


async def test_two_fair_relays_run_every_job_exactly_once_and_a_stopped_one_loses_nothing(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack: Stack = await started(_bare(engine, database_url, amqp_url, topology))
    starts = Starts()
    jobs = await _backlog(stack.client(), 150)
    jobs |= await _backlog(stack.client(await stack.new_key("globex")), 150)
    first = await stack.start_relay(fair=FAIR)
    second = await stack.start_relay(fair=FAIR)
    await stack.start_worker(starts.registry(), concurrency=4)
    await eventually(lambda: starts.at_least(60), timeout=60)
    # One relay goes mid-backlog (its batch in flight rolls back); the other goes on.
    await first.stop()
    await eventually(lambda: starts.at_least(300), timeout=120)

    async def all_succeeded() -> bool:
        done = await stack.scalar("SELECT count(*) FROM jobs WHERE state = :s", s="succeeded")
        return bool(done == 300)

    await eventually(all_succeeded, timeout=60)
    assert Counter(starts.order) == dict.fromkeys(jobs, 1)
    assert second.published > 0 and first.published > 0
