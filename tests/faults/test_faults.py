"""Faults injected into real processes and services; each run is judged by L, D and O.

See tests/faults/cluster.py for what L, D and O check.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import signal
import subprocess
import uuid
from urllib.parse import urlsplit

import aio_pika
import asyncpg

from jobplane.client import AsyncClient, JobEvent, JobState
from jobplane.envelope import Envelope
from jobplane.store.engine import asyncpg_dsn
from tests.faults.chaos import Supervisor
from tests.faults.cluster import Cluster, Proc, check_stream
from tests.support.proxy import CuttableProxy


async def _watch(client: AsyncClient, name: str, into: dict[str, list[JobEvent]]) -> None:
    into[name] = [event async for event in client.watch(name)]


async def _watch_sample(
    cluster: Cluster, client: AsyncClient, names: list[str], k: int = 10
) -> tuple[dict[str, list[JobEvent]], list[asyncio.Task[None]]]:
    seen: dict[str, list[JobEvent]] = {}
    tasks = [asyncio.create_task(_watch(client, n, seen)) for n in names[:k]]
    return seen, tasks


async def _check_watchers(
    client: AsyncClient, seen: dict[str, list[JobEvent]], tasks: list[asyncio.Task[None]]
) -> None:
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
    for name, events in seen.items():  # O
        check_stream(events, (await client.get(name)).last_seq)


async def _keep_alive(procs: list[Proc], stop: asyncio.Event) -> None:
    """A supervisor: restart any worker that died."""
    while not stop.is_set():
        for proc in procs:
            if not proc.alive:
                # Killed again while starting: the next round restarts it.
                with contextlib.suppress(AssertionError):
                    await proc.start(ready="worker.started")
        await asyncio.sleep(0.1)


async def kill_workers_until_done(
    cluster: Cluster, workers: list[Proc], names: list[str], *, kills: int = 4, timeout: float
) -> None:
    """SIGKILL a random worker ``kills`` times, restarting each, until every job has ended."""
    stop = asyncio.Event()
    supervisor = asyncio.create_task(_keep_alive(workers, stop))
    for _ in range(kills):
        await asyncio.sleep(random.uniform(0.6, 1.2))
        random.choice([w for w in workers if w.alive] or workers).kill()
    await cluster.wait_all_terminal(names, timeout=timeout)
    stop.set()
    await supervisor


async def test_sigkill_workers_mid_handler_during_a_200_job_run(cluster: Cluster) -> None:
    await cluster.server()
    await cluster.relay()
    workers = [await cluster.worker("--concurrency", "8") for _ in range(2)]
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 200, ms=300)
        seen, tasks = await _watch_sample(cluster, client, names)
        await kill_workers_until_done(cluster, workers, names, timeout=90)
        counts = await cluster.check(names)
        await _check_watchers(client, seen, tasks)
    assert counts["jobs"] == 200
    assert sum(w.starts for w in workers) >= 5  # the kills happened


async def _each_ran_once(cluster: Cluster, jobs: int) -> None:
    rows = await cluster.query(
        "SELECT job_id, count(*) AS runs FROM fault_completions GROUP BY job_id"
    )
    assert len(rows) == jobs
    assert {r["runs"] for r in rows} == {1}


async def test_sigkill_after_outcome_commit_before_ack(cluster: Cluster) -> None:
    await cluster.server()
    await cluster.relay()
    crashing = await cluster.worker("--concurrency", "1", faults="crash:worker.after_outcome@3")
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 10, ms=20)
        exit_code = await crashing.wait(timeout=60)
        assert exit_code == 137  # it died between the commit and the ack
        await cluster.worker("--concurrency", "4")
        await cluster.wait_all_terminal(names)
        await cluster.check(names)
        # The redelivered message of the crashed job was acked without a run.
        await _each_ran_once(cluster, 10)


async def test_sigkill_after_a_group_commit_before_its_acks(cluster: Cluster) -> None:
    await cluster.server()
    await cluster.relay()
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 16, ms=300)
        # All dispatched before a worker starts: its first deliveries come at
        # once, are claimed together, and end together.
        for _ in range(300):
            rows = await cluster.query(
                "SELECT count(*) AS n FROM outbox "
                "WHERE kind = 'job.dispatch' AND published_at IS NULL"
            )
            if rows[0]["n"] == 0:
                break
            await asyncio.sleep(0.1)
        crashing = await cluster.worker(
            "--concurrency",
            "8",
            "--group-window",
            "200",
            faults="crash:worker.after_group_commit@1",
        )
        assert await crashing.wait(timeout=60) == 137
        # The group that committed held several jobs, and none was acked.
        ended = {
            r["id"] for r in await cluster.query("SELECT id FROM jobs WHERE end_time IS NOT NULL")
        }
        assert len(ended) >= 2
        await cluster.worker("--concurrency", "8")
        await cluster.wait_all_terminal(names)
        await cluster.check(names)
        # Their redelivered messages were acked without a run. (A job whose
        # handler had returned, its outcome waiting for the next group when
        # the process died, runs again: it was never committed.)
        rows = await cluster.query(
            "SELECT job_id, count(*) AS runs FROM fault_completions GROUP BY job_id"
        )
        assert len(rows) == 16
        assert {r["runs"] for r in rows if r["job_id"] in ended} == {1}


async def test_sigkill_relay_between_confirm_and_mark(cluster: Cluster) -> None:
    await cluster.server()
    relay = await cluster.relay(faults="crash:relay.after_confirm@1")
    await cluster.worker("--concurrency", "4")
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 5, ms=20)
        assert await relay.wait(timeout=30) == 137
        # Published and confirmed, yet still unpublished in the table.
        rows = await cluster.query(
            "SELECT count(*) AS n FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
        )
        assert rows[0]["n"] >= 1
        await cluster.relay()  # publishes them again: duplicates of delivered messages
        await cluster.wait_all_terminal(names)
        await cluster.check(names)
        rows = await cluster.query(
            "SELECT count(*) AS n FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
        )
        assert rows[0]["n"] == 0
        runs = await cluster.query("SELECT count(*) AS n FROM fault_completions")
        assert runs[0]["n"] == 5


def _rabbitmqctl(*args: str) -> str:
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    return subprocess.run(
        [ctl, "-q", *args], check=True, capture_output=True, text=True, timeout=60
    ).stdout


async def test_broker_connections_closed_under_load(cluster: Cluster) -> None:
    vhost = urlsplit(cluster.amqp_url).path.lstrip("/")
    await cluster.server()
    await cluster.relay()
    for _ in range(2):
        await cluster.worker("--concurrency", "8")
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 60, ms=200)
        seen, tasks = await _watch_sample(cluster, client, names)
        await asyncio.sleep(0.5)
        listing = await asyncio.to_thread(_rabbitmqctl, "list_connections", "vhost", "pid")
        pids = [line.split()[1] for line in listing.splitlines() if line.split()[:1] == [vhost]]
        assert pids, listing
        for pid in pids:
            await asyncio.to_thread(_rabbitmqctl, "close_connection", pid, "fault test")
        more = await cluster.submit_many(client, 40, ms=100)
        await cluster.wait_all_terminal(names + more, timeout=90)
        await cluster.check(names + more)
        await _check_watchers(client, seen, tasks)


async def test_postgres_backends_terminated_under_load(cluster: Cluster) -> None:
    await cluster.server()
    await cluster.relay()
    for _ in range(2):
        await cluster.worker("--concurrency", "8")
    database = urlsplit(cluster.database_url).path.lstrip("/")
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 60, ms=300)
        seen, tasks = await _watch_sample(cluster, client, names)
        admin = await asyncpg.connect(asyncpg_dsn(cluster.database_url))
        try:
            for _ in range(2):
                await asyncio.sleep(0.7)
                killed = await admin.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = $1 AND pid <> pg_backend_pid()",
                    database,
                )
                assert killed > 0
        finally:
            await admin.close()
        more = await cluster.submit_many(client, 20, ms=50)
        await cluster.wait_all_terminal(names + more, timeout=90)
        await cluster.check(names + more)
        await _check_watchers(client, seen, tasks)


async def test_poison_job_is_bounded_and_others_keep_flowing(cluster: Cluster) -> None:
    await cluster.server()
    await cluster.relay()
    workers = [await cluster.worker("--concurrency", "4", lease=1.5) for _ in range(2)]
    stop = asyncio.Event()
    supervisor = asyncio.create_task(_keep_alive(workers, stop))
    try:
        async with cluster.client() as client:
            poison = await client.submit("fault.poison", {}, max_attempts=2)
            names = await cluster.submit_many(client, 30, ms=50)
            await cluster.wait_all_terminal([poison.name], timeout=60)
            await cluster.wait_all_terminal(names, timeout=60)
            await cluster.check(names)
            done = await client.get(poison.name)
            assert done.state is JobState.FAILED
            assert done.attempt == 2  # bounded by max_attempts, counted in Postgres
            deaths = sum(w.starts for w in workers) - len(workers)
            assert 1 <= deaths <= 3, f"{deaths} worker deaths: a hot loop"
            await asyncio.sleep(2)  # no further deaths once the job has FAILED
            assert sum(w.starts for w in workers) - len(workers) == deaths
    finally:
        stop.set()
        await supervisor


async def test_duplicated_and_reordered_messages(cluster: Cluster) -> None:
    await cluster.server()
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 20, ms=20)
        rows = await cluster.query(
            "SELECT id, tenant_id, dispatch_id, type FROM jobs WHERE id = ANY($1::uuid[])",
            [uuid.UUID(n.partition("/")[2]) for n in names],
        )
        envelopes = [
            Envelope(r["dispatch_id"], r["id"], r["tenant_id"], r["type"]) for r in rows
        ] * 2
        random.shuffle(envelopes)
        connection = await aio_pika.connect(cluster.amqp_url)
        async with connection:
            channel = await connection.channel()
            from jobplane.topology import declare

            exchange = await declare(channel, cluster.topology)
            for envelope in envelopes:
                await exchange.publish(
                    aio_pika.Message(envelope.encode(), message_id=str(envelope.event_id)),
                    routing_key=envelope.job_type,
                )
        await cluster.worker("--concurrency", "8")
        await cluster.relay()  # and a third copy of each, through the outbox
        await cluster.wait_all_terminal(names)
        await cluster.check(names)
        runs = await cluster.query(
            "SELECT job_id, count(*) AS n FROM fault_completions GROUP BY job_id"
        )
        assert len(runs) == 20 and {r["n"] for r in runs} == {1}


async def test_lease_expires_while_a_stalled_attempt_still_runs(cluster: Cluster) -> None:
    await cluster.server()
    await cluster.relay()
    stalled = await cluster.worker("--concurrency", "1", lease=1.0)
    async with cluster.client() as client:
        job = await client.submit("fault.stall", {"seconds": 4})
        seen: dict[str, list[JobEvent]] = {}
        watcher = asyncio.create_task(_watch(client, job.name, seen))
        # Attempt 1 blocks its worker; once its lease lapses the sweeper
        # re-dispatches and a healthy worker wins with attempt 2.
        await stalled.wait_for_log("job.received")
        await cluster.worker("--concurrency", "1", lease=1.0)
        done = await asyncio.wait_for(client.wait(job.name), timeout=30)
        assert done.state is JobState.SUCCEEDED
        assert done.result == {"attempt": 2}
        # The stalled attempt wakes and is fenced: its heartbeat finds the
        # lease gone (and cancels the handler) or its outcome write is refused.
        await stalled.wait_for_any(("job.lease_lost", "job.outcome.fenced_out"), timeout=30)
        await asyncio.sleep(0.5)
        after = await client.get(job.name)
        assert after.result == {"attempt": 2}
        assert after.last_seq == done.last_seq
        await cluster.check([job.name], strict=False)
        await asyncio.wait_for(watcher, timeout=10)
        check_stream(seen[job.name], after.last_seq)


async def test_a_killed_workers_job_runs_again_once_the_sweeper_expires_its_lease(
    cluster: Cluster,
) -> None:
    await cluster.server()
    await cluster.relay()
    doomed = await cluster.worker("--concurrency", "1", lease=1.0)
    async with cluster.client() as client:
        job = await client.submit("fault.work", {"ms": 3000})
        seen: dict[str, list[JobEvent]] = {}
        watcher = asyncio.create_task(_watch(client, job.name, seen))
        await doomed.wait_for_log("job.received")
        doomed.kill()
        # No worker runs now: only the relay's sweeper can find the dead
        # attempt's lease run out and queue the job again.
        for _ in range(300):
            if (await client.get(job.name)).state is JobState.QUEUED:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"the lease of {job.name} never expired")
        await cluster.worker("--concurrency", "1", lease=1.0)
        done = await asyncio.wait_for(client.wait(job.name), timeout=30)
        assert done.state is JobState.SUCCEEDED
        assert done.result == {"attempt": 2}
        await cluster.check([job.name])
        await asyncio.wait_for(watcher, timeout=10)
        check_stream(seen[job.name], done.last_seq)


#: Submit commits the server survives before each of its deaths.
SERVER_SURVIVES = 5
SERVER_KILLS = 3


async def test_sigkill_server_between_submit_commit_and_reply(cluster: Cluster) -> None:
    # Each life of the server dies right after a submit's transaction commits,
    # before any reply: the callers repeat with the same request_ids and must
    # get the jobs committed, never a second job.
    armed = f"crash:submit.after_commit@{SERVER_SURVIVES}"
    server = await cluster.server(faults=armed)
    async with Supervisor([server], faults=lambda p: armed if p.starts < SERVER_KILLS else ""):
        await cluster.relay()
        await cluster.worker("--concurrency", "8")
        async with cluster.client() as client:
            batches = await asyncio.gather(
                *(cluster.submit_many(client, 30, ms=50) for _ in range(4))
            )
            names = [name for batch in batches for name in batch]
            await cluster.wait_all_terminal(names, timeout=90)
            await cluster.check(names)
    assert server.starts == SERVER_KILLS + 1  # every armed life died
    assert len(set(names)) == 120
    rows = await cluster.query("SELECT count(*) AS n, count(DISTINCT request_id) AS ids FROM jobs")
    assert (rows[0]["n"], rows[0]["ids"]) == (120, 120)


async def test_watcher_connection_drop_resumes_without_gap_or_repeat(cluster: Cluster) -> None:
    await cluster.server()
    await cluster.relay()
    await cluster.worker("--concurrency", "4")
    proxy = CuttableProxy("127.0.0.1", cluster.port)
    await proxy.start()
    try:
        async with (
            cluster.client() as client,
            AsyncClient(f"127.0.0.1:{proxy.port}", cluster.key) as proxied,
        ):
            names = [
                (await client.submit("fault.work", {"ms": 3000, "i": i})).name for i in range(3)
            ]
            seen: dict[str, list[JobEvent]] = {}
            tasks = [asyncio.create_task(_watch(proxied, n, seen)) for n in names]
            await asyncio.sleep(1.0)
            for _ in range(2):
                await proxy.cut()  # every stream drops mid-way
                await asyncio.sleep(0.5)
                await proxy.start()
                await asyncio.sleep(0.7)
            await _check_watchers(client, seen, tasks)
            await cluster.check(names)
    finally:
        with contextlib.suppress(Exception):
            await proxy.cut()


async def test_sigterm_drains_a_worker_and_its_job_runs_elsewhere(cluster: Cluster) -> None:
    server = await cluster.server()
    await cluster.relay()
    first = await cluster.worker("--concurrency", "2")
    async with cluster.client() as client:
        job = await client.submit("fault.work", {"ms": 20000}, max_attempts=1)
        await first.wait_for_log("job.received")
        first.kill(signal.SIGTERM)
        assert await first.wait(timeout=30) == 0  # a clean exit after its grace period
        interrupted = await client.get(job.name)
        assert interrupted.state is JobState.QUEUED
        assert interrupted.error is not None and interrupted.error.code == "WORKER_SHUTDOWN"

        await cluster.worker("--concurrency", "2")
        short = await client.submit("fault.work", {"ms": 20})
        await cluster.wait_all_terminal([short.name])
        await cluster.check([short.name])
        for _ in range(100):  # it runs again despite max_attempts=1: the attempt was refunded
            if (await client.get(job.name)).state is JobState.RUNNING:
                break
            await asyncio.sleep(0.1)
        await client.cancel(job.name)
        done = await client.wait(job.name, timeout=10)
        assert done.state is JobState.CANCELLED
        assert done.attempt == 2

    server.kill(signal.SIGTERM)
    assert await server.wait(timeout=30) == 0
