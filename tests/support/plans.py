"""The relay's claim as it runs, and how to read its plan (EXPLAIN (ANALYZE, FORMAT JSON)).

The claim is one statement whose parts are common table expressions
(``jobplane.store.outbox``): the dispatches' (``dispatches``, or the fair
claim's ``pairs`` and ``claimed``) and the other rows' (``others``). Postgres
runs each such part as an InitPlan named ``CTE <name>``; a check of one part
walks that node's plan only.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import TextClause

from jobplane.store.fair import FairClaim, FairRound
from jobplane.store.outbox import claim_statement
from jobplane.topology import Topology
from jobplane.topology.parse import PRIORITIES

#: The part of the claim that takes the other rows (not dispatches).
OTHERS = "others"


def relay_claims(
    topology: Topology, *, limit: int = 100, credit: int | None = None
) -> dict[str, tuple[TextClause, dict[str, Any]]]:
    """The relay's claim, fair dispatch on (the default) and off, with the binds it
    passes (``OutboxStore.claim``): a batch of ``limit``, nothing held back, each
    queue of ``topology`` at its priority's rank with ``credit`` (the batch when None)."""
    credits = {
        q.name: (limit if credit is None else credit, PRIORITIES.index(q.priority))
        for q in topology.queues
    }
    return {
        "fair": claim_statement(limit, fair=FairClaim(FairRound(), credits)),
        "in due order": claim_statement(limit),
    }


def parts(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The plan of each common table expression Postgres ran apart, by name."""
    found: dict[str, dict[str, Any]] = {}
    name = str(plan.get("Subplan Name", ""))
    if name.startswith("CTE "):
        found[name.removeprefix("CTE ")] = plan
    for child in plan.get("Plans", []):
        found.update(parts(child))
    return found


def part(plan: dict[str, Any], name: str) -> dict[str, Any]:
    """The plan of the common table expression ``name`` (an AssertionError if the
    planner folded it into the rest: its rows could not be told apart then)."""
    found = parts(plan)
    assert name in found, (name, sorted(found), plan)
    return found[name]


def dispatch_parts(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The plans of the claim's dispatches' part: every expression but the other rows'."""
    found = [node for name, node in parts(plan).items() if name != OTHERS]
    assert found, plan
    return found


def rows_read(node: dict[str, Any]) -> int:
    """Rows the plan's scans of tables and indexes returned or removed (by a filter
    or a recheck), over all their loops; scans of what another part produced
    (a CTE Scan, a WorkTable Scan) read no table and count nothing."""
    own = 0
    if "Relation Name" in node:
        per_loop = sum(
            int(node.get(key, 0))
            for key in ("Actual Rows", "Rows Removed by Filter", "Rows Removed by Index Recheck")
        )
        own = per_loop * int(node.get("Actual Loops", 1))
    return own + sum(rows_read(child) for child in node.get("Plans", []))


def scans(node: dict[str, Any]) -> list[str]:
    """The plan's scans of tables and indexes, as ``node type on relation (index)``."""
    found = []
    if "Relation Name" in node:
        index = node.get("Index Name")
        found.append(
            f"{node['Node Type']} on {node['Relation Name']}" + (f" ({index})" if index else "")
        )
    for child in node.get("Plans", []):
        found += scans(child)
    return found
