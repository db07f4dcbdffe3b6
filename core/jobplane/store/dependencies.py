"""Dependencies in the store: a new job's ``after``, checked and counted at submit.

A job submitted with ``after`` runs once the jobs it names have ended, as its
policy says (docs/workflows.md, ADR-0045). At submit, in the submit's
transaction and before its insert, the jobs named are marked and locked
(:data:`~jobplane.store.machine.dependencies.MARK`) and read: a name that is
not a job of the caller's tenant refuses the request (INVALID_ARGUMENT naming
``after[i]``, the same answer for another tenant's job as for none), and
those that already ended count at once. A job with a dependency still to end
is inserted QUEUED without a dispatch, waiting_code DEPENDENCIES; one whose
dependencies all ended is inserted as its policy says: dispatched, or
(failed by one of them) decided by the machine in the same transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jobplane.errors import InvalidArgument, JobplaneError
from jobplane.names import job_name
from jobplane.store.db import Conn
from jobplane.store.job_submit import NewJob
from jobplane.store.machine import Row, StateMachine, Transition
from jobplane.store.machine.dependencies import MARK, REASON_NAMES
from jobplane.types import DependencyFailurePolicy, JobState, WaitingCode

#: The most jobs one job may run after.
MAX_AFTER = 100
#: What the machine decides for a waiting job, in one statement that chooses
#: between them: dispatched, or ended as its policy says.
DECISIONS = (
    Transition.DEPENDENCIES_MET,
    Transition.DEPENDENCY_FAILED,
    Transition.DEPENDENCY_CANCELLED,
)


@dataclass(frozen=True, slots=True)
class Found:
    """The states of the jobs a submit's requests run after, by id (those that exist)."""

    states: dict[uuid.UUID, JobState]


def has_after(news: Sequence[NewJob]) -> bool:
    """Whether any of ``news`` runs after other jobs."""
    return any(new.after for new in news)


async def check_after(
    conn: Conn, tenant_id: uuid.UUID, news: Sequence[NewJob]
) -> tuple[Found, dict[int, JobplaneError]]:
    """Mark and lock the jobs ``news`` run after, in the submit's transaction;
    their states, and the requests refused for naming one that is not the
    tenant's, by index (each refused alone: its own ``after[i]``)."""
    wanted = sorted({a for new in news for a in new.after})
    if not wanted:
        return Found({}), {}
    rows = await conn.fetch(MARK, {"tenant_id": tenant_id, "ids": wanted})
    states = {uuid.UUID(str(row["id"])): JobState(row["state"]) for row in rows}
    refused: dict[int, JobplaneError] = {}
    for i, new in enumerate(news):
        for k, dependency in enumerate(new.after):
            if dependency not in states:
                refused[i] = InvalidArgument(
                    f"after[{k}]: no job {job_name(dependency)} (a job of yours that exists "
                    "when this one is submitted)",
                    field=f"after[{k}]",
                )
                break
    return Found(states), refused


def waiting_reason(awaited: Sequence[uuid.UUID]) -> str:
    """What a job that waits for ``awaited`` says it waits for."""
    names = ", ".join(job_name(a) for a in sorted(awaited)[:REASON_NAMES])
    return f"waiting for {names} to end (it runs after them)"


def dependency_columns(new: NewJob, found: Found) -> dict[str, Any]:
    """The columns of ``new``'s row its ``after`` sets (SUBMIT_COLUMNS): for a job
    that waits, no dispatch (``dispatch_id`` None); none without ``after``."""
    if not new.after:
        # None: NULL, and the statement counts NULL as no dependencies (0).
        return {}
    states = [found.states[a] for a in new.after]
    awaited = [a for a, s in zip(new.after, states, strict=True) if not s.terminal]
    pairs = zip(new.after, states, strict=True)
    failed = sorted(a for a, s in pairs if s.terminal and s is not JobState.SUCCEEDED)
    runs = not awaited and (not failed or new.after_failure is DependencyFailurePolicy.RUN_ANYWAY)
    columns: dict[str, Any] = {
        "after_ids": "{" + ",".join(str(a) for a in new.after) + "}",
        "after_failure": new.after_failure.value,
        "deps_waiting": len(awaited),
        "deps_failed": len(failed),
        "deps_failed_on": failed[0] if failed else None,
        "waiting_code": None if runs else WaitingCode.DEPENDENCIES.value,
        "waiting_reason": None if runs else waiting_reason(awaited or new.after),
    }
    if not runs:
        columns["dispatch_id"] = None
    return columns


def decided_at_submit(new: NewJob, found: Found) -> bool:
    """Whether ``new`` is decided as soon as it is written: a job it runs after has
    already failed and its policy ends it (FAIL, CANCEL)."""
    if not new.after or new.after_failure is DependencyFailurePolicy.RUN_ANYWAY:
        return False
    return any(
        found.states[a].terminal and found.states[a] is not JobState.SUCCEEDED for a in new.after
    )


async def decide(conn: Conn, machine: StateMachine, ids: Sequence[uuid.UUID]) -> dict[str, Row]:
    """The jobs of ``ids`` (just written, waiting) their counts decide: ended as
    their policy says, in the submit's transaction. Their rows after, by id."""
    if not ids:
        return {}
    rows = await machine.apply(conn, DECISIONS[0], {"ids": list(ids)})
    return {str(row["id"]): row for row in rows}
