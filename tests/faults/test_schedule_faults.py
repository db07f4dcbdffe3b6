"""Schedulers killed mid-tick, relays mid-dispatch, keyed jobs under dying workers.

Each `jobplane relay` process runs a sweeper and its scheduler (ADR-0041).
Relays are SIGKILLed at random moments and at the scheduler's named points
(``crash:schedule.before_commit``: a tick claimed and its runs written, not
committed; ``crash:schedule.after_commit``: committed, the pass not gone on).
The jobs table then shows each tick run at most once and none lost that the
catch-up policy promises, the schedules' counts agreeing, the next tick
moved on. Keyed jobs (docs/flow-control.md) are sampled while their workers
and relays die: never more than a key's limit RUNNING at once.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import pairwise
from typing import Any

import asyncpg

from jobplane.client import AsyncClient, CatchUp, Overlap
from jobplane.schedule_spec import DEFAULT_CATCH_UP_LIMIT
from jobplane.schedule_types import SCHEDULE_LABEL
from tests.faults.chaos import Peaks, Supervisor, kill_at_random, most_at_once, running_spans
from tests.faults.cluster import Cluster, Proc

INTERVAL = timedelta(seconds=1)


@dataclass(frozen=True)
class Kind:
    """A schedule of the test: its policies and how long its runs take."""

    catch_up: CatchUp
    overlap: Overlap
    limit: int = 0
    ms: int = 20


_POLICIES = {
    "all-allow": Kind(CatchUp.ALL, Overlap.ALLOW_ALL, limit=3),
    "one-allow": Kind(CatchUp.ONE, Overlap.ALLOW_ALL),
    "skip-allow": Kind(CatchUp.SKIP, Overlap.ALLOW_ALL),
    "all-skip": Kind(CatchUp.ALL, Overlap.SKIP, limit=3, ms=1500),
    "one-buffer": Kind(CatchUp.ONE, Overlap.BUFFER_ONE, ms=1500),
    "all-cancel": Kind(CatchUp.ALL, Overlap.CANCEL_OTHER, limit=3, ms=1500),
}
#: The schedules of the random kills: three of each policy, so that the
#: schedulers' passes take a while and overlap (each would tick the others'
#: schedules, were it not for the lock).
KINDS = {f"{name}-{n}": kind for name, kind in _POLICIES.items() for n in range(3)}


@dataclass(frozen=True)
class Run:
    """A job a schedule started."""

    id: uuid.UUID
    tick: datetime
    state: str
    created: datetime  # its transaction's start: one per tick transaction
    cancel_requested: bool


async def _create(client: AsyncClient, schedule_id: str, kind: Kind) -> None:
    await client.create_schedule(
        "fault.work",
        {"ms": kind.ms},
        interval=INTERVAL,
        catch_up=kind.catch_up,
        catch_up_limit=kind.limit,
        overlap=kind.overlap,
        max_attempts=10,
        schedule_id=schedule_id,
    )


async def _schedule(cluster: Cluster, schedule_id: str) -> asyncpg.Record:
    (row,) = await cluster.query(
        "SELECT anchor_time, next_tick, runs, recent_runs, buffered_tick FROM schedules "
        "WHERE id = $1",
        schedule_id,
    )
    return row


async def _runs(cluster: Cluster, schedule_id: str) -> list[Run]:
    """The schedule's jobs, by tick (the tick is the end of the job's request_id)."""
    rows = await cluster.query(
        "SELECT id, request_id, state, create_time, cancel_requested_at FROM jobs "
        "WHERE labels->>$1 = $2",
        SCHEDULE_LABEL,
        f"schedules/{schedule_id}",
    )
    runs = [
        Run(
            r["id"],
            datetime.fromisoformat(r["request_id"].rsplit("/", 1)[1]),
            r["state"],
            r["create_time"],
            r["cancel_requested_at"] is not None,
        )
        for r in rows
    ]
    return sorted(runs, key=lambda run: run.tick)


def _by_transaction(runs: list[Run]) -> list[list[datetime]]:
    """The runs' ticks, a list per tick transaction, in the order they ran."""
    groups: dict[datetime, list[datetime]] = defaultdict(list)
    for run in runs:
        groups[run.created].append(run.tick)
    return [sorted(groups[created]) for created in sorted(groups)]


