"""Dependencies on the real database: a job that runs after other jobs (ADR-0045).

The tests claim and end attempts as a worker would (no broker), so what they
see is the store's rule alone: a job waits QUEUED without a dispatch until
the jobs it runs after have ended, and each end settles its dependents in its
own transaction.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from jobplane import txn
from jobplane.client import InvalidArgument, Job, JobNotRetryable, JobState
from jobplane.store.attempts import AttemptStore, ClaimStatus
from jobplane.store.sweeps import SweepStore
from jobplane.types import DependencyFailurePolicy, WaitingCode
from tests.support.stack import Stack

_UNMARK = text("UPDATE jobs SET has_dependents = false WHERE id = :id")


async def _dispatch(stack: Stack, job: Job) -> Any:
    return await stack.scalar("SELECT dispatch_id FROM jobs WHERE id = :id", id=job.id)


async def _run(stack: Stack, store: AttemptStore, job: Job, *, ok: bool = True) -> None:
    """Claim ``job``'s dispatch and end its attempt: succeeded, or failed for good."""
    claim = await store.claim(await stack.envelope(job.id))
    assert claim.status is ClaimStatus.CLAIMED and claim.attempt is not None, (job.name, claim)
    if ok:
        await store.succeed(claim.attempt, {})
    else:
        await store.fail(claim.attempt, "BROKEN", "broken", retryable=False)


def _store(stack: Stack) -> AttemptStore:
    return AttemptStore(stack.db, lease_seconds=30.0)


async def test_a_job_after_another_runs_only_once_it_succeeded(bare: Stack) -> None:
    client = bare.client()
    store = _store(bare)
    a = await client.submit("demo.echo", {})
    b = await client.submit("demo.echo", {}, after=[a])
    assert b.after == (a.name,) and b.after_failure is DependencyFailurePolicy.FAIL
    assert b.state is JobState.QUEUED and b.waiting_code == WaitingCode.DEPENDENCIES
    assert a.name in b.waiting_reason
    # No dispatch while it waits: nothing reaches the broker.
    assert await _dispatch(bare, b) is None
    outbox = "SELECT count(*) FROM outbox WHERE job_id = :id"
    assert await bare.scalar(outbox, id=b.id) == 0

    claim = await store.claim(await bare.envelope(a.id))
    assert claim.attempt is not None
    assert (await client.get(b.name)).waiting_code == WaitingCode.DEPENDENCIES
    await store.succeed(claim.attempt, {})
    # Settled in the end's own transaction: dispatched now, no sweep needed.
    ready = await client.get(b.name)
    assert ready.state is JobState.QUEUED and ready.waiting_code == ""
    assert await _dispatch(bare, b) is not None
    await _run(bare, store, b)
    done_a, done_b = await client.get(a.name), await client.get(b.name)
    assert done_b.state is JobState.SUCCEEDED
    assert done_a.end_time is not None and done_b.start_time is not None
    assert done_b.start_time >= done_a.end_time


async def test_a_diamond_joins_when_both_branches_succeed(bare: Stack) -> None:
    client = bare.client()
    store = _store(bare)
    a = await client.submit("demo.echo", {})
    b = await client.submit("demo.echo", {}, after=[a.name])
    c = await client.submit("demo.echo", {}, after=[a])
    d = await client.submit("demo.echo", {}, after=[b, c])
    await _run(bare, store, a)
    assert await _dispatch(bare, b) is not None and await _dispatch(bare, c) is not None
    waiting = await client.get(d.name)
    assert waiting.waiting_code == WaitingCode.DEPENDENCIES
    assert b.name in waiting.waiting_reason and c.name in waiting.waiting_reason
    await _run(bare, store, c)
    still = await client.get(d.name)
    assert still.waiting_code == WaitingCode.DEPENDENCIES and await _dispatch(bare, d) is None
    # The reason names only the job still awaited.
    assert b.name in still.waiting_reason and c.name not in still.waiting_reason
    await _run(bare, store, b)
    assert await _dispatch(bare, d) is not None
    await _run(bare, store, d)
    ended = {j.name: await client.get(j.name) for j in (b, c, d)}
    assert ended[d.name].start_time is not None
    assert all(
        ended[d.name].start_time >= ended[j.name].end_time  # type: ignore[operator]
        for j in (b, c)
    )


