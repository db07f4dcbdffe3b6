"""The SQL compiler: each transition's statement, built from its rule.

:func:`changes` is the data-modifying statement of one application (``j``'s
body), :func:`changes_many` its CTEs for many rows at once. Four statements
are not one ``UPDATE`` built from a rule and are written out here, their
state conditions still taken from the table: submit's insert, the progress
batch, the hand-back (which decides between HAND_BACK and PARK in SQL) and
the unpark batch. The hooks' writes are folded in by
:class:`jobplane.store.machine.core.StateMachine`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from sqlalchemy import text

from jobplane.store.machine import flow
from jobplane.store.machine.concurrency import release
from jobplane.store.machine.dependencies import RESOLUTIONS, resolve
from jobplane.store.machine.table import (
    ATTEMPT_FENCE,
    JOB_PROGRESS,
    RULES,
    Transition,
    where_sources,
)
from jobplane.store.rows import JOB_FIELDS
from jobplane.types import WaitingCode

# Not a transition: the attempt's lease is extended, the job stays as it is
# and nothing is appended. Fenced like every write of an attempt.
HEARTBEAT = text(
    f"""
    UPDATE jobs SET lease_expires_at = now() + make_interval(secs => :lease_seconds)
    WHERE {ATTEMPT_FENCE} AND {where_sources(Transition.PROGRESS)}
    RETURNING cancel_requested_at IS NOT NULL AS cancel_requested
    """
)
# Columns of jobs a hook may read besides JOB_FIELDS (which the API's reads use).
_HOOK_FIELDS = (
    *JOB_FIELDS,
    "lifecycle_seq",
    "lifecycle_cause",
    "cancel_reason",
    # Flow limits (ADR-0043): what a held job waits for; the slots a job holds.
    "flow_key",
    "flow_slots",
    # Dependencies (ADR-0045): an end settles the jobs that run after it.
    "has_dependents",
    # Fan-out (ADR-0047): the stage whose children a job waits for, how many,
    # how many failed.
    "fan_stage",
    "fan_size",
    "deps_failed",
)


def _returning(columns: Iterable[str], table: str, known: Iterable[str] = _HOOK_FIELDS) -> str:
    fields = set(known)
    return ", ".join(f"{table}.{c}" for c in sorted(columns) if c in fields)


def _from_state(transition: Transition, needs: set[str]) -> tuple[str, str, str]:
    """(FROM clause, WHERE terms, select expression) of the state before the change.

    One source: a constant. Several: the row as this statement's snapshot
    saw it, and the UPDATE applies only while the row is still in that state
    (a row changed meanwhile is re-checked by Postgres against the same
    snapshot row), so the state named is the state changed.
    """
    sources = {p.state for p in RULES[transition].sources}
    if not sources:
        return "", "", "CAST(NULL AS text)"
    if len(sources) == 1:
        return "", "", f"CAST('{next(iter(sources)).value}' AS text)"
    if "from_state" not in needs:
        return "", "", "CAST(NULL AS text)"
    if "id = :id" not in RULES[transition].match:
        raise ValueError(f"{transition}: several sources need a match by :id")
    return (
        "FROM (SELECT id AS o_id, state AS o_state FROM jobs WHERE id = :id) AS o",
        " AND jobs.id = o.o_id AND jobs.state = o.o_state",
        "o.o_state",
    )


def changes(transition: Transition, needs: set[str]) -> str:
    """The data-modifying statement that changes the rows: ``j``'s body.

    Built from the rule, but for submit (an insert), the progress and unpark
    batches and the hand-back (which decides between two transitions in
    SQL): those are written out below, their state conditions still taken
    from the table.
    """
    if transition is Transition.SUBMIT:
        return _submit(needs)
    if transition is Transition.PROGRESS:
        return _progress(needs)
    if transition in (Transition.HAND_BACK, Transition.PARK):
        return _hand_back(needs)
    if transition is Transition.UNPARK:
        return _unpark(needs)
    if transition is Transition.RELEASE:
        return release(needs)
    if transition in (Transition.HOLD, Transition.THROTTLE):
        return flow.hold(needs)
    if transition is Transition.RELEASE_LIMIT:
        return flow.release(needs)
    if transition in RESOLUTIONS:
        return resolve(needs, _HOOK_FIELDS)
    rule = RULES[transition]
    source_from, source_where, from_expr = _from_state(transition, needs)
    sources = where_sources(transition)
    if rule.using:
        source_from = f"{source_from}, {rule.using}" if source_from else f"FROM {rule.using}"
        sources = where_sources(transition, "jobs")
    seq = "last_seq = jobs.last_seq + 1, " if rule.event is not None else ""
    if rule.lifecycle is not None:
        # The seq of the job's lifecycle event, and of the one before it
        # (its cause): the right-hand sides read the row as it was.
        seq += "lifecycle_cause = jobs.lifecycle_seq, lifecycle_seq = jobs.last_seq + 1, "
    guard = f" AND {rule.guard}" if rule.guard else ""
    return f"""
        UPDATE jobs SET state = '{rule.target.value}', {rule.sets}, {seq}update_time = now()
        {source_from}
        WHERE {rule.match} AND {sources}{guard}{source_where}
        RETURNING {_returning(needs, "jobs") or "jobs.id"},
                  CAST('{transition}' AS text) AS transition, {from_expr} AS from_state
    """


# Statements written out rather than built from their rule (see changes).
WRITTEN_OUT = frozenset(
    {Transition.SUBMIT, Transition.PROGRESS, Transition.HAND_BACK, Transition.PARK}
    | {Transition.UNPARK, Transition.RELEASE}
    | {Transition.HOLD, Transition.THROTTLE, Transition.RELEASE_LIMIT}
    | set(RESOLUTIONS)
)
# A bind in a text() statement, as SQLAlchemy finds them (not a ``::`` cast).
BIND = re.compile(r"(?<![:\w\\]):(\w+)(?![:\w])")
#: The SQL type of each bind a transition applied to many rows may use: its
#: rows' values go into one array of it (``…[]``: a list per row, end to end).
BIND_TYPES: Mapping[str, str] = {
    "id": "uuid",
    "tenant_id": "uuid",
    "dispatch_id": "uuid",
    "lease_token": "uuid",
    "attempt": "int",
    "refund": "int",
    "type": "text",
    "lease_seconds": "float8",
    "delay": "float8",
    "result": "text",
    "result_blob": "text",
    "result_blob_size": "bigint",
    "error_code": "text",
    "error_message": "text",
    "retryable": "boolean",
    "event_message": "text",
    "event_data": "text",
    "trace_parent": "text",
    "trace_state": "text",
    "trace_inherit": "boolean",
    "waiting_code": "text",
    "waiting_reason": "text",
    "emitted_ids": "uuid[]",
    "emitted_types": "text[]",
    "emitted_times": "timestamptz[]",
    "emitted_correlations": "text[]",
    "emitted_projects": "text[]",
    "emitted_causations": "text[]",
    "emitted_payloads": "text[]",
    "emitted_hashes": "bytea[]",
}


def changes_many(transition: Transition, needs: set[str], binds: Sequence[str]) -> list[str]:
    """The CTEs that apply ``transition`` to many rows: ``i`` (each row's binds,
    ``b_<name>``, and its index ``k``), ``locked`` (the jobs that pass their
    row's fence, locked in id order) and ``j`` (the rows changed, with ``i``'s
    columns). The fence, guard and sets are the rule's, reading ``i``."""
    rule = RULES[transition]
    if "from_state" in needs and len({p.state for p in rule.sources}) > 1:
        raise ValueError(f"{transition}: from_state of many rows is not supported")
    _, _, from_expr = _from_state(transition, needs)

    def per_row(sql: str) -> str:
        return BIND.sub(lambda m: f"i.b_{m[1]}", sql)

    arrays = ", ".join(f"CAST(:{n} AS {BIND_TYPES[n]}[])" for n in binds)
    columns = ", ".join(f"b_{n}" for n in binds)
    using = f", {rule.using}" if rule.using else ""
    many_guard = rule.many_guard or rule.guard
    guard = f" AND {per_row(many_guard)}" if many_guard else ""
    fence = f"{per_row(rule.match)} AND {where_sources(transition, 'jobs')}{guard}"
    seq = "last_seq = jobs.last_seq + 1, " if rule.event is not None else ""
    if rule.lifecycle is not None:
        seq += "lifecycle_cause = jobs.lifecycle_seq, lifecycle_seq = jobs.last_seq + 1, "
    # The rows are locked by id alone, through the primary key, and fenced by
    # the UPDATE that follows (which sees the locked version). Locked by the
    # fence, a prepared statement's generic plan, made while the table was
    # small, reached them through a partial index on their state instead: every
    # queued or running job, and every dead entry left by those passed through,
    # read for each group (34 ms a claim behind a backlog of 20,000 jobs).
    if "id" in binds:
        lock = """SELECT jobs.id AS l_id FROM jobs
        WHERE jobs.id = ANY(CAST(:id AS uuid[]))"""
    else:
        lock = f"""SELECT jobs.id AS l_id FROM jobs, i{using}
        WHERE {fence}"""
    return [
        f"i AS (SELECT * FROM unnest({arrays}) WITH ORDINALITY AS i({columns}, k))",
        f"""locked AS MATERIALIZED (
        {lock}
        ORDER BY jobs.id
        FOR UPDATE OF jobs
    )""",
        f"""j AS (
        UPDATE jobs SET state = '{rule.target.value}', {per_row(rule.sets)},
                        {seq}update_time = now()
        FROM i, locked{using}
        WHERE jobs.id = locked.l_id AND {fence}
        RETURNING {_returning(needs, "jobs") or "jobs.id"}, i.*,
                  CAST('{transition}' AS text) AS transition, {from_expr} AS from_state
    )""",
    ]


