"""A RUNNING job's heartbeats and progress are heap-only (HOT) updates (ADR-0051).

Each write's new row version is read off its page (``pageinspect``): a HOT
update's version is flagged heap-only, and no index got an entry for it.
The flag is the row's own, not a statistics counter that a backend reports
later, so the check needs no waiting. The claim and the outcome change the
state, which the indexes name: those are never HOT, and the test says so.
"""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text

from jobplane.client import JobState
from jobplane.store.attempts import Attempt, AttemptStore, ClaimStatus, ProgressUpdate
from tests.support.stack import Stack

# t_infomask2's HEAP_ONLY_TUPLE: the version a HOT update wrote.
_HEAP_ONLY = 0x8000
_VERSION = """
SELECT p.t_infomask2
FROM jobs j, heap_page_items(get_raw_page('jobs', (j.ctid::text::point)[0]::integer)) p
WHERE j.id = :id AND p.lp = (j.ctid::text::point)[1]::integer
"""


async def _sql(stack: Stack, statement: str) -> None:
    async with stack.engine.begin() as conn:
        await conn.execute(text(statement))


async def _heap_only(stack: Stack, job_id: str) -> bool:
    """Whether the job's current row version was written by a HOT update."""
    mask = await stack.scalar(_VERSION, id=uuid.UUID(job_id))
    return bool(int(mask) & _HEAP_ONLY)


async def _claimed(stack: Stack, store: AttemptStore) -> tuple[str, Attempt]:
    job = await stack.client().submit("demo.echo", {})
    claimed = await store.claim(await stack.envelope(job.id))
    assert claimed.status is ClaimStatus.CLAIMED and claimed.attempt is not None
    return job.id, claimed.attempt


@pytest.fixture
async def inspected(bare: Stack) -> Stack:
    await _sql(bare, "CREATE EXTENSION IF NOT EXISTS pageinspect")
    return bare


async def test_heartbeats_and_progress_are_hot_and_the_ends_are_not(inspected: Stack) -> None:
    stack = inspected
    store = AttemptStore(stack.db, lease_seconds=30.0)
    job_id, attempt = await _claimed(stack, store)
    # The claim moves the job into RUNNING: a new entry in the indexes by state.
    assert not await _heap_only(stack, job_id)

    for _ in range(3):
        assert await store.heartbeat(attempt) is False
        assert await _heap_only(stack, job_id), "a heartbeat wrote index entries"
    for step in (0.25, 0.5):
        update = ProgressUpdate(step, f"at {step}", {})
        await store.write_progress(attempt, [update])
        assert await _heap_only(stack, job_id), "a progress report wrote index entries"

    await store.succeed(attempt, {"ok": True})
    assert not await _heap_only(stack, job_id)
    done = await stack.client().get(f"jobs/{job_id}")
    assert done.state is JobState.SUCCEEDED and done.progress == 1.0


async def test_an_index_on_the_lease_would_make_every_heartbeat_write_the_indexes(
    inspected: Stack,
) -> None:
    """The check above can fail: with the lease indexed again (as before 0026),
    the same heartbeat is no longer HOT."""
    stack = inspected
    await _sql(stack, "CREATE INDEX jobs_lease_again ON jobs (lease_expires_at)")
    store = AttemptStore(stack.db, lease_seconds=30.0)
    job_id, attempt = await _claimed(stack, store)
    assert await store.heartbeat(attempt) is False
    assert not await _heap_only(stack, job_id)
    # Progress names no indexed column: still HOT.
    await store.write_progress(attempt, [ProgressUpdate(0.5, "", {})])
    assert await _heap_only(stack, job_id)


async def test_jobs_leaves_room_on_its_pages_and_no_index_names_a_running_write(
    inspected: Stack,
) -> None:
    """No index on jobs names a column that a heartbeat or a progress report sets."""
    options = await inspected.scalar("SELECT reloptions FROM pg_class WHERE oid = 'jobs'::regclass")
    assert "fillfactor=80" in options
    indexed = await inspected.scalar(
        """
        SELECT coalesce(array_agg(DISTINCT a.attname::text), '{}')
        FROM pg_index i
        JOIN pg_attribute a ON a.attrelid = i.indrelid
        WHERE i.indrelid = 'jobs'::regclass AND a.attnum > 0
          AND (a.attnum = ANY (i.indkey)
               OR pg_get_expr(i.indpred, i.indrelid) ~ ('\\m' || a.attname || '\\M'))
        """
    )
    running_writes = {"lease_expires_at", "progress", "progress_message", "last_seq", "update_time"}
    assert running_writes.isdisjoint(indexed), running_writes & set(indexed)
