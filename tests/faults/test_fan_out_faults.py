"""Fan-out and join under killed workers (ADR-0047): every node — the job, each
child, the join — ends exactly once.

Judged per node (tests/faults/fan_judge.py): each child by L and D as any
job (``Cluster.judge``), the job by L and stored O, and the join stage by its
effect, written last by the attempt whose result the job kept; and each job
has exactly one set of children, which the join received in item order.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

from tests.faults.cluster import FAN_PIPELINE, Cluster
from tests.faults.fan_judge import check_fan_outs
from tests.faults.test_faults import kill_workers_until_done


async def test_workers_killed_mid_child_and_mid_join_end_every_node_once(
    fanned: Cluster,
) -> None:
    cluster = fanned
    await cluster.server()
    await cluster.relay()
    workers = [await cluster.worker("--concurrency", "6") for _ in range(2)]
    async with cluster.client() as client:
        # Each job's first child and its join kill their worker once, mid-run;
        # the supervisor restarts the worker each time.
        names = await cluster.submit_many(
            client, 2, FAN_PIPELINE, n=3, ms=50, kill_child=True, kill_join=True
        )
        await kill_workers_until_done(cluster, workers, names, kills=0, timeout=120)
        await check_fan_outs(cluster, names, items=3)
    kills = await cluster.query("SELECT what, count(*) AS n FROM fault_kills GROUP BY what")
    assert {row["what"]: row["n"] for row in kills} == {"child": 2, "join": 2}


async def test_a_kill_after_the_spawn_commits_before_its_ack_spawns_once(
    fanned: Cluster,
) -> None:
    cluster = fanned
    await cluster.server()
    await cluster.relay()
    # Its first outcome is a split's spawn: it dies before acking that message.
    crashing = await cluster.worker("--concurrency", "1", faults="crash:worker.after_outcome@1")
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 3, FAN_PIPELINE, n=3, ms=10)
        assert await crashing.wait(timeout=60) == 137
        await cluster.worker("--concurrency", "4")
        await cluster.wait_all_terminal(names, timeout=60)
        await check_fan_outs(cluster, names, items=3)


async def test_a_relay_killed_mid_fan_out_dispatches_every_child_once(fanned: Cluster) -> None:
    cluster = fanned
    await cluster.server()
    relay = await cluster.relay()
    for _ in range(2):
        await cluster.worker("--concurrency", "8")
    parents, items = 6, 50
    async with cluster.client() as client:
        # Job i spawns its 50 children 0.5 s after job i - 1: the relay dies
        # while the first set is being published, the last not yet spawned.
        names = await cluster.submit_many(
            client, parents, FAN_PIPELINE, n=items, ms=10, stagger=0.5
        )
        ids = [uuid.UUID(n.partition("/")[2]) for n in names]
        children = """
            SELECT count(*) AS spawned, count(o.published_at) AS published
            FROM jobs c JOIN outbox o ON o.job_id = c.id AND o.kind = 'job.dispatch'
            WHERE c.parent_id = ANY($1::uuid[])
        """
        deadline = time.monotonic() + 60
        while not (await cluster.query(children, ids))[0]["published"]:
            assert time.monotonic() < deadline, "no child was ever published"
            await asyncio.sleep(0.02)
        relay.kill()
        assert await relay.wait() == -signal.SIGKILL
        at_kill = (await cluster.query(children, ids))[0]
        assert at_kill["published"] < parents * items, at_kill  # mid-fan-out
        await cluster.relay()
        await cluster.wait_all_terminal(names, timeout=120)
        counts = await check_fan_outs(cluster, names, items=items)
        assert counts["children"] == parents * items
        runs = await cluster.query(
            """
            SELECT (SELECT count(*) FROM fault_completions) AS child_runs,
                   (SELECT count(DISTINCT job_id) FROM fault_completions) AS children_run,
                   (SELECT count(*) FROM fault_stage_completions WHERE stage = 'join') AS joins
            """
        )
        left = await cluster.query(children, ids)
    # Every child published and run once (a repeated message ran nothing), every join once.
    assert dict(runs[0]) == {
        "child_runs": parents * items,
        "children_run": parents * items,
        "joins": parents,
    }
    assert dict(left[0]) == {"spawned": parents * items, "published": parents * items}