#: The columns of new jobs a submit binds, each as an array of one element a
#: job: column ``c`` of jobs is bound as ``:new_c`` (see :func:`_submit`).
SUBMIT_COLUMNS: Mapping[str, str] = {
    "id": "uuid",
    "type": "text",
    "queue": "text",
    "payload": "text",
    "max_attempts": "int",
    "request_id": "text",
    "request_hash": "bytea",
    "correlation_id": "text",
    "labels": "text",
    "dispatch_id": "uuid",
    "timeout_seconds": "float8",
    "pipeline": "text",
    "pipeline_version": "text",
    "stage": "int",
    "stage_name": "text",
    "stage_base": "float8",
    "stage_span": "float8",
    "payload_blob": "text",
    "payload_blob_size": "bigint",
    # Delayed jobs: NULL, or when the job may first start (its dispatch is due then).
    "schedule_time": "timestamptz",
    # Concurrency keys (ADR-0040).
    "concurrency_key": "text",
    "concurrency_limit": "int",
    # Deadlines (ADR-0044): NULL, or when the job must have ended.
    "deadline": "timestamptz",
    # Dependencies (ADR-0045): the jobs it runs after (a uuid[] literal, or
    # NULL), its policy, its counts; a job that waits has no dispatch, and
    # its waiting code and reason.
    "after_ids": "text",
    "after_failure": "text",
    "deps_waiting": "int",
    "deps_failed": "int",
    "deps_failed_on": "uuid",
    "waiting_code": "text",
    "waiting_reason": "text",
    # Child jobs (ADR-0046): the parent's id, or NULL.
    "parent_id": "uuid",
}