def judge_ticks(
    schedule_id: str, kind: Kind, first: datetime, schedule: Any, runs: list[Run]
) -> list[str]:
    """Every way the runs break one job per tick, or the policies' promises."""
    where = f"schedules/{schedule_id}"
    ticks = [run.tick for run in runs]
    problems = []
    if not runs:
        return [f"{where}: no run at all"]
    if schedule["runs"] != len(runs):  # a tick submitted twice counts twice
        problems.append(f"{where}: counts {schedule['runs']} runs of {len(runs)} jobs")
    if list(schedule["recent_runs"]) != [run.id for run in reversed(runs)][:10]:
        problems.append(f"{where}: newest runs {schedule['recent_runs']} are not its newest jobs")
    off = [t for t in ticks if t < first or (t - schedule["anchor_time"]) % INTERVAL]
    if off:
        problems.append(f"{where}: ticks off its grid: {off[:3]}")
    groups = _by_transaction(runs)
    if [t for group in groups for t in group] != ticks:
        problems.append(f"{where}: a tick ran after a newer one: {groups}")
    previous: datetime | None = None
    bound = kind.limit or DEFAULT_CATCH_UP_LIMIT
    for group in groups:
        if any(b - a != INTERVAL for a, b in pairwise(group)):
            problems.append(f"{where}: one transaction ran ticks that are not consecutive")
        if kind.catch_up is not CatchUp.ALL and len(group) > 1:
            problems.append(f"{where}: catching up {kind.catch_up} ran {len(group)} at once")
        if len(group) > bound:
            problems.append(f"{where}: {len(group)} runs at once, past the bound {bound}")
        expected = first if previous is None else previous + INTERVAL
        # ALL and ALLOW_ALL run every due tick, or the newest `bound` of them.
        lost = group[0] != expected and len(group) != bound
        if kind.catch_up is CatchUp.ALL and kind.overlap is Overlap.ALLOW_ALL and lost:
            problems.append(f"{where}: ticks {expected} to {group[0]} lost ({len(group)} ran)")
        previous = group[-1]
    if schedule["next_tick"] is None or schedule["next_tick"] <= ticks[-1]:
        problems.append(f"{where}: next tick {schedule['next_tick']}, newest run {ticks[-1]}")
    return problems


def _judge_overlap(schedule_id: str, kind: Kind, runs: list[Run], peak: int) -> list[str]:
    """SKIP and BUFFER_ONE: one run going at a time; CANCEL_OTHER: each older run ended
    or was asked to stop."""
    where = f"schedules/{schedule_id}"
    if kind.overlap in (Overlap.SKIP, Overlap.BUFFER_ONE) and peak > 1:
        return [f"{where}: {peak} runs QUEUED or RUNNING at once under {kind.overlap}"]
    if kind.overlap is Overlap.CANCEL_OTHER:
        ended = ("cancelled", "succeeded")
        left = [r for r in runs[:-1] if r.state not in ended and not r.cancel_requested]
        if left:
            return [f"{where}: older runs neither ended nor asked to stop: {left[:3]}"]
    return []


# The runs going (QUEUED or RUNNING) per schedule, in one snapshot.
_GOING = f"""
SELECT labels->>'{SCHEDULE_LABEL}' AS "group", count(*) AS n FROM jobs
WHERE state IN ('queued', 'running') AND labels ? '{SCHEDULE_LABEL}' GROUP BY 1
"""


def _tick_faults(rng: random.Random) -> Callable[[Proc], str]:
    """Each restart: no point, or a crash at the n-th tick's commit, before or after it."""

    def choose(_: Proc) -> str:
        point = rng.choice(["", "", "schedule.before_commit", "schedule.after_commit"])
        return f"crash:{point}@{rng.randint(1, 8)}" if point else ""

    return choose