@pytest.mark.parametrize(
    ("policy", "state", "code"),
    [
        (None, JobState.FAILED, "DEPENDENCY_FAILED"),
        ("fail", JobState.FAILED, "DEPENDENCY_FAILED"),
        ("cancel", JobState.CANCELLED, "CANCELLED"),
        ("run_anyway", JobState.QUEUED, None),
    ],
)
async def test_a_failed_dependency_ends_or_runs_the_job_as_its_policy_says(
    bare: Stack, policy: str | None, state: JobState, code: str | None
) -> None:
    client = bare.client()
    store = _store(bare)
    a = await client.submit("demo.echo", {})
    other = await client.submit("demo.echo", {})
    b = await client.submit("demo.echo", {}, after=[a, other], after_failure=policy)
    await _run(bare, store, a, ok=False)
    after = await client.get(b.name)
    if policy == "run_anyway":
        # It waits for the other one still: it runs once all have ended.
        assert after.waiting_code == WaitingCode.DEPENDENCIES and other.name in after.waiting_reason
        await _run(bare, store, other)
        await _run(bare, store, b)
        assert (await client.get(b.name)).state is JobState.SUCCEEDED
        return
    # Ended at once, without waiting for the other one.
    assert after.state is state and after.error is not None and after.error.code == code
    assert a.name in after.error.message and "FAILED" in after.error.message
    assert await _dispatch(bare, b) is None


async def test_a_failure_ends_the_jobs_after_the_jobs_it_ends(bare: Stack) -> None:
    client = bare.client()
    store = _store(bare)
    a = await client.submit("demo.echo", {})
    b = await client.submit("demo.echo", {}, after=[a])
    c = await client.submit("demo.echo", {}, after=[b], after_failure="cancel")
    d = await client.submit("demo.echo", {}, after=[c], after_failure="run_anyway")
    await _run(bare, store, a, ok=False)
    got = {j.name: await client.get(j.name) for j in (b, c, d)}
    assert got[b.name].state is JobState.FAILED
    assert got[c.name].state is JobState.CANCELLED and b.name in got[c.name].error.message  # type: ignore[union-attr]
    # d runs anyway: every job it runs after has ended.
    assert got[d.name].state is JobState.QUEUED and got[d.name].waiting_code == ""
    assert await _dispatch(bare, d) is not None


async def test_a_job_after_jobs_that_ended_is_settled_at_submit(bare: Stack) -> None:
    client = bare.client()
    store = _store(bare)
    good = await client.submit("demo.echo", {})
    bad = await client.submit("demo.echo", {})
    await _run(bare, store, good)
    await _run(bare, store, bad, ok=False)

    runs = await client.submit("demo.echo", {}, after=[good])
    assert runs.waiting_code == "" and await _dispatch(bare, runs) is not None
    failed = await client.submit("demo.echo", {}, after=[good, bad])
    assert failed.state is JobState.FAILED and failed.error is not None
    assert failed.error.code == "DEPENDENCY_FAILED" and bad.name in failed.error.message
    cancelled = await client.submit("demo.echo", {}, after=[bad], after_failure="cancel")
    assert cancelled.state is JobState.CANCELLED
    anyway = await client.submit("demo.echo", {}, after=[bad], after_failure="run_anyway")
    assert anyway.state is JobState.QUEUED and await _dispatch(bare, anyway) is not None
    await _run(bare, store, anyway)
    # Stored as it was answered.
    assert (await client.get(failed.name)).state is JobState.FAILED


async def test_cancel_of_a_waiting_job_ends_it_and_settles_its_own_dependents(
    bare: Stack,
) -> None:
    client = bare.client()
    store = _store(bare)
    a = await client.submit("demo.echo", {})
    b = await client.submit("demo.echo", {}, after=[a])
    c = await client.submit("demo.echo", {}, after=[b])
    cancelled = await client.cancel(b.name)
    assert cancelled.state is JobState.CANCELLED
    ended = await client.get(c.name)
    assert ended.state is JobState.FAILED and ended.error is not None
    assert b.name in ended.error.message and "CANCELLED" in ended.error.message
    # a's end later changes nothing of theirs.
    await _run(bare, store, a)
    assert (await client.get(b.name)).state is JobState.CANCELLED


async def test_retry_of_a_failed_dependency_does_not_revive_its_failed_dependents(
    bare: Stack,
) -> None:
    client = bare.client()
    store = _store(bare)
    a = await client.submit("demo.echo", {}, max_attempts=1)
    b = await client.submit("demo.echo", {}, after=[a])
    waiting = await client.submit("demo.echo", {}, after=[a], after_failure="run_anyway")
    await _run(bare, store, a, ok=False)
    assert (await client.get(b.name)).state is JobState.FAILED
    await client.retry(a.name)
    await _run(bare, store, a)
    # Each edge counts its job's first end: b stays FAILED, and the one that
    # ran anyway was dispatched once.
    assert (await client.get(b.name)).state is JobState.FAILED
    await _run(bare, store, waiting)
    assert (await client.get(waiting.name)).state is JobState.SUCCEEDED


