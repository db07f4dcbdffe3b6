"""Domain events of transitions: each one's lifecycle event, and a handler's emitted events.

Written by the :class:`DomainEvents` hook in the transition's own statement
(docs/events.md, "Lifecycle events"; ADR-0014).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from jobplane.store import observers
from jobplane.store.machine.hooks import Cause, Hook, Write
from jobplane.store.machine.table import RULES, Lifecycle, Transition
from jobplane.store.rows import DOMAIN_EVENTS_CHANNEL, dumps

#: Events a handler may emit in one attempt, and their encoded bytes in all.
MAX_EMITTED_EVENTS = 100
MAX_EMITTED_BYTES = 1024 * 1024
# Where each event of a transition sits among the job's events: emitted events
# first (1..MAX_EMITTED_EVENTS), its lifecycle event last. The events rows are
# inserted in this order, so their seq (the feed's order within a
# transaction) follows it.
_ORDER_SLOTS = 1024
_LIFECYCLE_ORD = _ORDER_SLOTS - 1


def lifecycle_event_id(job_id: uuid.UUID, seq: int) -> uuid.UUID:
    """The event_id of a job's lifecycle event that took the job's event seq ``seq``.

    A name-based UUID (version 3: MD5 of the job id's 16 bytes and the seq
    in decimal), so SQL computes it too (:func:`_event_id_sql`) and a
    transition names its cause without reading it back.
    """
    return uuid.uuid3(job_id, str(seq))


def _event_id_sql(job_id: str, seq: str) -> str:
    """SQL: :func:`lifecycle_event_id` of the uuid ``job_id`` and the integer ``seq``."""
    digest = f"decode(md5(uuid_send({job_id}) || convert_to(CAST({seq} AS text), 'UTF8')), 'hex')"
    return (
        f"CAST(encode(set_byte(set_byte({digest}, 6, (get_byte({digest}, 6) & 15) | 48), "
        f"8, (get_byte({digest}, 8) & 63) | 128), 'hex') AS uuid)"
    )


# RFC 3339 in UTC with microseconds, as jobplane.events.format_timestamp
# writes it ('#' for ':', which text() would take for a bind's start).
_TIME_TEXT = (
    "replace(to_char({t} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24#MI#SS.US\"Z\"'), '#', ':')"
)


# Delayed jobs: a job.queued of a job not started yet carries its
# schedule_time, when it has one (docs/events.md); other payloads are as before.
_SCHEDULE_TIME = (
    "CASE WHEN j.schedule_time IS NOT NULL AND j.attempt = 0 THEN jsonb_build_object("
    f"'schedule_time', {_TIME_TEXT.format(t='j.schedule_time')}) ELSE '{{}}'::jsonb END"
)


def _lifecycle_payload(lifecycle: Lifecycle) -> str:
    """SQL over j: a lifecycle event's payload, as jsonb."""
    pairs = [
        ("name", "'jobs/' || j.id"),
        ("job_id", "CAST(j.id AS text)"),
        ("type", "coalesce(j.pipeline, j.type)"),
        ("queue", "j.queue"),
        ("state", "CAST(j.state AS text)"),
        ("attempt", "j.attempt"),
        ("max_attempts", "j.max_attempts"),
        ("labels", "coalesce(j.labels, '{}')"),
    ]
    if lifecycle in (Lifecycle.FAILED, Lifecycle.CANCELLED, Lifecycle.RETRY_SCHEDULED):
        error = (
            "jsonb_build_object('code', j.error_code, 'message', j.error_message, "
            "'retryable', coalesce(j.error_retryable, false))"
        )
        pairs.append(("error", error))
    if lifecycle is Lifecycle.RETRY_SCHEDULED:
        pairs.append(("next_attempt_time", _TIME_TEXT.format(t="j.next_attempt_time")))
    if lifecycle is Lifecycle.CANCEL_REQUESTED:
        pairs.append(("reason", "coalesce(j.cancel_reason, '')"))
    payload = "jsonb_build_object(" + ", ".join(f"'{key}', {value}" for key, value in pairs) + ")"
    if lifecycle is Lifecycle.QUEUED:
        payload = f"({payload} || {_SCHEDULE_TIME})"
    # A pipeline job's events say where in the pipeline it is; a plain job's
    # payload is as it always was.
    stage = "j.stage_name"
    extra = ""
    if lifecycle is Lifecycle.STAGE_SUCCEEDED:
        stage = "(SELECT p.name FROM job_stages p WHERE p.job_id = j.id AND p.idx = j.stage - 1)"
        extra = ", 'next_stage', j.stage_name"
    return (
        f"({payload} || CASE WHEN j.pipeline IS NULL THEN '{{}}'::jsonb ELSE jsonb_build_object("
        f"'pipeline', j.pipeline, 'pipeline_version', coalesce(j.pipeline_version, ''), "
        f"'stage', {stage}, 'stage_type', j.type{extra}) END)"
    )