async def _now(cluster: Cluster) -> datetime:
    (row,) = await cluster.query("SELECT now() AS now")
    moment: datetime = row["now"]
    return moment


async def _until_each_ran_after(cluster: Cluster, moment: datetime, timeout: float = 40) -> None:
    """Until every schedule of KINDS has a run created after ``moment``."""
    for _ in range(int(timeout / 0.2)):
        rows = await cluster.query(
            f"SELECT count(DISTINCT labels->>'{SCHEDULE_LABEL}') AS n FROM jobs "
            "WHERE create_time > $1",
            moment,
        )
        if rows[0]["n"] == len(KINDS):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"not every schedule ran after {moment}")


async def test_schedulers_sigkilled_mid_tick_run_each_tick_once(cluster: Cluster) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    await asyncio.gather(cluster.server(), cluster.worker("--concurrency", "8"))
    async with cluster.client() as client:
        for schedule_id, kind in KINDS.items():
            await _create(client, schedule_id, kind)
    firsts = {sid: (await _schedule(cluster, sid))["next_tick"] for sid in KINDS}
    relays = list(await asyncio.gather(*(cluster.relay() for _ in range(3))))
    async with Peaks(cluster, _GOING) as going:
        async with Supervisor(relays, faults=_tick_faults(rng)) as supervisor:
            await kill_at_random(relays, rng, kills=4, spare=1)
            # Every scheduler down for longer than the catch-up bound (3 ticks).
            await supervisor.hold()
            for relay in relays:
                relay.kill()
            await asyncio.sleep(4.5)
            supervisor.release()
            await kill_at_random(relays, rng, kills=3, spare=1)
            supervisor.faults = lambda _: ""
            await _until_each_ran_after(cluster, await _now(cluster))
        for relay in relays:
            relay.kill()
        for relay in relays:
            await relay.wait()
    problems = []
    for schedule_id, kind in KINDS.items():
        runs = await _runs(cluster, schedule_id)
        schedule = await _schedule(cluster, schedule_id)
        problems += judge_ticks(schedule_id, kind, firsts[schedule_id], schedule, runs)
        peak = going.peak[f"schedules/{schedule_id}"]
        problems += _judge_overlap(schedule_id, kind, runs, peak)
    assert not problems, f"seed {seed}:\n" + "\n".join(problems)
    assert sum(relay.starts for relay in relays) >= 3 + 3 + 2  # the kills happened
    # Every scheduler was down past the bound: ALL caught up its 3 newest at once.
    groups = _by_transaction(await _runs(cluster, "all-allow-0"))
    assert any(len(group) == 3 for group in groups), groups
    assert going.samples > 20


async def test_a_scheduler_killed_before_and_after_its_tick_commits(cluster: Cluster) -> None:
    kind = Kind(CatchUp.ALL, Overlap.ALLOW_ALL)
    await cluster.server()
    async with cluster.client() as client:
        await _create(client, "exact", kind)
    first = (await _schedule(cluster, "exact"))["next_tick"]

    # Killed with its second tick claimed and its run written, before the commit.
    before = await cluster.relay(faults="crash:schedule.before_commit@2")
    assert await before.wait(timeout=60) == 137
    schedule, runs = await _schedule(cluster, "exact"), await _runs(cluster, "exact")
    due = schedule["next_tick"]
    ticks = [run.tick for run in runs]
    # The first pass committed (every tick due by then); the second rolled back.
    assert ticks == [first + k * INTERVAL for k in range(len(runs))] != []
    assert due == ticks[-1] + INTERVAL  # still due, and no job of it
    assert schedule["runs"] == len(runs)

    # The next scheduler runs it (and what came due since), then dies right after the commit.
    after = await cluster.relay(faults="crash:schedule.after_commit@1")
    assert await after.wait(timeout=60) == 137
    schedule, runs = await _schedule(cluster, "exact"), await _runs(cluster, "exact")
    ticks = [run.tick for run in runs]
    assert due in ticks  # not lost
    assert schedule["next_tick"] > ticks[-1]  # advanced in that same commit
    committed = len(runs)

    # A third picks up from there: nothing of the committed tick again.
    last = await cluster.relay()
    for _ in range(300):
        if len(await _runs(cluster, "exact")) >= committed + 2:
            break
        await asyncio.sleep(0.1)
    last.kill()
    await last.wait()
    runs = await _runs(cluster, "exact")
    assert len(runs) >= committed + 2
    problems = judge_ticks("exact", kind, first, await _schedule(cluster, "exact"), runs)
    assert not problems, "\n".join(problems)
    # Every tick from the first to the newest, each once: none lost, none doubled.
    assert [run.tick for run in runs] == [first + k * INTERVAL for k in range(len(runs))]