def _submit(needs: set[str]) -> str:
    # The jobs, and with the hooks their first events and dispatch intents,
    # in one statement: one transaction, so a job exists iff its outbox row
    # does. Binds: :tenant_id and the arrays of SUBMIT_COLUMNS, one element a
    # job (SubmitJob binds one, BatchSubmitJobs up to 1,000). Rows are
    # inserted in array order, which the store sorts by request_id: two
    # batches that share request_ids take their unique-index entries in the
    # same order, so one waits for the other instead of deadlocking. A job
    # whose request_id conflicts is not written and no row comes back for it.
    arrays = ", ".join(f"CAST(:new_{name} AS {kind}[])" for name, kind in SUBMIT_COLUMNS.items())
    return f"""
        INSERT INTO jobs (id, tenant_id, type, queue, state, payload, max_attempts, request_id,
                          request_hash, correlation_id, labels, dispatch_id, last_seq,
                          timeout_seconds, lifecycle_seq, pipeline, pipeline_version, stage,
                          stage_name, stage_base, stage_span,
                          payload_blob, payload_blob_size, schedule_time,
                          concurrency_key, concurrency_limit, deadline, after_ids,
                          after_failure, deps_waiting, deps_failed, deps_failed_on,
                          waiting_code, waiting_reason, parent_id)
        SELECT n.id, CAST(:tenant_id AS uuid), n.type, n.queue,
               '{RULES[Transition.SUBMIT].target.value}', CAST(n.payload AS jsonb),
               n.max_attempts, n.request_id, n.request_hash, n.correlation_id,
               CAST(n.labels AS jsonb), n.dispatch_id, 1, n.timeout_seconds, 1, n.pipeline,
               n.pipeline_version, n.stage, n.stage_name, n.stage_base, n.stage_span,
               n.payload_blob, n.payload_blob_size, n.schedule_time,
               n.concurrency_key, n.concurrency_limit, n.deadline, CAST(n.after_ids AS uuid[]),
               n.after_failure, coalesce(n.deps_waiting, 0), coalesce(n.deps_failed, 0),
               n.deps_failed_on, n.waiting_code, n.waiting_reason, n.parent_id
        FROM unnest({arrays})
            WITH ORDINALITY AS n({", ".join(SUBMIT_COLUMNS)}, ord)
        ORDER BY n.ord
        ON CONFLICT (tenant_id, request_id) DO NOTHING
        RETURNING {_returning(needs, "jobs") or "jobs.id"},
                  CAST('{Transition.SUBMIT}' AS text) AS transition,
                  CAST(NULL AS text) AS from_state
    """


