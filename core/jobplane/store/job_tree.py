"""A job's tree for the dashboard: its root and the root's descendants, bounded.

One recursive statement, scoped by tenant: it walks ``parent_id`` up from the
job (at most :data:`UP` levels) to the root, then down from the root through
the ``jobs_parent`` index, breadth first, at most :data:`DEPTH` levels and
:data:`NODES` nodes. The recursive walk is read lazily, so its ``LIMIT``
stops it there: a fan-out of ten thousand children costs ``NODES`` index
entries, not ten thousand. The path from the root to the job is always read,
so the job shows in its tree even when it lies deeper than the bounds.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from jobplane.types import JobState

#: The ancestors walked up to find the root.
UP = 20
#: The levels drawn below the root.
DEPTH = 5
#: The nodes drawn below the root (the path to the job comes on top).
NODES = 200
#: Children counted per node to say how many were left out.
COUNT_CAP = 1000

_TREE = text(
    """
    WITH RECURSIVE up(id, parent_id, level) AS (
        SELECT id, parent_id, 0 FROM jobs WHERE id = :id AND tenant_id = :tenant_id
        UNION ALL
        SELECT jobs.id, jobs.parent_id, up.level + 1 FROM jobs JOIN up ON jobs.id = up.parent_id
        WHERE jobs.tenant_id = :tenant_id AND up.level < :up
    ), root AS (
        SELECT id FROM up ORDER BY level DESC LIMIT 1
    ), down(id, depth) AS (
        SELECT id, 0 FROM root
        UNION ALL
        SELECT c.id, down.depth + 1 FROM down CROSS JOIN LATERAL (
            SELECT id FROM jobs WHERE parent_id = down.id AND tenant_id = :tenant_id
            ORDER BY create_time DESC, id DESC LIMIT :nodes
        ) c
        WHERE down.depth < :depth
    ), drawn AS (
        (SELECT id FROM down LIMIT :nodes + 1)
        UNION
        SELECT id FROM up
    )
    SELECT jobs.id, jobs.parent_id, jobs.type, jobs.state, jobs.progress, jobs.create_time,
           (SELECT count(*) FROM (
                SELECT 1 FROM jobs k WHERE k.parent_id = jobs.id AND k.tenant_id = :tenant_id
                ORDER BY k.create_time DESC, k.id DESC LIMIT :cap) n) AS children
    FROM jobs JOIN drawn ON jobs.id = drawn.id
    WHERE jobs.tenant_id = :tenant_id
    ORDER BY jobs.create_time DESC, jobs.id DESC
    """
)


@dataclass(slots=True)
class TreeNode:
    """One job of a tree, its drawn children (newest first) and how many were left out."""

    id: str
    type: str
    state: JobState
    progress: float
    children: list[TreeNode] = field(default_factory=list)
    #: Children not drawn (the bounds cut them); ``capped``: at least this many.
    more: int = 0
    capped: bool = False


@dataclass(frozen=True, slots=True)
class JobTree:
    """The drawn tree: its root, and whether the root has ancestors beyond :data:`UP`."""

    root: TreeNode
    above: bool


async def read_tree(
    conn: AsyncConnection, tenant_id: uuid.UUID, job_id: uuid.UUID
) -> JobTree | None:
    """The tree ``job_id`` belongs to (None: no such job in the tenant)."""
    params = {
        "id": job_id,
        "tenant_id": tenant_id,
        "up": UP,
        "depth": DEPTH,
        "nodes": NODES,
        "cap": COUNT_CAP,
    }
    rows = (await conn.execute(_TREE, params)).mappings().all()
    nodes = {
        r["id"]: TreeNode(str(r["id"]), r["type"], JobState(r["state"]), float(r["progress"]))
        for r in rows
    }
    counts = {r["id"]: int(r["children"]) for r in rows}
    root: TreeNode | None = None
    above = False
    for r in rows:  # newest first, so each list of children is too
        parent = nodes.get(r["parent_id"])
        if parent is not None:
            parent.children.append(nodes[r["id"]])
        else:  # the one node whose parent is not drawn
            root, above = nodes[r["id"]], r["parent_id"] is not None
    if root is None:
        return None
    for key, node in nodes.items():
        node.more = max(0, counts[key] - len(node.children))
        node.capped = counts[key] >= COUNT_CAP
    return JobTree(root, above)