#: Concurrency keys of the keyed run, and their limits.
KEYS = {"solo": 1, "pair": 2, "late": 1}
# The RUNNING jobs per key, in one snapshot.
_RUNNING_BY_KEY = """
SELECT concurrency_key AS "group", count(*) AS n FROM jobs
WHERE state = 'running' AND concurrency_key IS NOT NULL GROUP BY 1
"""


async def _submit_keyed(client: AsyncClient, rng: random.Random) -> list[str]:
    """Jobs of each key, some delayed (every job of ``late``), submitted again on failure."""
    names = []
    for key, limit in KEYS.items():
        for i in range(8):
            delayed = key == "late" or rng.random() < 0.3
            args: dict[str, Any] = {
                "request_id": f"{key}-{i}-{uuid.uuid4().hex[:8]}",
                "max_attempts": 10,
                "concurrency_key": key,
                "concurrency_limit": limit,
                "schedule_delay": rng.uniform(0.5, 4.0) if delayed else None,
            }
            payload = {"ms": rng.choice([200, 300, 400]), "i": i}
            for attempt in range(50):
                try:
                    names.append((await client.submit("fault.work", payload, **args)).name)
                    break
                except Exception:
                    if attempt == 49:
                        raise
                    await asyncio.sleep(0.1)
    return names


async def test_keyed_and_delayed_jobs_while_relays_and_workers_die(cluster: Cluster) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    await cluster.server()
    # One relay dies after its 7th confirm of every life, before it marks the rows.
    procs = await asyncio.gather(
        cluster.relay(faults="crash:relay.after_confirm@7"),
        cluster.relay(),
        *(cluster.worker("--concurrency", "4") for _ in range(2)),
    )
    relays, workers = list(procs[:2]), list(procs[2:])
    async with cluster.client() as client:
        names = await _submit_keyed(client, rng)
    async with Peaks(cluster, _RUNNING_BY_KEY) as running, Supervisor(relays + workers):
        await kill_at_random(relays + workers, rng, kills=8, between=(0.8, 1.6))
        await cluster.wait_all_terminal(names, timeout=120)
    await cluster.check(names)  # L and D: each ended once, succeeded, its effect once
    assert dict(running.peak) and all(running.peak[k] <= n for k, n in KEYS.items()), (
        f"seed {seed}: RUNNING at once {dict(running.peak)}, limits {KEYS}"
    )
    ids = [uuid.UUID(name.partition("/")[2]) for name in names]
    most = most_at_once(await running_spans(cluster, ids, "j.concurrency_key"))
    assert all(most[k] <= n for k, n in KEYS.items()), f"seed {seed}: {most}, limits {KEYS}"
    assert most["pair"] == 2  # the limit was reached: the check could see one more
    early = await cluster.query(
        "SELECT j.id FROM jobs j JOIN job_events e ON e.job_id = j.id "
        "WHERE j.id = ANY($1::uuid[]) AND e.type = 'started' AND e.event_time < j.schedule_time",
        ids,
    )
    assert not early, f"started before their time: {early}"
    assert sum(p.starts for p in relays + workers) >= 4 + 4  # the kills happened
