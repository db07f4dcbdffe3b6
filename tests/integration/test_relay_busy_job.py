"""A dispatch the relay gives up on while its job is locked elsewhere (a cancel
under way, most likely) is left due and decided at a later pass: never failed
over a lock, never lost. Giving up is one ``relay.dispatch.failed`` line
(docs/operations.md), logged once the job is failed.
"""

from __future__ import annotations

import pytest
import structlog
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from jobplane.names import job_name
from jobplane.topology import Topology
from jobplane.workers import relay_record
from tests.support.parts import Started
from tests.support.rows import insert_job
from tests.support.stack import eventually, start_stack

_UNPUBLISHABLE = "the broker cannot accept it: its exchange 'nowhere' is not one of the topology's"


async def test_a_dispatch_given_up_while_its_job_is_locked_waits_then_fails_it(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A logger not yet used, so that capture_logs sees its lines.
    monkeypatch.setattr(relay_record, "log", structlog.get_logger("jobplane.relay"))
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    job_id, row_id = await insert_job(engine, stack.tenant_id, topology.queues[0].name, "demo.echo")
    # A row no publish can take (an exchange the topology lacks), in the
    # middle of a run of returns that deferring must keep.
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE outbox SET exchange = 'nowhere', returns = 2, "
                "first_returned_at = now() - interval '1 minute' WHERE id = :id"
            ),
            {"id": row_id},
        )
    first_due = await stack.scalar("SELECT available_at FROM outbox WHERE id = :id", id=row_id)

    async def tried() -> bool:
        attempts = await stack.scalar(
            "SELECT publish_attempts FROM outbox WHERE id = :id", id=row_id
        )
        return bool(attempts >= 1)

    with capture_logs() as logs:
        async with engine.connect() as holder:
            await holder.execute(
                text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": job_id}
            )
            relay = await stack.start_relay()
            await eventually(tried)
            row = await stack.scalar(
                "SELECT (failed_at, published_at, last_error, returns, "
                "first_returned_at < now() - interval '30 seconds', available_at > :first) "
                "FROM outbox WHERE id = :id",
                id=row_id,
                first=first_due,
            )
            assert row == (None, None, _UNPUBLISHABLE, 2, True, True)
            assert relay.failed == 0
            assert "relay.dispatch.failed" not in [entry["event"] for entry in logs]
            await holder.rollback()
        assert await stack.scalar("SELECT state FROM jobs WHERE id = :id", id=job_id) in (
            "queued",
            "failed",  # the next pass may have come already
        )

        async def failed() -> bool:
            state = await stack.scalar("SELECT state FROM jobs WHERE id = :id", id=job_id)
            return bool(state == "failed")

        await eventually(failed, timeout=30)
        job = await stack.scalar(
            "SELECT (error_code, error_message) FROM jobs WHERE id = :id", id=job_id
        )
        assert job == ("DISPATCH_FAILED", _UNPUBLISHABLE)
        assert await stack.scalar(
            "SELECT failed_at IS NOT NULL FROM outbox WHERE id = :id", id=row_id
        )
    assert relay.failed == 1
    (line,) = [entry for entry in logs if entry["event"] == "relay.dispatch.failed"]
    assert line == {
        "event": "relay.dispatch.failed",
        "log_level": "error",
        "job": job_name(job_id),
        "event_id": str(row_id),
        "code": "DISPATCH_FAILED",
        "error": _UNPUBLISHABLE,
        "job_failed": True,
    }