_LIFECYCLE_COLUMNS = frozenset(
    {"id", "tenant_id", "type", "queue", "state", "attempt", "max_attempts", "labels"}
    | {"correlation_id", "error_code", "error_message", "error_retryable", "last_seq"}
    | {"lifecycle_seq", "lifecycle_cause", "next_attempt_time", "cancel_reason"}
    | {"pipeline", "pipeline_version", "stage", "stage_name"}
    | {"schedule_time"}
)


# The trace context of the span the transition applied under: the events'
# traceparent, as PublishEvent stores the caller's (docs/tracing.md).
_TRACE_COLUMNS = (
    "CAST(:trace_parent AS text) AS traceparent, CAST(:trace_state AS text) AS tracestate"
)

# A handler's emitted events commit with its attempt's success: the job's, or its stage's.
_WITH_EMITTED = frozenset({Transition.SUCCEED, Transition.ADVANCE, Transition.FAN_OUT})


class DomainEvents(Hook):
    """Domain events of a transition: its lifecycle event, and the handler's emitted events.

    Both are rows of ``events`` written in the transition's own statement,
    as :func:`jobplane.store.events.append` writes them, so they commit only
    with the transition and add no round trip; the relays publish them from
    there in commit order (ADR-0016). A lifecycle event's id is
    :func:`lifecycle_event_id` of the job and the seq of its job event; its
    causation is the job's lifecycle event before it (``lifecycle_cause``),
    its correlation the job's correlation id (its id when it has none).
    Emitted events come with a succeeding attempt only (``Cause.emitted``),
    inserted before its ``job.succeeded``, so the feed's commit order puts
    them in front of it.

    An event_id stored already (a publisher took it first) is not written
    again: the stored event stands.
    """

    def __init__(self, *, lifecycle: bool = True) -> None:
        self.lifecycle = lifecycle

    def writes(self, transition: Transition) -> Sequence[Write]:
        return self._writes(transition, many=False)

    def writes_many(self, transition: Transition) -> Sequence[Write]:
        return self._writes(transition, many=True)

    def _writes(self, transition: Transition, *, many: bool) -> Sequence[Write]:
        rule = RULES[transition]
        selects = []
        if self.lifecycle and rule.lifecycle is not None:
            selects.append(_lifecycle_select(rule.lifecycle))
        if transition in _WITH_EMITTED:
            selects.append(_emitted_select(many=many))
        if not selects:
            return ()
        return _inserts("\n            UNION ALL".join(selects))

    def binds(self, transition: Transition, cause: Cause) -> Mapping[str, Any]:
        if transition not in _WITH_EMITTED:
            return observers.trace_binds()
        emitted = cause.emitted
        return {
            **observers.trace_binds(),
            "emitted_ids": [e.event.event_id for e in emitted],
            "emitted_types": [e.event.event_type for e in emitted],
            "emitted_times": [e.event.timestamp for e in emitted],
            "emitted_correlations": [e.event.correlation_id for e in emitted],
            "emitted_projects": [e.event.project_id for e in emitted],
            "emitted_causations": [e.event.causation_id for e in emitted],
            "emitted_payloads": [dumps(e.event.payload) for e in emitted],
            "emitted_hashes": [e.request_hash for e in emitted],
        }


