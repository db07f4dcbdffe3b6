"""The soak run (`make soak`, not part of `make test`).

5,000 jobs through two relays and three workers, 500 three-stage pipelines
besides (judged per stage), 200 fan-out jobs of five children each (half of
them tolerating failures, one child of each of those failing; judged per node:
the job, each child, the join), and 1,500 domain events alongside them (by
PublishEvent and in callers' transactions) to an inbox Consumer process, a
tap queue and a resuming SubscribeEvents stream. A random worker, relay or
the consumer is SIGKILLed every few seconds and restarted, and the RabbitMQ
application is restarted once. Prints the L/D/O
counts of the jobs, of the fan-out jobs and the P/A/O counts of the events
(tests/faults/event_path.py); fails on any violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import subprocess
import time
from dataclasses import replace

import pytest

from jobplane.client import JobEvent
from jobplane.topology import Topology
from tests.faults.cluster import FAN_PIPELINE, FAN_TOLERANT, PIPELINE, Cluster, Proc
from tests.faults.event_path import event_path
from tests.faults.fan_judge import judge_fan_outs

JOBS = int(os.environ.get("JOBPLANE_SOAK_JOBS", "5000"))
# Per batch of 100 jobs: events by PublishEvent, and in callers' transactions.
RPC_EVENTS, SQL_EVENTS = 20, 10
# Per batch of 100 jobs: pipelines of three stages, besides.
PIPELINES = int(os.environ.get("JOBPLANE_SOAK_PIPELINES", "10"))
# Per batch of 100 jobs: fan-out jobs (split → map → join) of FAN_ITEMS children,
# every second one tolerating failures with one child that fails.
FAN_OUTS = int(os.environ.get("JOBPLANE_SOAK_FAN_OUTS", "4"))
FAN_ITEMS = 5
# 0 leaves the broker alone (a RabbitMQ shared with other runs).
RESTART_BROKER = os.environ.get("JOBPLANE_SOAK_BROKER_RESTART", "1") != "0"
KILL_EVERY = (2.0, 5.0)


@pytest.fixture
def topology(topology: Topology) -> Topology:
    """Every lifecycle event published: the judge counts the tap's copies of every event."""
    return replace(topology, publish_lifecycle=("job.#",))


def _restart_broker() -> None:
    ctl = shutil.which("rabbitmqctl") or "/usr/sbin/rabbitmqctl"
    subprocess.run([ctl, "-q", "stop_app"], check=True, timeout=120)
    subprocess.run([ctl, "-q", "start_app"], check=True, timeout=120)
    subprocess.run([ctl, "-q", "await_startup"], check=True, timeout=120)


async def _chaos(procs: dict[Proc, str], stop: asyncio.Event, kills: dict[str, int]) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), random.uniform(*KILL_EVERY))
        if stop.is_set():
            return
        # Workers most often; now and then a relay or the event consumer.
        alive = [p for p in procs if p.alive]
        weights = [6 if procs[p] == "worker.started" else 1 for p in alive]
        if alive:
            victim = random.choices(alive, weights)[0]
            victim.kill()
            kind = victim.args[0] if victim.module == "jobplane" else "consumer"
            kills[kind] = kills.get(kind, 0) + 1


