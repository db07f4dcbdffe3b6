"""Fan-out and the upkeep passes, on the real database and broker (ADR-0047):
retention keeps a waiting job's ended children (its join reads their
results); a replay of the failed queue drops a waiting job's stale message."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text

from jobplane.client import JobState
from jobplane.envelope import Envelope
from jobplane.store.maintenance import MaintenanceStore
from jobplane.types import WaitingCode
from jobplane.workers.dlq import FailedQueue
from tests.integration.test_fan_out import (  # noqa: F401
    _children,
    _claim,
    _end,
    _split,
    _store,
    fans,
    fbare,
)
from tests.support.queues import dead_letter
from tests.support.stack import Stack

pytestmark = pytest.mark.integration

_AGE = text(
    "UPDATE jobs SET create_time = now() - interval '3 days', "
    "end_time = now() - interval '2 days' WHERE id = ANY (CAST(:ids AS uuid[]))"
)


async def test_retention_keeps_a_waiting_jobs_ended_children_until_it_ends(
    fbare: Stack,  # noqa: F811
) -> None:
    store = _store(fbare)
    client = fbare.client()
    maintenance = MaintenanceStore(fbare.engine)
    me = uuid.uuid4()
    job = await _split(fbare, store, "docs.ingest", 2)
    a, b = await _children(fbare, job)
    await _end(store, await _claim(fbare, store, a.id), True, i=0)
    lone = await client.submit("docs.embed", {"i": 9})
    await _end(store, await _claim(fbare, store, lone.id), True, i=9)
    async with fbare.engine.begin() as conn:
        await conn.execute(_AGE, {"ids": [uuid.UUID(a.id), uuid.UUID(lone.id)]})
    cutoff = await maintenance.cutoff(1)
    # The lone job goes; the child its waiting job will read stays.
    assert await maintenance.count_expired_jobs(fbare.tenant_id, cutoff, keep=me) == 1
    deleted = await maintenance.delete_expired_jobs(
        fbare.tenant_id, cutoff, keep=me, limit=100, max_rows=100_000
    )
    assert deleted.jobs == 1
    assert (await client.get(a.name)).state is JobState.SUCCEEDED
    await _end(store, await _claim(fbare, store, b.id), True, i=1)
    join = await _claim(fbare, store, job.id)
    assert join.stage is not None and join.stage.results is not None
    assert [(r.index, r.result) for r in join.stage.results] == [(0, {"i": 0}), (1, {"i": 1})]
    # A join that runs may read them again (a retried attempt): still kept.
    expired = maintenance.delete_expired_jobs
    assert (await expired(fbare.tenant_id, cutoff, keep=me, limit=100, max_rows=100_000)).jobs == 0
    await store.succeed(join, {"indexed": 2})
    assert (await client.get(job.name)).state is JobState.SUCCEEDED
    # The job has ended: its old child is retention's again.
    assert (await expired(fbare.tenant_id, cutoff, keep=me, limit=100, max_rows=100_000)).jobs == 1
    count = "SELECT count(*) FROM jobs WHERE id = :id"
    assert await fbare.scalar(count, id=a.id) == 0


async def test_a_replay_drops_the_stale_message_of_a_job_waiting_for_its_children(
    fbare: Stack,  # noqa: F811
    amqp_url: str,
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.ingest", 2)
    before = await client.get(job.name)
    # Its split stage's dispatch, dead-lettered (a crash loop, say).
    stale = Envelope(uuid.uuid4(), uuid.UUID(job.id), fbare.tenant_id, "docs.split")
    failed = FailedQueue(amqp_url, fbare.topology)
    await dead_letter(amqp_url, fbare.topology, stale)
    report = await failed.replay(fbare.engine)
    assert report.waiting == [job.name]
    assert report.replayed == report.kept == report.finished == []
    assert await failed.list() == []
    after = await client.get(job.name)
    assert after.state is JobState.QUEUED and after.waiting_code == WaitingCode.DEPENDENCIES
    assert after.last_seq == before.last_seq
