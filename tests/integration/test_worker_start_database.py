"""A worker whose database goes away while it registers waits for it, says so, and
then runs jobs as any worker does."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DBAPIError

from jobplane.client import JobState
from jobplane.workers import runtime
from jobplane.workers.presence import Presence
from tests.support.logs import module_lines
from tests.support.stack import Stack

# A server and a relay: the test starts the worker.
pytestmark = pytest.mark.stack(worker=False)


async def test_a_worker_registering_while_the_database_is_down_waits_for_it(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    tries: list[int] = []
    register = Presence.start

    async def down_once(presence: Presence) -> None:
        tries.append(1)
        if len(tries) == 1:
            lost = ConnectionResetError("the server closed the connection")
            raise DBAPIError("INSERT INTO workers ...", {}, lost, connection_invalidated=True)
        await register(presence)

    monkeypatch.setattr(Presence, "start", down_once)
    with module_lines(monkeypatch, runtime, "jobplane.worker.start") as lines:
        await stack.start_worker()
    assert len(tries) == 2
    (line,) = [line for line in lines if line["event"] == "database.unavailable"]
    assert line["log_level"] == "warning" and line["retry_in"] == 0.5
    client = stack.client()
    job = await client.submit("demo.echo", {"n": 1})
    assert (await client.wait(job.name, timeout=30)).state is JobState.SUCCEEDED
