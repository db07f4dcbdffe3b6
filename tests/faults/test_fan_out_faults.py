"""Fan-out and join under killed workers (ADR-0047): every node — the job, each
child, the join — ends exactly once.

Judged per node: each child by L and D as any job (``Cluster.check``), the
job by L and stored O, and the join stage by its effect, written last by the
attempt whose result the job kept; and each job has exactly one set of
children, which the join received in item order.
"""

from __future__ import annotations

import uuid

from tests.faults.cluster import FAN_PIPELINE, Cluster
from tests.faults.test_faults import kill_workers_until_done


async def _judge(cluster: Cluster, names: list[str], items: int) -> list[str]:
    """The children of ``names``, after failing on any violation of the jobs' own."""
    ids = [uuid.UUID(n.partition("/")[2]) for n in names]
    jobs = await cluster.query(
        """
        SELECT j.id, j.state, j.last_seq, (j.result->>'attempt')::int AS result_attempt,
               (j.result->>'items')::int AS items, f.attempt AS effect_attempt,
               (SELECT count(*) FROM job_events e WHERE e.job_id = j.id
                  AND e.type IN ('succeeded', 'failed', 'cancelled')) AS terminal_events,
               (SELECT count(*) FROM job_events e WHERE e.job_id = j.id) AS events,
               (SELECT count(*) FROM jobs c WHERE c.parent_id = j.id) AS children,
               (SELECT count(*) FROM fault_stage_completions c
                  WHERE c.job_id = j.id AND c.stage = 'join'
                    AND (c.at > j.end_time OR c.attempt > j.attempt)) AS late
        FROM jobs j LEFT JOIN fault_stage_effects f ON f.job_id = j.id AND f.stage = 'join'
        WHERE j.id = ANY($1::uuid[])
        """,
        ids,
    )
    problems = []
    for job in jobs:
        where = str(job["id"])
        if job["state"] != "succeeded" or job["terminal_events"] != 1:  # L
            problems.append(f"L: {where} {job['state']}, {job['terminal_events']} terminal events")
        if job["events"] != job["last_seq"]:  # O, as stored
            problems.append(f"O: {where} stores {job['events']} of {job['last_seq']}")
        if job["children"] != items or job["items"] != items:  # one set, all joined
            problems.append(f"D: {where} has {job['children']} children, joined {job['items']}")
        if job["effect_attempt"] != job["result_attempt"] or job["late"]:  # D of the join
            problems.append(
                f"D: {where} join effect by {job['effect_attempt']}, result of "
                f"{job['result_attempt']}, {job['late']} late"
            )
    assert not problems, "\n".join(problems[:20])
    rows = await cluster.query("SELECT id FROM jobs WHERE parent_id = ANY($1::uuid[])", ids)
    return [f"jobs/{row['id']}" for row in rows]


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
        children = await _judge(cluster, names, items=3)
        await cluster.check(children)
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
        children = await _judge(cluster, names, items=3)
        await cluster.check(children)
