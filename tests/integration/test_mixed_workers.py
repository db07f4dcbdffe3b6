"""Workers with different handlers on one queue: each takes only what it can run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import EventType, JobState
from jobplane.envelope import Envelope
from jobplane.store.attempts import AttemptStore, ClaimStatus, HandBack
from jobplane.store.sweeps import SweepStore
from jobplane.store.workers import WorkerStore
from jobplane.topology import Topology
from jobplane.workers.handlers import JobContext, Registry
from tests.support.parts import Started
from tests.support.stack import Stack, eventually, start_stack

reports = Registry()


@reports.handler("reports.render")
async def render(ctx: JobContext) -> dict[str, Any]:
    await ctx.progress(0.5, "rendering")
    return {"report": ctx.payload["n"]}


async def test_two_registries_on_one_queue_run_every_job(stack: Stack) -> None:
    # The stack's worker has the demo handlers; this one only reports.render.
    # Both consume the topology's one queue, so each receives the other's jobs.
    await stack.start_worker(reports)
    client = stack.client()
    jobs = []
    for n in range(12):
        jobs.append(await client.submit("reports.render", {"n": n}))
        jobs.append(await client.submit("demo.echo", {"n": n}))
    done = await asyncio.wait_for(asyncio.gather(*(client.wait(j.name) for j in jobs)), 60)

    assert [j.state for j in done] == [JobState.SUCCEEDED] * len(jobs)
    # Handing a job back is free: every job ran once, on its first attempt.
    assert {(j.attempt, j.attempts_used) for j in done} == {(1, 1)}
    assert [j.result for j in done if j.type == "reports.render"] == [
        {"report": n} for n in range(12)
    ]
    assert all(j.waiting_reason == "" for j in done)
    # Hand-backs write no events: a job's stream is queued, started, its own
    # progress, succeeded.
    events = [e async for e in client.watch(jobs[0].name)]
    assert [e.type for e in events] == [
        EventType.QUEUED,
        EventType.STARTED,
        EventType.PROGRESS,
        EventType.SUCCEEDED,
    ]


async def test_a_type_nobody_handles_waits_with_a_reason_until_a_worker_for_it_starts(
    stack: Stack,
) -> None:
    await stack.start_worker(reports)
    client = stack.client()
    job = await client.submit("nobody.handles.this", {})
    queue = stack.topology.queues[0].name
    reason = f"no live worker handles type nobody.handles.this on queue {queue}"

    async def parked() -> bool:
        return (await client.get(job.name)).waiting_reason == reason

    await eventually(parked)
    waiting = await client.get(job.name)
    assert waiting.state is JobState.QUEUED
    assert waiting.attempt == 0 and waiting.error is None
    # Parked: no message or outbox row stands for it, so nothing spins.
    assert await stack.scalar("SELECT dispatch_id IS NULL FROM jobs WHERE id = :id", id=job.id)
    unpublished = "SELECT count(*) FROM outbox WHERE job_id = :id AND published_at IS NULL"
    assert await stack.scalar(unpublished, id=job.id) == 0
    # A watcher learns why: one event when it was parked.
    async with asyncio.timeout(10):
        async for event in client.watch(job.name):
            if event.seq == 2:
                assert event.type is EventType.QUEUED and event.message == reason
                break

    late = Registry()

    @late.handler("nobody.handles.this")
    async def finally_someone(ctx: JobContext) -> dict[str, Any]:
        return {"ran": ctx.attempt}

    await stack.start_worker(late)
    done = await asyncio.wait_for(client.wait(job.name), 30)
    assert done.state is JobState.SUCCEEDED
    assert done.result == {"ran": 1}
    assert done.waiting_reason == ""
    events = [e async for e in client.watch(job.name)]
    assert [e.type for e in events] == [
        EventType.QUEUED,
        EventType.QUEUED,  # parked
        EventType.QUEUED,  # dispatched again when the worker started
        EventType.STARTED,
        EventType.SUCCEEDED,
    ]
    assert "is live" in events[2].message


async def test_hand_back_is_fenced_and_parks_without_a_live_worker(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    client = stack.client()
    queue = topology.queues[0].name
    attempts = AttemptStore(stack.db)
    workers = WorkerStore(engine)
    job = await client.submit("reports.render", {"n": 1})
    envelope = await stack.envelope(job.id)

    # Nobody handles it: parked, with an event, no dispatch, no attempt.
    status, reason = await attempts.hand_back(envelope, base_delay=0.01, max_delay=0.1)
    assert status is HandBack.PARKED
    assert reason == f"no live worker handles type reports.render on queue {queue}"
    parked = await client.get(job.name)
    assert (parked.state, parked.attempt, parked.last_seq) == (JobState.QUEUED, 0, 2)
    assert (parked.waiting_code, parked.waiting_reason) == ("NO_LIVE_WORKER", reason)
    # An operator's re-dispatch (dlq replay) sends it again: it waits for
    # no worker now, whatever happens next.
    replayed = await SweepStore(engine).redispatch(stack.tenant_id, uuid.UUID(job.id), "r")
    assert replayed is not None and (replayed.waiting_code, replayed.waiting_reason) == ("", "")
    status, _ = await attempts.hand_back(
        await stack.envelope(job.id), base_delay=0.01, max_delay=0.1
    )
    assert status is HandBack.PARKED
    # The old message is stale now: a second copy changes nothing.
    again = await attempts.hand_back(envelope, base_delay=0.01, max_delay=0.1)
    assert again == (HandBack.NOT_QUEUED, "")
    assert (await attempts.claim(envelope)).status is ClaimStatus.STALE

    # A worker of another queue, a stopped one and an expired one do not count.
    for queues, ttl in (([f"{queue}.other"], 60.0), ([queue], -1.0)):
        await workers.register(
            uuid.uuid4(),
            host="h",
            pid=1,
            types=["reports.render"],
            queues=queues,
            concurrency=1,
            version="t",
            ttl=ttl,
        )
    stopped = uuid.uuid4()
    await workers.register(
        stopped,
        host="h",
        pid=2,
        types=["reports.render"],
        queues=[queue],
        concurrency=1,
        version="t",
        ttl=60,
    )
    await workers.stop(stopped)
    assert await attempts.unpark(["demo.echo"], [queue]) == 0
    second = await client.submit("reports.render", {"n": 2})
    status, _ = await attempts.hand_back(
        await stack.envelope(second.id), base_delay=0.01, max_delay=0.1
    )
    assert status is HandBack.PARKED

    # A live one handling it: both parked jobs are dispatched again...
    live = uuid.uuid4()
    await workers.register(
        live,
        host="h",
        pid=3,
        types=["reports.render", "demo.echo"],
        queues=[queue],
        concurrency=4,
        version="t",
        ttl=60,
    )
    assert await attempts.unpark(["reports.render"], [queue]) == 2
    assert await attempts.unpark(["reports.render"], [queue]) == 0
    redispatched = await stack.envelope(job.id)
    assert redispatched.event_id != envelope.event_id
    # ...and a hand-back now gives the job to the outbox for that worker,
    # due later, without an event or an attempt.
    before = await client.get(job.name)
    status, reason = await attempts.hand_back(redispatched, base_delay=5, max_delay=10)
    assert status is HandBack.HANDED_BACK
    assert "handed back 1 times" in reason
    after = await client.get(job.name)
    assert (after.state, after.attempt, after.last_seq) == (
        JobState.QUEUED,
        0,
        before.last_seq,
    )
    assert (after.waiting_code, after.waiting_reason) == ("HANDED_BACK", reason)
    handed = await stack.envelope(job.id)
    delay = await stack.scalar(
        "SELECT extract(epoch FROM o.available_at - j.update_time) FROM outbox o "
        "JOIN jobs j ON j.dispatch_id = o.id WHERE o.id = :id",
        id=handed.event_id,
    )
    assert 2.5 <= float(delay) <= 7.5  # 5 s, jittered by ±50 %
    # The claim of the new dispatch starts a normal first attempt.
    claim = await attempts.claim(handed)
    assert claim.status is ClaimStatus.CLAIMED and claim.attempt is not None
    assert claim.attempt.attempt == 1
    claimed = await client.get(job.name)
    assert (claimed.waiting_code, claimed.waiting_reason) == ("", "")

    missing = Envelope(uuid.uuid4(), uuid.uuid4(), stack.tenant_id, "reports.render")
    assert (await attempts.hand_back(missing, base_delay=0, max_delay=0))[0] is HandBack.NOT_FOUND
    listed = {w.id: w.status for w in await workers.list()}
    assert listed[live] == "live" and listed[stopped] == "stopped"
    assert sorted(listed.values()) == ["live", "live", "lost", "stopped"]


async def test_jobplane_workers_lists_live_and_stopped_workers(stack: Stack) -> None:
    second = await stack.start_worker(reports)
    assert stack.workers[0] is not second

    async def workers_json() -> list[dict[str, Any]]:
        env = {**os.environ, "JOBPLANE_DATABASE_URL": stack.database_url}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jobplane",
            "workers",
            "--json",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, err
        return [json.loads(line) for line in out.decode().splitlines()]

    listed = {w["id"]: w for w in await workers_json()}
    assert set(listed) == {w.id for w in stack.workers}
    assert listed[second.id]["types"] == ["reports.render"]
    assert listed[stack.workers[0].id]["types"] == ["demo.echo", "demo.fail", "demo.progress"]
    for worker in listed.values():
        assert worker["status"] == "live"
        assert worker["pid"] == os.getpid()
        assert worker["queues"] == [stack.topology.queues[0].name]

    await second.stop(grace=1)
    listed = {w["id"]: w for w in await workers_json()}
    assert listed[second.id]["status"] == "stopped"
    assert listed[stack.workers[0].id]["status"] == "live"


async def test_the_worker_command_imports_handlers_from_the_current_directory(
    stack: Stack, tmp_path: Path
) -> None:
    from tests.faults.cluster import topology_toml

    (tmp_path / "cwdjobs.py").write_text(
        "from jobplane.workers import Registry\n"
        "registry = Registry()\n\n"
        "@registry.handler('cwd.job')\n"
        "async def job(ctx):\n"
        "    return {'from': 'cwd'}\n"
    )
    topology = tmp_path / "topology.toml"
    topology.write_text(topology_toml(stack.topology))
    env = {
        **os.environ,
        "JOBPLANE_DATABASE_URL": stack.database_url,
        "JOBPLANE_AMQP_URL": stack.amqp_url,
        "JOBPLANE_TOPOLOGY": str(topology),
        "JOBPLANE_LOG_LEVEL": "warning",
    }
    # The console script, as a user runs it: its own directory is first on
    # sys.path, not the current one (python -m would hide the difference).
    script = Path(sys.executable).parent / "jobplane"
    process = await asyncio.create_subprocess_exec(
        str(script),
        "worker",
        "--handlers",
        "cwdjobs:registry",
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        client = stack.client()
        job = await client.submit("cwd.job", {})
        done = await asyncio.wait_for(client.wait(job.name), 60)
        assert done.state is JobState.SUCCEEDED
        assert done.result == {"from": "cwd"}
        live = await WorkerStore(stack.engine).list()
        # The command's worker: the loaded handlers besides the built-in maintenance ones.
        [external] = [w for w in live if "cwd.job" in w.types]
        assert set(external.types) == {"cwd.job", "maintenance.retention", "maintenance.erasure"}
        assert external.status == "live" and external.pid == process.pid
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        _out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    [external] = [w for w in await WorkerStore(stack.engine).list() if "cwd.job" in w.types]
    assert external.status == "stopped"
