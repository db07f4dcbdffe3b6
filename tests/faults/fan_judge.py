"""Judging fan-out jobs (ADR-0047) node by node: each job, each child, the join.

- the job: SUCCEEDED with one terminal event (**L**), its events stored
  1..last_seq (**O**), exactly one set of children (**D**), and the join ran
  to its effect once, by the attempt whose result the job kept, with no
  attempt of it completing late (**D**); the join itself checks that the
  results came in item order and that exactly the items meant to fail did;
- each child: judged by L and D as any job (:meth:`Cluster.judge`), SUCCEEDED
  unless its item was one meant to fail, which FAILED.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from tests.faults.cluster import Cluster


async def judge_fan_outs(
    cluster: Cluster, names: Sequence[str], items: int, failing: int = 0
) -> tuple[dict[str, int], list[str]]:
    """Judge the jobs ``names`` (each of ``items`` items, ``failing`` of them
    meant to fail) and their children: the counts, and every violation."""
    ids = [uuid.UUID(n.partition("/")[2]) for n in names]
    jobs = await cluster.query(
        """
        SELECT j.id, j.state, j.last_seq, (j.result->>'attempt')::int AS result_attempt,
               (j.result->>'items')::int AS items, (j.result->>'failed')::int AS failed,
               f.attempt AS effect_attempt,
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
    if len(jobs) != len(ids):
        problems.append(f"L: {len(jobs)} of {len(ids)} fan-out jobs stored")
    for job in jobs:
        where = str(job["id"])
        if job["state"] != "succeeded" or job["terminal_events"] != 1:  # L
            problems.append(f"L: {where} {job['state']}, {job['terminal_events']} terminal events")
        if job["events"] != job["last_seq"]:  # O, as stored
            problems.append(f"O: {where} stores {job['events']} of {job['last_seq']}")
        if job["children"] != items or job["items"] != items:  # one set, all joined
            problems.append(f"D: {where} has {job['children']} children, joined {job['items']}")
        if job["failed"] != failing:
            problems.append(f"L: {where} joined {job['failed']} failed children of {failing}")
        if job["effect_attempt"] != job["result_attempt"] or job["late"]:  # D of the join
            problems.append(
                f"D: {where} join effect by {job['effect_attempt']}, result of "
                f"{job['result_attempt']}, {job['late']} late"
            )
    children = await cluster.query(
        "SELECT id, (payload->>'fail')::boolean AS fail FROM jobs "
        "WHERE parent_id = ANY($1::uuid[])",
        ids,
    )
    for fail, expect in ((False, "succeeded"), (True, "failed")):
        group = [f"jobs/{c['id']}" for c in children if bool(c["fail"]) is fail]
        if group:
            problems += (await cluster.judge(group, expect=expect))[1]
    counts = {"jobs": len(jobs), "children": len(children)}
    counts["failed"] = sum(bool(c["fail"]) for c in children)
    return counts, problems


async def check_fan_outs(
    cluster: Cluster, names: Sequence[str], items: int, failing: int = 0
) -> dict[str, int]:
    """:func:`judge_fan_outs`, failing on any violation; returns the counts."""
    counts, problems = await judge_fan_outs(cluster, names, items, failing)
    assert not problems, "\n".join(problems[:20])
    return counts
