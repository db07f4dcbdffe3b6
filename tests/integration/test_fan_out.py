"""Fan-out and join on the real database (ADR-0047).

The tests claim and end attempts as a worker would (no broker), so what they
see is the machine's rule alone: a stage before a fan-out stage spawns one
child per item in its success's transaction, each child's end settles the
job, and the last one dispatches the join stage with the results in order.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job, JobState, StageState
from jobplane.store.attempts import Attempt, AttemptStore, ClaimStatus, LeaseLost
from jobplane.topology import Topology
from jobplane.types import WaitingCode
from tests.support import services
from tests.support.fan_out import fan_topology
from tests.support.stack import Stack, start_stack

pytestmark = pytest.mark.integration

_EXPIRE = text("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = :id")


@pytest.fixture
async def fans(amqp_url: str) -> AsyncIterator[Topology]:
    names = fan_topology(f"f{uuid.uuid4().hex[:6]}.")
    yield names
    await services.delete_topology(amqp_url, names)


@pytest.fixture
async def fbare(
    engine: AsyncEngine, database_url: str, amqp_url: str, fans: Topology
) -> AsyncIterator[Stack]:
    """A server alone on the fan-out topology: the test claims as a worker would."""
    stack = await start_stack(engine, database_url, amqp_url, fans, relay=False, worker=False)
    yield stack
    await stack.close()


def _store(stack: Stack) -> AttemptStore:
    return AttemptStore(stack.db, lease_seconds=30.0)


async def _claim(stack: Stack, store: AttemptStore, job_id: str) -> Attempt:
    claim = await store.claim(await stack.envelope(job_id))
    assert claim.status is ClaimStatus.CLAIMED and claim.attempt is not None, claim
    return claim.attempt


async def _children(stack: Stack, job: Job) -> list[Job]:
    client = stack.client()
    page = await client.list(parent=job.name, page_size=100)
    return sorted(page.jobs, key=lambda j: j.payload.get("i", 0))


async def _split(stack: Stack, store: AttemptStore, pipeline: str, n: int) -> Job:
    client = stack.client()
    job = await client.submit(pipeline, {"doc": "d"})
    attempt = await _claim(stack, store, job.id)
    assert attempt.stage is not None and attempt.stage.fans_out
    await store.succeed(attempt, [{"i": i} for i in range(n)])  # type: ignore[arg-type]
    return await client.get(job.name)


async def _end(store: AttemptStore, attempt: Attempt, ok: bool, **result: Any) -> None:
    if ok:
        await store.succeed(attempt, result)
    else:
        await store.fail(attempt, "BROKEN", f"item {result} broke", retryable=False)


async def test_a_fan_out_spawns_children_and_the_join_gets_their_results_in_order(
    fbare: Stack,
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.ingest", 4)
    assert job.state is JobState.QUEUED and job.stage == "embed"
    assert job.waiting_code == WaitingCode.DEPENDENCIES
    assert "4 children" in job.waiting_reason
    # The splitting stage's result says how many children it spawned.
    assert job.stages[0].result == {"children": 4}
    assert [s.state for s in job.stages] == [
        StageState.SUCCEEDED,
        StageState.RUNNING,
        StageState.PENDING,
    ]
    children = await _children(fbare, job)
    assert [c.payload for c in children] == [{"i": i} for i in range(4)]
    assert all(c.parent == job.name and c.state is JobState.QUEUED for c in children)
    # Finished out of order: the join sees item order.
    progress = [job.progress]
    for child in reversed(children):
        attempt = await _claim(fbare, store, child.id)
        await _end(store, attempt, True, doubled=child.payload["i"] * 2)
        progress.append((await client.get(job.name)).progress)
    assert progress == sorted(progress) and progress[-1] > progress[0]
    joined = await client.get(job.name)
    assert joined.state is JobState.QUEUED and joined.stage == "index", joined
    attempt = await _claim(fbare, store, job.id)
    assert attempt.stage is not None and attempt.stage.results is not None
    results = attempt.stage.results
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert [r.result for r in results] == [{"doubled": i * 2} for i in range(4)]
    assert all(r.ok and r.error is None for r in results)
    assert [r.job for r in results] == [c.name for c in children]
    await store.succeed(attempt, {"indexed": len(results)})
    done = await client.get(job.name)
    assert done.state is JobState.SUCCEEDED and done.result == {"indexed": 4}
    assert [s.state for s in done.stages] == [StageState.SUCCEEDED] * 3


async def test_a_stale_attempt_spawns_nothing(fbare: Stack) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await client.submit("docs.ingest", {"doc": "d"})
    stale = await _claim(fbare, store, job.id)
    # Its lease runs out and a redelivery starts attempt 2: attempt 1 is fenced out.
    async with fbare.engine.begin() as conn:
        await conn.execute(_EXPIRE, {"id": job.id})
    fresh = await _claim(fbare, store, job.id)
    assert fresh.attempt == stale.attempt + 1
    with pytest.raises(LeaseLost):
        await store.succeed(stale, [{"i": 1}])  # type: ignore[arg-type]
    count = "SELECT count(*) FROM jobs WHERE parent_id = :id"
    assert await fbare.scalar(count, id=job.id) == 0
    await store.succeed(fresh, [{"i": 1}, {"i": 2}])  # type: ignore[arg-type]
    assert await fbare.scalar(count, id=job.id) == 2
    assert (await client.get(job.name)).stage == "embed"


async def _run_children(
    stack: Stack,
    store: AttemptStore,
    job: Job,
    fails: set[int] = frozenset(),  # type: ignore[assignment]
) -> list[Job]:
    """Run each child of ``job`` that is QUEUED once: those at ``fails`` fail for good."""
    children = await _children(stack, job)
    for child in children:
        if child.state is JobState.QUEUED:
            attempt = await _claim(stack, store, child.id)
            await _end(store, attempt, child.payload["i"] not in fails, i=child.payload["i"])
    return await _children(stack, job)


async def test_all_must_succeed_fails_the_job_once_every_child_ended(fbare: Stack) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.ingest", 3)
    first, *rest = await _children(fbare, job)
    await _end(store, await _claim(fbare, store, first.id), False, i=0)
    # One failed, two to end: the job still waits for them.
    waiting = await client.get(job.name)
    assert waiting.state is JobState.QUEUED and "2 of its 3 children" in waiting.waiting_reason
    for child in rest:
        await _end(store, await _claim(fbare, store, child.id), True, i=1)
    failed = await client.get(job.name)
    assert failed.state is JobState.FAILED and failed.stage == "embed"
    assert failed.error is not None and failed.error.code == "CHILDREN_FAILED"
    assert "1 of its 3 children" in failed.error.message
    assert [s.state for s in failed.stages] == [
        StageState.SUCCEEDED,
        StageState.FAILED,
        StageState.PENDING,
    ]


async def test_tolerated_failures_reach_the_join_marked_with_their_errors(fbare: Stack) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.tolerant", 3)
    await _run_children(fbare, store, job, fails={1})
    joined = await client.get(job.name)
    assert joined.state is JobState.QUEUED and joined.stage == "index"
    attempt = await _claim(fbare, store, job.id)
    assert attempt.stage is not None and attempt.stage.results is not None
    results = attempt.stage.results
    assert [r.ok for r in results] == [True, False, True]
    assert results[1].state is JobState.FAILED and results[1].result is None
    assert results[1].error is not None and results[1].error.code == "BROKEN"
    assert results[0].result == {"i": 0} and results[2].result == {"i": 2}

    # One more failure than tolerated: the job fails, the join never runs.
    other = await _split(fbare, store, "docs.tolerant", 3)
    await _run_children(fbare, store, other, fails={0, 2})
    failed = await client.get(other.name)
    assert failed.state is JobState.FAILED and failed.error is not None
    assert failed.error.code == "CHILDREN_FAILED" and "(1 tolerated)" in failed.error.message


async def test_fail_fast_cancels_the_children_still_running_and_fails_the_job(
    fbare: Stack,
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.strict", 3)
    running, failing, queued = await _children(fbare, job)
    still = await _claim(fbare, store, running.id)
    await _end(store, await _claim(fbare, store, failing.id), False, i=1)
    failed = await client.get(job.name)
    assert failed.state is JobState.FAILED and failed.error is not None
    assert failed.error.code == "CHILDREN_FAILED"
    assert (await client.get(queued.name)).state is JobState.CANCELLED
    asked = await client.get(running.name)
    assert asked.state is JobState.RUNNING and asked.cancel_requested
    # The running child acknowledges: it ends CANCELLED, the job stays FAILED.
    await store.cancelled(still)
    assert (await client.get(running.name)).state is JobState.CANCELLED
    assert (await client.get(job.name)).state is JobState.FAILED


async def test_cancel_of_a_fanned_out_job_cancels_its_children(fbare: Stack) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.ingest", 3)
    done, running, queued = await _children(fbare, job)
    await _end(store, await _claim(fbare, store, done.id), True, i=0)
    still = await _claim(fbare, store, running.id)
    cancelled = await client.cancel(job.name, reason="enough")
    assert cancelled.state is JobState.CANCELLED
    assert (await client.get(queued.name)).state is JobState.CANCELLED
    assert (await client.get(running.name)).cancel_requested
    assert (await client.get(done.name)).state is JobState.SUCCEEDED
    await store.cancelled(still)
    assert (await client.get(job.name)).state is JobState.CANCELLED
    # Nothing dispatches the join of a cancelled job.
    assert await fbare.scalar("SELECT dispatch_id FROM jobs WHERE id = :id", id=job.id) is None


async def test_retry_runs_only_the_failed_children_again(fbare: Stack) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.ingest", 4)
    before = await _run_children(fbare, store, job, fails={1, 3})
    assert (await client.get(job.name)).state is JobState.FAILED
    retried = await client.retry(job.name)
    assert retried.state is JobState.QUEUED and retried.stage == "embed"
    assert "2 of its children" in retried.waiting_reason
    again = await _children(fbare, job)
    # The same child rows: the failed ones QUEUED for a new attempt, the others untouched.
    assert [c.name for c in again] == [c.name for c in before]
    for old, new in zip(before, again, strict=True):
        if old.payload["i"] in (1, 3):
            assert new.state is JobState.QUEUED and new.attempt == old.attempt
        else:
            assert new == old
    await _run_children(fbare, store, job)
    joined = await client.get(job.name)
    assert joined.state is JobState.QUEUED and joined.stage == "index"
    attempt = await _claim(fbare, store, job.id)
    assert attempt.stage is not None and attempt.stage.results is not None
    assert [r.result for r in attempt.stage.results] == [{"i": i} for i in range(4)]
    runs = "SELECT attempt FROM jobs WHERE parent_id = :id ORDER BY request_id"
    async with fbare.engine.connect() as conn:
        attempts = [int(a) for (a,) in await conn.execute(text(runs), {"id": job.id})]
    assert attempts == [1, 2, 1, 2]
    # The parent's progress never went back, over the whole run.
    events = "SELECT progress FROM job_events WHERE job_id = :id ORDER BY seq"
    async with fbare.engine.connect() as conn:
        progress = [float(p) for (p,) in await conn.execute(text(events), {"id": job.id})]
    assert progress == sorted(progress)


async def test_a_result_that_is_not_a_list_fails_the_stage_and_spawns_nothing(
    fbare: Stack,
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await client.submit("docs.ingest", {"doc": "d"})
    attempt = await _claim(fbare, store, job.id)
    await store.succeed(attempt, {"not": "a list"})
    failed = await client.get(job.name)
    assert failed.state is JobState.FAILED and failed.stage == "split"
    assert failed.error is not None and failed.error.code == "FAN_OUT_REFUSED"
    assert "must return a list" in failed.error.message
    count = "SELECT count(*) FROM jobs WHERE parent_id = :id"
    assert await fbare.scalar(count, id=job.id) == 0


async def test_no_items_join_at_once_with_no_results(fbare: Stack) -> None:
    store = _store(fbare)
    job = await _split(fbare, store, "docs.ingest", 0)
    assert job.state is JobState.QUEUED and job.stage == "index" and job.waiting_code == ""
    attempt = await _claim(fbare, store, job.id)
    assert attempt.stage is not None and attempt.stage.results == ()


async def test_an_operator_s_redispatch_leaves_a_job_waiting_for_its_children(
    fbare: Stack,
) -> None:
    from jobplane.store.sweeps import SweepStore

    store = _store(fbare)
    job = await _split(fbare, store, "docs.ingest", 2)
    sweeps = SweepStore(fbare.engine)
    assert await sweeps.redispatch(fbare.tenant_id, uuid.UUID(job.id), "operator") is None
    waiting = await fbare.client().get(job.name)
    assert waiting.state is JobState.QUEUED and waiting.waiting_code == WaitingCode.DEPENDENCIES
    assert await fbare.scalar("SELECT dispatch_id FROM jobs WHERE id = :id", id=job.id) is None


async def test_the_job_s_progress_counts_each_running_child_s_own(fbare: Stack) -> None:
    from jobplane.store.attempts import ProgressUpdate

    store = _store(fbare)
    client = fbare.client()
    # The embed stage is half the job (weights 1, 2, 1): from 0.25 to 0.75.
    job = await _split(fbare, store, "docs.ingest", 2)
    first, second = await _children(fbare, job)
    running = await _claim(fbare, store, first.id)
    seen = [(await client.get(job.name)).progress]
    await store.write_progress(running, [ProgressUpdate(0.5, "half", {})])
    seen.append((await client.get(job.name)).progress)
    await store.succeed(running, {})
    seen.append((await client.get(job.name)).progress)
    other = await _claim(fbare, store, second.id)
    await store.write_progress(other, [ProgressUpdate(0.5, "half", {})])
    seen.append((await client.get(job.name)).progress)
    # A report lower than the last (a retried child starting over) takes nothing back.
    await store.write_progress(other, [ProgressUpdate(0.1, "again", {})])
    seen.append((await client.get(job.name)).progress)
    assert seen == pytest.approx([0.25, 0.375, 0.5, 0.625, 0.625])
    await store.succeed(other, {})
    joined = await client.get(job.name)
    assert joined.stage == "index" and joined.progress == pytest.approx(0.75)


async def test_retry_waits_for_children_asked_to_cancel_to_end(fbare: Stack) -> None:
    from jobplane.client import JobNotRetryable

    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.strict", 2)
    running, failing = await _children(fbare, job)
    still = await _claim(fbare, store, running.id)
    await _end(store, await _claim(fbare, store, failing.id), False, i=1)
    assert (await client.get(job.name)).state is JobState.FAILED
    with pytest.raises(JobNotRetryable, match="1 of its children were asked to cancel"):
        await client.retry(job.name)
    await store.cancelled(still)
    retried = await client.retry(job.name)
    assert retried.state is JobState.QUEUED and retried.fan_out is not None
    assert (retried.fan_out.children, retried.fan_out.ended) == (2, 0)
    assert {c.state for c in await _children(fbare, job)} == {JobState.QUEUED}


async def test_retry_counts_a_child_that_succeeded_on_its_own_since_as_succeeded(
    fbare: Stack,
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.ingest", 2)
    a, b = await _children(fbare, job)
    await _end(store, await _claim(fbare, store, a.id), False, i=0)
    await _end(store, await _claim(fbare, store, b.id), True, i=1)
    assert (await client.get(job.name)).state is JobState.FAILED
    # The failed child, retried alone once its job had ended, succeeds.
    await client.retry(a.name)
    await _end(store, await _claim(fbare, store, a.id), True, i=0)
    retried = await client.retry(job.name)
    # Nothing to run again or wait for: the join is due at once.
    assert retried.state is JobState.QUEUED and retried.stage == "index", retried
    assert retried.waiting_code == ""
    assert [(await client.get(c.name)).attempt for c in (a, b)] == [2, 1]
    attempt = await _claim(fbare, store, job.id)
    assert attempt.stage is not None and attempt.stage.results is not None
    assert [r.result for r in attempt.stage.results] == [{"i": 0}, {"i": 1}]