def _progress(needs: set[str]) -> str:
    # The queued progress of many attempts in one statement: each attempt's
    # row is updated under its fence (locked in id order, so two batches
    # never deadlock) and its events get the seqs after the row's last_seq.
    # Attempts fenced out are missing from the result. Binds: per attempt
    # (index k) :ids, :attempts, :tokens, :ns, :last_progress, :last_message;
    # per report :ks, :ords, :progresses, :messages, :datas. Adds to j: k (the
    # attempt's index), n (its reports), cancel_requested.
    fence = (
        "jobs.attempt = i.attempt AND jobs.lease_token = i.lease_token "
        f"AND {where_sources(Transition.PROGRESS, 'jobs')}"
    )
    columns = _returning(needs, "jobs")
    return f"""
        WITH i AS (
            SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS int[]),
                                 CAST(:tokens AS uuid[]), CAST(:ns AS int[]),
                                 CAST(:last_progress AS float8[]), CAST(:last_message AS text[]))
                WITH ORDINALITY AS i(id, attempt, lease_token, n, last_progress, last_message, k)
        ), locked AS (
            SELECT jobs.id FROM jobs
            WHERE jobs.id = ANY(CAST(:ids AS uuid[]))
            ORDER BY jobs.id
            FOR UPDATE OF jobs
        )
        UPDATE jobs SET progress = {JOB_PROGRESS.format(t="jobs", p="i.last_progress")},
                        progress_message = i.last_message,
                        last_seq = jobs.last_seq + i.n, update_time = now()
        FROM i, locked
        WHERE jobs.id = locked.id AND jobs.id = i.id AND {fence}
        RETURNING {columns + ", " if columns else ""}i.n, i.k,
                  jobs.cancel_requested_at IS NOT NULL AS cancel_requested,
                  CAST('{Transition.PROGRESS}' AS text) AS transition,
                  CAST('running' AS text) AS from_state
    """