async def _supervise(procs: dict[Proc, str], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for proc, ready in procs.items():
            if not proc.alive:
                with contextlib.suppress(AssertionError):
                    await proc.start(ready=ready)
        await asyncio.sleep(0.2)


@pytest.mark.soak
@pytest.mark.timeout(3600)
async def test_soak(mixed: Cluster) -> None:
    cluster = mixed
    await cluster.server()
    events = await event_path(cluster)
    await events.start()  # before the relays: the tap and the consumer see every event
    procs = {await cluster.relay(): "relay.connected" for _ in range(2)}
    for _ in range(3):
        procs[await cluster.worker("--concurrency", "16")] = "worker.started"
    assert events.consumer is not None
    procs[events.consumer] = "events.consumer.started"
    stop = asyncio.Event()
    kills: dict[str, int] = {}
    chaos = asyncio.create_task(_chaos(procs, stop, kills))
    supervisor = asyncio.create_task(_supervise(procs, stop))
    started = time.monotonic()
    async with cluster.client() as client:
        names: list[str] = []
        pipelines: list[str] = []
        fans: list[str] = []
        tolerant: list[str] = []
        seen: dict[str, list[JobEvent]] = {}

        async def watch(name: str) -> None:
            seen[name] = [e async for e in client.watch(name)]

        watchers = []
        for batch in range(JOBS // 100):
            # A SIGKILL mid-run spends an attempt (about 3 % of jobs need a
            # second, 0.1 % a third here): with the default 3 a run would now
            # and then fail a job by exhausting them, which is the rule working,
            # not a loss. The soak judges loss, so it allows more.
            fan_ms, failing = random.randint(20, 200), random.randrange(FAN_ITEMS)
            submitted, staged_jobs, fanned, tolerating, _, _ = await asyncio.gather(
                cluster.submit_many(client, 100, max_attempts=10, ms=random.randint(20, 400)),
                cluster.submit_many(client, PIPELINES, PIPELINE, ms=random.randint(20, 200)),
                cluster.submit_many(
                    client, FAN_OUTS - FAN_OUTS // 2, FAN_PIPELINE, n=FAN_ITEMS, ms=fan_ms
                ),
                cluster.submit_many(
                    client, FAN_OUTS // 2, FAN_TOLERANT, n=FAN_ITEMS, ms=fan_ms, fail=[failing]
                ),
                events.publish_rpc(RPC_EVENTS),
                events.publish_in_transactions(SQL_EVENTS),
            )
            names += submitted
            pipelines += staged_jobs
            fans += fanned
            tolerant += tolerating
            if batch % 5 == 0:
                watchers.append(asyncio.create_task(watch(names[-1])))
            if batch == JOBS // 200 and RESTART_BROKER:
                await asyncio.to_thread(_restart_broker)
        await cluster.wait_all_terminal(names + pipelines + fans + tolerant, timeout=1800)
        stop.set()
        await asyncio.gather(chaos, supervisor)
        # Every process alive again (the last kill may have just landed).
        for proc, ready in procs.items():
            if not proc.alive:
                await proc.start(ready=ready)
        await events.settle(timeout=600)
        event_counts, event_problems = await events.judge()
        await events.close()
        await asyncio.wait_for(asyncio.gather(*watchers), timeout=120)
        counts, problems = await cluster.judge(names)
        staged_counts, staged_problems = await cluster.judge_pipelines(pipelines)
        problems += staged_problems
        fan_counts, fan_problems = await judge_fan_outs(cluster, fans, FAN_ITEMS)
        tolerant_counts, tolerant_problems = await judge_fan_outs(
            cluster, tolerant, FAN_ITEMS, failing=1
        )
        fan_problems += tolerant_problems
        order = 0
        for name, stream in seen.items():
            last = (await client.get(name)).last_seq
            if [e.seq for e in stream] != list(range(1, last + 1)) or not stream[-1].terminal:
                order += 1
        attempts = {
            r["attempt"]: r["n"]
            for r in await cluster.query(
                "SELECT attempt, count(*) AS n FROM jobs GROUP BY attempt ORDER BY attempt"
            )
        }
    elapsed = time.monotonic() - started
    by_kind = {kind: sum(p.startswith(kind) for p in problems) for kind in ("L", "D", "O")}
    by_kind["O"] += order
    by_event = {kind: sum(p.startswith(kind) for p in event_problems) for kind in ("P", "A", "O")}
    by_fan = {kind: sum(p.startswith(kind) for p in fan_problems) for kind in ("L", "D", "O")}
    print(
        f"\nsoak: {counts['jobs']} jobs, {staged_counts['jobs']} pipelines "
        f"({staged_counts['stages']} stages) and {event_counts['events']} events in "
        f"{elapsed:.0f}s, "
        f"kills {kills}, {int(RESTART_BROKER)} broker restart, {len(seen)} watchers; "
        f"jobs by attempts used: {attempts}\n"
        f"events: {event_counts}\n"
        f"fan-out: {fan_counts['jobs'] + tolerant_counts['jobs']} jobs "
        f"({tolerant_counts['jobs']} tolerating a failure), "
        f"{fan_counts['children'] + tolerant_counts['children']} children "
        f"({tolerant_counts['failed']} failing as meant); violations "
        f"L={by_fan['L']} D={by_fan['D']} O={by_fan['O']}\n"
        f"violations: jobs L={by_kind['L']} D={by_kind['D']} O={by_kind['O']}; "
        f"events P={by_event['P']} A={by_event['A']} O={by_event['O']}"
    )
    assert by_kind == {"L": 0, "D": 0, "O": 0}, "\n".join(problems[:20])
    assert by_event == {"P": 0, "A": 0, "O": 0}, "\n".join(event_problems[:20])
    assert by_fan == {"L": 0, "D": 0, "O": 0}, "\n".join(fan_problems[:20])
