"""The relay keeps relaying whatever the database does, and stops cleanly.

- A database that is down (here: no pooled connection free in time) is waited
  out with the broker link kept open: no reconnect, no topology re-check.
- A row whose outcome the database refuses (a trigger, standing in for any
  statement Postgres refuses for what it is) is settled on its own; the other
  rows of its batch, and every later row, keep moving.
- A sweeper that fails in a way nobody planned for keeps sweeping, and the
  relay that runs it still stops, closing what it opened.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from sqlalchemy import text
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from jobplane.names import job_name
from jobplane.store.db import Database
from jobplane.store.sweeps import LeaseRepair, SweepStore
from jobplane.topology import Topology
from jobplane.workers import relay_outbox, relay_record
from jobplane.workers.relay import Relay
from jobplane.workers.sweeper import Sweeper
from tests.support.parts import Started
from tests.support.queues import ready_count
from tests.support.rows import insert_job
from tests.support.stack import Stack, eventually, start_stack


async def test_a_database_outage_keeps_the_broker_link(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(start_stack(engine, database_url, amqp_url, topology, relay=False))
    small = await started(Database(database_url, size=1, acquire_timeout=0.2))
    relay = await started(
        Relay(engine, database_url, amqp_url, topology, poll_seconds=0.1, db=small)
    )
    assert relay.connects == 1
    # The relay's only pooled connection is taken: its statements time out.
    async with small.connect() as taken:
        await taken.execute("SELECT 1")
        await eventually(lambda: _at_least(lambda: relay.database_errors, 2))
    client = stack.client()
    job = await client.submit("demo.echo", {})
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state.name == "SUCCEEDED"
    assert relay.connects == 1 and relay.connected


async def _at_least(value: Callable[[], int], least: int) -> bool:
    return value() >= least


_REFUSE = """
CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.id = '{row}' AND ({when}) THEN
        RAISE EXCEPTION 'refused by a test' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$
