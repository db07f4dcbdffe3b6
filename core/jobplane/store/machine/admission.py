"""The claim's admission guards: concurrency keys (ADR-0040) and flow limits
(ADR-0043), as SQL over the job's row.

:mod:`~jobplane.store.machine.table` uses them in its rules (CLAIM's guard,
HOLD's and RELEASE's prose); :mod:`~jobplane.store.machine.flow` uses
:data:`LIMITED`.
"""

from __future__ import annotations

__all__ = [
    "ADMITS",
    "FLOW_CHECK",
    "FLOW_SLOTS",
    "GROUP_ADMITS",
    "KEY_BLOCKER",
    "KEY_FREE",
    "KEY_FULL",
    "LIMITED",
]

# Concurrency keys (ADR-0040): the job its key makes it wait for, or NULL when
# it may start now. The function takes the key's advisory lock first and
# counts after it, so the answer is the key's as of the lock, whatever the
# statement's snapshot saw. CASE: a job without a key never calls it.
KEY_BLOCKER = (
    "jobplane.concurrency_blocker(tenant_id, concurrency_key, concurrency_limit, id, create_time)"
)
# Flow limits (ADR-0043): a limit of the topology applies to the job (its
# queue has max_running_per_tenant, or a [[rate_limits]] entry matches its
# type). Two lookups in tables of a few rows; a job none applies to never
# calls the function, which takes the limits' locks and counts.
LIMITED = (
    "(EXISTS (SELECT 1 FROM queue_limits ql WHERE ql.queue = jobs.queue) "
    "OR EXISTS (SELECT 1 FROM flow_limits fl WHERE ('.' || jobs.type) ~ ANY (fl.regexes)))"
)
# The keys of the RUNNING limits the claim counted the job against: it holds a
# slot of each while RUNNING, and its end frees them (NULL: none).
FLOW_SLOTS = (
    f"CASE WHEN {LIMITED} THEN nullif(ARRAY(SELECT jobplane.flow_keys(tenant_id, type, queue)), "
    "'{}') END"
)
FLOW_CHECK = "jobplane.flow_check(tenant_id, type, queue, id, create_time, flow_key, {hold})"
# The key first, then the limits: a job its key refuses counts no start
# against its rate. CASE: evaluated in this order, and only as far as needed.
ADMITS = (
    f"CASE WHEN concurrency_key IS NOT NULL AND {KEY_BLOCKER} IS NOT NULL THEN false "
    f"WHEN NOT {LIMITED} THEN true "
    f"ELSE {FLOW_CHECK.format(hold='false')} IS NULL END"
)
# A claim in a group (many rows, one statement) takes no advisory lock: a job
# with a concurrency key or under a flow limit is refused there and claimed
# alone (ADR-0043). Alone, a claim takes at most one lock of each kind, in one
# order (key, queue, limit), so two claims never wait for each other in a
# cycle; a group would take its rows' locks in row order, which differs
# between groups, and its guard, reading only the job's columns, may be
# evaluated for rows the group was not given.
GROUP_ADMITS = f"concurrency_key IS NULL AND NOT {LIMITED}"
KEY_FULL = "its concurrency key is full, or a flow limit holds it (the statement decides)"
# Said by the release statement itself (written out: it picks its jobs).
KEY_FREE = "held by this key, oldest first, up to the slots free under the key's lock"
