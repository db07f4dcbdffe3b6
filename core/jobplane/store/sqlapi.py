"""Calls of jobplane's SQL API (schema ``jobplane``), for :mod:`jobplane.txn`.

The functions' current definitions are the files in ``store/sql/``
(``submit_job.sql``, ``publish_event.sql``, ...). Migrations create them,
each from a frozen copy of its own; a change to one is a new migration with a
new copy, so that a database says what it runs (ADR-0035).
"""

from __future__ import annotations

from importlib.resources import files

from sqlalchemy import text

# asyncpg's placeholders; the casts let a caller bind JSON text.
# The schedule_time is bound as text (as PUBLISH_EVENT's time), the delay as seconds.
SUBMIT_JOB_ASYNCPG = (
    "SELECT jobplane.submit_job($1, $2, CAST($3 AS jsonb), $4, $5, $6, CAST($7 AS jsonb), $8, "
    "CAST(CAST($9 AS text) AS timestamptz), CAST($10 AS float8) * interval '1 second', "
    "concurrency_key => $11, concurrency_limit => $12, concurrency_mode => $13, "
    "deadline => CAST(CAST($14 AS text) AS timestamptz), "
    "deadline_after => CAST($15 AS float8) * interval '1 second', "
    "after => CAST($16 AS uuid[]), after_failure => $17)"
)
SUBMIT_JOB = text(
    "SELECT jobplane.submit_job(:tenant, :type, CAST(:payload AS jsonb), :request_id, "
    ":correlation_id, :max_attempts, CAST(:labels AS jsonb), :timeout_seconds, "
    "CAST(CAST(:schedule_time AS text) AS timestamptz), "
    "CAST(:schedule_delay AS float8) * interval '1 second', "
    "concurrency_key => :concurrency_key, concurrency_limit => :concurrency_limit, "
    "concurrency_mode => :concurrency_mode, "
    "deadline => CAST(CAST(:deadline AS text) AS timestamptz), "
    "deadline_after => CAST(:deadline_after AS float8) * interval '1 second', "
    "after => CAST(:after AS uuid[]), after_failure => :after_failure)"
)
# The time is bound as text: asyncpg sends the last microsecond of year 9999
# (datetime.max) as 'infinity'.
PUBLISH_EVENT_ASYNCPG = (
    "SELECT jobplane.publish_event($1, $2, $3, CAST($4 AS jsonb), "
    "CAST(CAST($5 AS text) AS timestamptz), $6, $7, $8, $9, $10)"
)
PUBLISH_EVENT = text(
    "SELECT jobplane.publish_event(:tenant, :event_id, :event_type, CAST(:payload AS jsonb), "
    "CAST(CAST(:event_time AS text) AS timestamptz), :project_id, :correlation_id, "
    ":causation_id, :traceparent, :tracestate)"
)

# The SQLSTATEs the functions raise (class JP), by the reason of the RPC error.
SQLSTATE_REASONS = {
    "JP001": "INVALID_ARGUMENT",
    "JP002": "PAYLOAD_TOO_LARGE",
    "JP003": "JOB_TYPE_UNROUTABLE",
    "JP004": "REQUEST_ID_REUSED",
    "JP005": "TENANT_NOT_FOUND",
    "JP006": "EVENT_ID_REUSED",
    "JP007": "CONCURRENCY_LIMIT_REACHED",
}


def sql_files(schema: str) -> dict[str, str]:
    """The current definitions, ``store/sql/{name}.sql`` by name, for tables in ``schema``.

    ``schema`` replaces ``@SCHEMA@``: a migration fixes it in a function's
    ``search_path`` as the schema it runs in (its ``current_schema()``).
    """
    directory = files("jobplane.store") / "sql"
    return {
        entry.name.removesuffix(".sql"): entry.read_text(encoding="utf-8").replace(
            "@SCHEMA@", schema
        )
        for entry in sorted(directory.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".sql")
    }