"""


async def _refuse_updates(engine: AsyncEngine, row: uuid.UUID, when: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(text(_REFUSE.format(row=row, when=when)))
        await conn.execute(
            text(
                "CREATE TRIGGER refuse BEFORE UPDATE ON outbox "
                "FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        )


async def _jobs(stack: Stack, count: int) -> list[tuple[uuid.UUID, uuid.UUID]]:
    queue = stack.topology.queues[0].name
    return [
        await insert_job(stack.engine, stack.tenant_id, queue, "demo.echo") for _ in range(count)
    ]


async def _published(stack: Stack, rows: list[uuid.UUID]) -> bool:
    count = await stack.scalar(
        "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' "
        "AND id = ANY(:ids) AND published_at IS NOT NULL",
        ids=rows,
    )
    return bool(count == len(rows))


async def test_a_row_whose_mark_is_refused_fails_alone_and_the_relay_goes_on(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    # No worker: the refused row's message must not be claimed before the
    # relay settles the row.
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    jobs = await _jobs(stack, 4)
    refused_job, refused_row = jobs[1]
    await _refuse_updates(engine, refused_row, "NEW.published_at IS NOT NULL")
    relay = await stack.start_relay()
    others = [row for _job, row in jobs if row != refused_row]
    await eventually(lambda: _published(stack, others))
    await eventually(
        lambda: stack.scalar(
            "SELECT failed_at IS NOT NULL FROM outbox WHERE kind = 'job.dispatch' AND id = :id",
            id=refused_row,
        )
    )
    job = await stack.scalar(
        "SELECT (state, error_code, error_message) FROM jobs WHERE id = :id", id=refused_job
    )
    assert job[:2] == ("failed", "DISPATCH_FAILED")
    assert "refused to record its dispatch" in job[2] and "23514" in job[2]
    assert "refused by a test" not in job[2]  # the database's message stays out
    events = await stack.scalar(
        "SELECT array_agg(type ORDER BY seq) FROM job_events WHERE job_id = :id", id=refused_job
    )
    assert events == ["queued", "failed"]

    # Rows submitted afterwards are published as usual.
    later = await _jobs(stack, 2)
    await eventually(lambda: _published(stack, [row for _job, row in later]))
    assert relay.failed == 1 and relay.connects == 1


async def test_a_row_the_database_refuses_to_change_at_all_is_held_back(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Loggers not yet used, so that capture_logs sees the relay's lines.
    monkeypatch.setattr(relay_record, "log", structlog.get_logger("jobplane.relay"))
    monkeypatch.setattr(relay_outbox, "log", structlog.get_logger("jobplane.relay"))
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    jobs = await _jobs(stack, 3)
    held_job, held_row = jobs[0]
    await _refuse_updates(engine, held_row, "true")
    with capture_logs() as logs:
        relay = await stack.start_relay()
        others = [row for _job, row in jobs if row != held_row]
        await eventually(lambda: _published(stack, others))
        later = await _jobs(stack, 2)
        await eventually(lambda: _published(stack, [row for _job, row in later]))
    # The batch refused, then the row held back: each said once, for an operator.
    refused = [line for line in logs if line["event"] == "relay.batch.refused"]
    assert [(line["log_level"], line["rows"]) for line in refused] == [("error", 3)]
    assert "sqlstate=23514" in refused[0]["error"]
    assert "refused by a test" not in refused[0]["error"]  # the message is withheld
    (held,) = [line for line in logs if line["event"] == "relay.dispatch.held"]
    assert (held["job"], held["event_id"], held["retry_in"]) == (
        job_name(held_job),
        str(held_row),
        300.0,
    )
    assert held["hint"] == (
        "the database refuses every change to this outbox row; an operator must look"
    )
    # Left for an operator: neither published nor failed, its job still QUEUED.
    assert await stack.scalar(
        "SELECT (published_at, failed_at) FROM outbox WHERE kind = 'job.dispatch' AND id = :id",
        id=held_row,
    ) == (None, None)
    assert await stack.scalar("SELECT state FROM jobs WHERE id = :id", id=held_job) == "queued"
    assert relay.failed == 0


class _BrokenStore(SweepStore):
    """Fails the first sweeps in ways the sweeper's author did not list."""

    def __init__(self, engine: AsyncEngine, failures: list[Exception]) -> None:
        super().__init__(engine)
        self.failures = failures
        self.calls = 0

    async def expire_leases(self, **kwargs: Any) -> LeaseRepair:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return await super().expire_leases(**kwargs)


@pytest.mark.parametrize("failure", [PoolTimeout("pool exhausted"), RuntimeError("a bug")])
async def test_a_failing_sweeper_keeps_sweeping_and_the_relay_stops(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, failure: Exception
) -> None:
    sweeper = Sweeper(engine, interval=0.01)
    broken = _BrokenStore(engine, [failure])
    sweeper._store = broken
    relay = Relay(engine, database_url, amqp_url, topology)
    await relay.start()
    await sweeper.start()
    try:
        await eventually(lambda: _at_least(lambda: broken.calls, 3))
    finally:
        await sweeper.stop()
        await relay.stop()
    assert not relay.connected


async def test_a_statement_refused_for_every_row_fails_no_job(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    # Refused for what the statement is (here: a privilege), not for a row's
    # values: failing rows over it would fail every job there is.
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "IF NEW.published_at IS NOT NULL THEN RAISE EXCEPTION 'refused' "
                "USING ERRCODE = 'insufficient_privilege'; END IF; RETURN NEW; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER refuse BEFORE UPDATE ON outbox "
                "FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        )
    jobs = await _jobs(stack, 3)
    relay = await stack.start_relay()

    async def sent() -> bool:  # published, confirmed, and not marked
        return await ready_count(amqp_url, topology.queues[0].name) >= 3

    await eventually(sent)
    assert await stack.scalar("SELECT count(*) FROM jobs WHERE state = 'queued'") == 3
    assert (
        await stack.scalar(
            "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND failed_at IS NULL"
        )
        == 3
    )
    assert relay.failed == 0

    async with engine.begin() as conn:
        await conn.execute(text("DROP TRIGGER refuse ON outbox"))
    await eventually(lambda: _published(stack, [row for _job, row in jobs]), timeout=20)
