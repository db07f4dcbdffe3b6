"""Calls of jobplane's SQL API (schema ``jobplane``), for :mod:`jobplane.txn`.

The functions themselves are created by migrations (0007: ``submit_job``);
a change to one is a new migration, so that a database says what it runs.
"""

from __future__ import annotations

from sqlalchemy import text

# asyncpg's placeholders; the casts let a caller bind JSON text.
SUBMIT_JOB_ASYNCPG = (
    "SELECT jobplane.submit_job($1, $2, CAST($3 AS jsonb), $4, $5, $6, CAST($7 AS jsonb), $8)"
)
SUBMIT_JOB = text(
    "SELECT jobplane.submit_job(:tenant, :type, CAST(:payload AS jsonb), :request_id, "
    ":correlation_id, :max_attempts, CAST(:labels AS jsonb), :timeout_seconds)"
)

# The SQLSTATEs the functions raise (class JP), by the reason of the RPC error.
SQLSTATE_REASONS = {
    "JP001": "INVALID_ARGUMENT",
    "JP002": "PAYLOAD_TOO_LARGE",
    "JP003": "JOB_TYPE_UNROUTABLE",
    "JP004": "REQUEST_ID_REUSED",
    "JP005": "TENANT_NOT_FOUND",
}
