"""Child jobs under a killed worker: a handler killed after it submitted its
children runs again and gets the same children, never a second set."""

from __future__ import annotations

import asyncio
import uuid

from tests.faults.cluster import Cluster
from tests.faults.test_faults import _keep_alive


async def test_a_worker_killed_after_submitting_children_leaves_one_set(
    cluster: Cluster,
) -> None:
    await cluster.server()
    await cluster.relay()
    workers = [await cluster.worker("--concurrency", "4")]
    stop = asyncio.Event()
    supervisor = asyncio.create_task(_keep_alive(workers, stop))
    try:
        async with cluster.client() as client:
            parents = await cluster.submit_many(client, 4, "fault.fanout", max_attempts=5, n=3)
            await cluster.wait_all_terminal(parents, timeout=120)
            await cluster.check(parents)
            rows = await cluster.query(
                "SELECT id, parent_id FROM jobs WHERE parent_id = ANY($1::uuid[])",
                [uuid.UUID(p.partition("/")[2]) for p in parents],
            )
            by_parent: dict[str, set[str]] = {}
            for row in rows:
                by_parent.setdefault(f"jobs/{row['parent_id']}", set()).add(f"jobs/{row['id']}")
            assert {p: len(by_parent.get(p, ())) for p in parents} == {p: 3 for p in parents}
            for parent in parents:
                done = await client.get(parent)
                assert done.attempt >= 2  # the first attempt died with its worker
                assert done.result is not None
                assert set(done.result["children"]) == by_parent[parent]
            children = sorted(name for names in by_parent.values() for name in names)
            await cluster.wait_all_terminal(children, timeout=60)
            await cluster.check(children)
    finally:
        stop.set()
        await supervisor
    assert workers[0].starts >= 2  # the kills happened