def _lifecycle_select(lifecycle: Lifecycle) -> str:
    """The SELECT of a transition's lifecycle event, one row per job row ``{j}``."""
    # The job's correlation id, or its id when it has none (or one
    # no envelope can carry: only a row written around the checks).
    correlation = (
        "CASE WHEN octet_length(j.correlation_id) BETWEEN 1 AND 255 AND j.correlation_id "
        "!~ ('[' || chr(1) || '-' || chr(31) || chr(127) || ']') "
        "THEN j.correlation_id ELSE CAST(j.id AS text) END"
    )
    cause = _event_id_sql("j.id", "j.lifecycle_cause")
    return f"""
            SELECT {_event_id_sql("j.id", "j.lifecycle_seq")} AS event_id,
                   CAST('{lifecycle.value}' AS text) AS event_type,
                   clock_timestamp() AS event_time, j.tenant_id, {correlation} AS correlation_id,
                   CAST(NULL AS text) AS project_id,
                   CASE WHEN j.lifecycle_cause IS NOT NULL THEN CAST({cause} AS text) END
                       AS causation_id,
                   {_lifecycle_payload(lifecycle)} AS payload,
                   CAST('' AS bytea) AS request_hash,
                   j.id AS job_id, CAST(j.last_seq AS bigint) * {_ORDER_SLOTS} + {_LIFECYCLE_ORD}
                       AS order_seq, true AS lifecycle, {_TRACE_COLUMNS}
            FROM {{j}} AS j"""


def _emitted_select(*, many: bool) -> str:
    """The SELECT of a handler's emitted events, unnested from the bound lists."""
    # Many rows: each row's events are its slice of the lists (their
    # row in :emitted_ids_k, their place in it in :emitted_ids_ord).
    arrays = (
        "CAST(:emitted_ids AS uuid[]), CAST(:emitted_types AS text[]),\n"
        "                        CAST(:emitted_times AS timestamptz[]),\n"
        "                        CAST(:emitted_correlations AS text[]),\n"
        "                        CAST(:emitted_projects AS text[]),\n"
        "                        CAST(:emitted_causations AS text[]), "
        "CAST(:emitted_payloads AS text[]),\n"
        "                        CAST(:emitted_hashes AS bytea[])"
    )
    columns = (
        "event_id, event_type, event_time, correlation_id, project_id, causation_id, payload, "
    )
    if many:
        events = (
            f"unnest({arrays}, CAST(:emitted_ids_k AS bigint[]), "
            f"CAST(:emitted_ids_ord AS bigint[]))\n"
            f"                     AS m({columns}request_hash, k, ord)"
        )
        match = "\n            WHERE m.k = j.k"
    else:
        events = (
            f"unnest({arrays})\n"
            f"                     WITH ORDINALITY AS m({columns}request_hash, ord)"
        )
        match = ""
    return f"""
            SELECT m.event_id, m.event_type, m.event_time, j.tenant_id, m.correlation_id,
                   m.project_id, m.causation_id, CAST(m.payload AS jsonb) AS payload,
                   m.request_hash,
                   j.id AS job_id, CAST(j.last_seq AS bigint) * {_ORDER_SLOTS} + m.ord AS order_seq,
                   false AS lifecycle, {_TRACE_COLUMNS}
            FROM {{j}} AS j,
                 {events}{match}"""


def _inserts(union: str) -> list[Write]:
    """The writes storing the selected events, and waking the relays that publish them."""
    # Inserted in order_seq order: a transition's events take their seq
    # (the feed's order within its transaction) in the order they happened.
    # A lifecycle event has no fingerprint (an empty one): nothing
    # publishes it again but a PublishEvent taking its id, which is then
    # compared by value. Its row is marked ``lifecycle``: the relays publish
    # it only when the topology's publish_lifecycle takes its type (ADR-0052).
    return [
        Write(
            f"""
        INSERT INTO events (tenant_id, event_id, event_type, event_time, correlation_id,
                            project_id, causation_id, payload, request_hash, job_id,
                            traceparent, tracestate, lifecycle)
        SELECT tenant_id, event_id, event_type, event_time, correlation_id, project_id,
               causation_id, payload, request_hash, job_id, traceparent, tracestate, lifecycle
        FROM ({union}
        ) AS x
        ORDER BY order_seq
        ON CONFLICT (tenant_id, event_id) DO NOTHING""",
            columns=_LIFECYCLE_COLUMNS,
        ),
        Write(
            notify=f"pg_notify('{DOMAIN_EVENTS_CHANNEL}', CAST(j.tenant_id AS text))",
            columns=frozenset({"tenant_id"}),
        ),
    ]
