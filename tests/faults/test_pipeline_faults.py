"""Pipelines under faults: workers killed mid-stage, and after a stage's commit before its ack.

Judged by L, D and O per stage (``Cluster.check_pipelines``): every pipeline
ends SUCCEEDED with every stage SUCCEEDED, each stage's effect was written
last by the attempt whose result the stage kept, and each job's events are
gap-free — including across the handoffs between stages.
"""

from __future__ import annotations

from tests.faults.cluster import PIPELINE, Cluster
from tests.faults.handlers import PIPELINE_STAGES
from tests.faults.test_faults import _check_watchers, _watch_sample, kill_workers_until_done


async def test_sigkill_workers_mid_stage_during_a_pipeline_run(staged: Cluster) -> None:
    cluster = staged
    await cluster.server()
    await cluster.relay()
    workers = [await cluster.worker("--concurrency", "8") for _ in range(2)]
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 60, PIPELINE, ms=150)
        seen, tasks = await _watch_sample(cluster, client, names)
        await kill_workers_until_done(cluster, workers, names, timeout=120)
        counts = await cluster.check_pipelines(names)
        await _check_watchers(client, seen, tasks)
        # Every stage of the watched jobs was seen, in order, in one stream.
        for events in seen.values():
            stages = [e.stage for e in events]
            firsts = [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s]
            assert firsts == list(PIPELINE_STAGES), firsts
    assert counts == {"jobs": 60, "stages": 180}
    assert sum(w.starts for w in workers) >= 5  # the kills happened


async def test_sigkill_after_a_stage_commit_before_its_ack(staged: Cluster) -> None:
    cluster = staged
    await cluster.server()
    await cluster.relay()
    # Its second outcome is a stage's commit (one pipeline's first or second
    # stage, another's first): it dies before acking that stage's message.
    crashing = await cluster.worker("--concurrency", "1", faults="crash:worker.after_outcome@2")
    async with cluster.client() as client:
        names = await cluster.submit_many(client, 5, PIPELINE, ms=20)
        exit_code = await crashing.wait(timeout=60)
        assert exit_code == 137  # it died between the commit and the ack
        await cluster.worker("--concurrency", "4")
        await cluster.wait_all_terminal(names)
        await cluster.check_pipelines(names)
        # The redelivered stage message was acked without a run: every stage
        # of every pipeline ran exactly once.
        rows = await cluster.query(
            "SELECT job_id, stage, count(*) AS runs FROM fault_stage_completions "
            "GROUP BY job_id, stage"
        )
        assert len(rows) == 5 * len(PIPELINE_STAGES)
        assert {r["runs"] for r in rows} == {1}
        writes = await cluster.query("SELECT DISTINCT writes FROM fault_stage_effects")
        assert [r["writes"] for r in writes] == [1]