async def test_a_job_ended_while_it_waited_is_retried_only_once_they_have_ended(
    bare: Stack,
) -> None:
    """A cancelled waiting job, and one another dependency's failure ended: their
    retry would run them before the jobs they run after, so it waits for those."""
    client = bare.client()
    store = _store(bare)
    a = await client.submit("demo.echo", {})
    doomed = await client.submit("demo.echo", {}, max_attempts=1)
    cancelled = await client.submit("demo.echo", {}, after=[a])
    failed = await client.submit("demo.echo", {}, after=[a, doomed])
    await client.cancel(cancelled.name)
    await _run(bare, store, doomed, ok=False)
    assert (await client.get(failed.name)).state is JobState.FAILED
    for job in (cancelled, failed):
        with pytest.raises(JobNotRetryable, match="runs after 1 job"):
            await client.retry(job.name)
        assert (await client.get(job.name)).state is not JobState.QUEUED
        assert await _dispatch(bare, job) is None
    await _run(bare, store, a)
    for job in (cancelled, failed):
        again = await client.retry(job.name)
        assert again.state is JobState.QUEUED
        await _run(bare, store, job)
        assert (await client.get(job.name)).state is JobState.SUCCEEDED


async def test_the_sweeper_settles_a_job_an_end_left_waiting(bare: Stack) -> None:
    client = bare.client()
    store = _store(bare)
    a = await client.submit("demo.echo", {})
    b = await client.submit("demo.echo", {}, after=[a])
    # As if the mark were lost: a's end does not know it has a dependent.
    async with bare.engine.begin() as conn:
        await conn.execute(_UNMARK, {"id": a.id})
    await _run(bare, store, a)
    assert (await client.get(b.name)).waiting_code == WaitingCode.DEPENDENCIES
    assert await SweepStore(bare.engine).settle_dependencies(limit=10) == 1
    assert await _dispatch(bare, b) is not None
    assert await SweepStore(bare.engine).settle_dependencies(limit=10) == 0


async def test_waiting_jobs_are_listed_by_their_code(bare: Stack) -> None:
    client = bare.client()
    a = await client.submit("demo.echo", {})
    b = await client.submit("demo.echo", {}, after=[a])
    page = await client.list(waiting_code="DEPENDENCIES")
    assert [j.name for j in page.jobs] == [b.name]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"after": ["job/1"]}, "after[0]"),
        ({"after": ["jobs/not-a-uuid"]}, "after[0]"),
        ({"after": [f"jobs/{uuid.uuid4()}"]}, "after[0]"),
        ({"after": [f"jobs/{uuid.uuid4()}"] * 2}, "after[1]"),
        ({"after": [f"jobs/{uuid.uuid4()}" for _ in range(101)]}, "after"),
        ({"after_failure": "cancel"}, "after_failure"),
    ],
)
async def test_bad_after_is_refused_on_its_field_and_nothing_is_written(
    bare: Stack, kwargs: dict[str, Any], field: str
) -> None:
    client = bare.client()
    existing = await client.submit("demo.echo", {})
    before = await bare.counts()
    marked = "SELECT has_dependents FROM jobs WHERE id = :id"
    with pytest.raises(InvalidArgument) as refused:
        await client.submit("demo.echo", {}, **kwargs)
    assert refused.value.field == field, refused.value
    batch = [{"type": "demo.echo", "after": [existing]}, {"type": "demo.echo", **kwargs}]
    with pytest.raises(InvalidArgument) as in_batch:
        await client.submit_many(batch)
    assert in_batch.value.field == f"requests[1].{field}", in_batch.value
    assert await bare.counts() == before
    assert await bare.scalar("SELECT count(*) FROM job_dependencies") == 0
    assert await bare.scalar(marked, id=existing.id) is False