def _hand_back(needs: set[str]) -> str:
    # A worker without the job's handler gives the job back without claiming
    # it, fenced on the message's dispatch: when a live worker handles the
    # job's type on its queue, a new dispatch is due after a jittered delay
    # that doubles with each hand-back (HAND_BACK, no event: hand-backs are
    # noise); otherwise the job is parked, with no dispatch at all (PARK, one
    # event saying why). Neither counts as an attempt, and either stops its
    # wait for a flow limit (flow_key: its place in line is given up; its
    # next claim decides afresh). Adds to j: handled.
    rule = RULES[Transition.HAND_BACK]
    assert rule.sources == RULES[Transition.PARK].sources
    return f"""
        WITH cur AS (
            SELECT id, type, queue, handbacks FROM jobs
            WHERE {rule.match} AND {where_sources(Transition.HAND_BACK)}
            FOR UPDATE
        ), live AS (
            SELECT cur.id,
                   EXISTS (
                       SELECT 1 FROM workers w
                       WHERE w.stop_time IS NULL AND w.expire_time > now()
                         AND cur.type = ANY (w.types) AND cur.queue = ANY (w.queues)
                   ) AS handled,
                   least(CAST(:max_delay AS float8),
                         CAST(:base_delay AS float8) * power(2, least(cur.handbacks, 30)))
                       * (0.5 + random()) AS delay
            FROM cur
        )
        UPDATE jobs SET
            dispatch_id = CASE WHEN live.handled THEN CAST(:new_dispatch_id AS uuid) END,
            next_attempt_time = CASE WHEN live.handled
                THEN now() + make_interval(secs => live.delay) END,
            handbacks = jobs.handbacks + 1,
            waiting_reason = CASE WHEN live.handled
                THEN format('waiting for a worker that handles %s (handed back %s times by '
                            'workers without its handler)', jobs.type, jobs.handbacks + 1)
                ELSE format('no live worker handles type %s on queue %s', jobs.type, jobs.queue)
                END,
            waiting_code = CASE WHEN live.handled THEN '{WaitingCode.HANDED_BACK}'
                ELSE '{WaitingCode.NO_LIVE_WORKER}' END,
            last_seq = jobs.last_seq + CASE WHEN live.handled THEN 0 ELSE 1 END,
            flow_key = NULL, update_time = now()
        FROM live
        WHERE jobs.id = live.id
        RETURNING {_returning(needs, "jobs") or "jobs.id"}, live.handled,
                  CAST(CASE WHEN live.handled THEN '{Transition.HAND_BACK}'
                       ELSE '{Transition.PARK}' END AS text) AS transition,
                  CAST('queued' AS text) AS from_state
    """


def _unpark(needs: set[str]) -> str:
    # Parked jobs of the given types and queues get a new dispatch (a worker
    # that runs them is live now), with one event each.
    rule = RULES[Transition.UNPARK]
    # p has no column but id: the job's columns need no table name.
    where = f"{where_sources(Transition.UNPARK)} AND {rule.guard}"
    return f"""
        WITH p AS (
            SELECT id FROM jobs
            WHERE {where}
              AND type = ANY (CAST(:types AS text[])) AND queue = ANY (CAST(:queues AS text[]))
            ORDER BY id
            LIMIT :limit
            FOR UPDATE SKIP LOCKED
        )
        UPDATE jobs SET {rule.sets}, last_seq = jobs.last_seq + 1, update_time = now()
        FROM p
        WHERE jobs.id = p.id AND {where}
        RETURNING {_returning(needs, "jobs") or "jobs.id"},
                  CAST('{Transition.UNPARK}' AS text) AS transition,
                  CAST('queued' AS text) AS from_state
    """