async def test_another_tenants_job_reads_as_no_job(bare: Stack) -> None:
    theirs = await bare.client(await bare.new_key("globex")).submit("demo.echo", {})
    client = bare.client()
    before = await bare.counts()
    with pytest.raises(InvalidArgument) as foreign:
        await client.submit("demo.echo", {}, after=[theirs.name])
    missing = f"jobs/{uuid.uuid4()}"
    with pytest.raises(InvalidArgument) as unknown:
        await client.submit("demo.echo", {}, after=[missing])
    assert foreign.value.field == unknown.value.field == "after[0]"
    assert foreign.value.reason == unknown.value.reason
    assert foreign.value.message.replace(theirs.name, "X") == unknown.value.message.replace(
        missing, "X"
    )
    assert await bare.counts() == before


async def test_the_sql_api_takes_after(bare: Stack) -> None:
    client = bare.client()
    store = _store(bare)
    a = await client.submit("demo.echo", {})
    async with bare.engine.begin() as conn:
        b = await txn.submit_job(conn, tenant="acme", type="demo.echo", after=[a.name])
        old = await txn.submit_job(conn, tenant="acme", type="demo.echo")
    waiting = await client.get(f"jobs/{b}")
    assert waiting.after == (a.name,) and waiting.waiting_code == WaitingCode.DEPENDENCIES
    assert (await client.get(f"jobs/{old}")).waiting_code == ""
    await _run(bare, store, a)
    assert await bare.scalar("SELECT dispatch_id FROM jobs WHERE id = :id", id=str(b))
    async with bare.engine.begin() as conn:
        with pytest.raises(InvalidArgument) as bad:
            await txn.submit_job(conn, tenant="acme", type="demo.echo", after=[uuid.uuid4()])
    assert bad.value.field == "after[0]"
    # A two-dimensional array, straight to the function: refused, nothing written.
    before = await bare.scalar("SELECT count(*) FROM jobs")
    async with bare.engine.connect() as conn:
        with pytest.raises(DBAPIError, match="one-dimensional"):
            await conn.execute(
                text(
                    "SELECT jobplane.submit_job('acme', 'demo.echo', '{}'::jsonb, NULL, NULL, "
                    "0, '{}'::jsonb, NULL, after => ARRAY[ARRAY[CAST(:a AS uuid)], "
                    "ARRAY[CAST(:a AS uuid)]])"
                ),
                {"a": a.id},
            )
    assert await bare.scalar("SELECT count(*) FROM jobs") == before


# A random DAG: each job may run after any of the jobs before it.
@st.composite
def _dags(draw: st.DrawFn) -> list[tuple[list[int], str, bool]]:
    """Per job: the earlier jobs it runs after, its policy, whether its run succeeds."""
    jobs = []
    for i in range(draw(st.integers(2, 6))):
        after = sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else []
        policy = draw(st.sampled_from(["fail", "cancel", "run_anyway"]))
        jobs.append((after, policy, draw(st.booleans())))
    return jobs


async def test_random_dags_end_every_job_and_start_none_before_its_dependencies(
    bare: Stack,
) -> None:
    loop = asyncio.get_running_loop()
    client = bare.client()
    store = _store(bare)

    async def play(dag: list[tuple[list[int], str, bool]]) -> None:
        jobs: list[Job] = []
        for after, policy, _ in dag:
            jobs.append(
                await client.submit(
                    "demo.echo",
                    {},
                    max_attempts=1,
                    after=[jobs[k] for k in after],
                    after_failure=policy if after else None,
                )
            )
        # A worker: run whatever has a dispatch, until nothing has.
        for _ in range(len(dag) + 1):
            ready = [
                i
                for i, job in enumerate(jobs)
                if (await client.get(job.name)).state is JobState.QUEUED
                and await _dispatch(bare, job) is not None
            ]
            if not ready:
                break
            for i in ready:
                await _run(bare, store, jobs[i], ok=dag[i][2])
        ended = [await client.get(job.name) for job in jobs]
        assert all(j.state.terminal for j in ended), [(j.name, j.state) for j in ended]
        for i, (after, policy, _) in enumerate(dag):
            job = ended[i]
            ok = all(ended[k].state is JobState.SUCCEEDED for k in after)
            if job.start_time is not None:
                for k in after:
                    end = ended[k].end_time
                    assert end is not None and job.start_time >= end
                assert ok or policy == "run_anyway"
            else:
                assert not ok and policy != "run_anyway"
                expected = JobState.CANCELLED if policy == "cancel" else JobState.FAILED
                assert job.state is expected

    @settings(max_examples=15, deadline=None, derandomize=True)
    @given(_dags())
    def check(dag: list[tuple[list[int], str, bool]]) -> None:
        asyncio.run_coroutine_threadsafe(play(dag), loop).result()

    await asyncio.to_thread(check)
