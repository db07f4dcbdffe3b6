"""Failures → what the caller is told.

:func:`error_for` classifies an exception raised while serving a call;
:func:`to_grpc_status` turns a :class:`JobplaneError` into the rich status:
code, message, ErrorInfo, BadRequest for a field and RetryInfo for a delay.
"""

from __future__ import annotations

import grpc
import structlog
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from jobplane.errors import ERROR_DOMAIN, Aborted, InternalError, JobplaneError
from jobplane.logs import describe_error
from jobplane.store.down import (
    DatabaseUnavailable,
    conflicted,
    database_down,
    pool_exhausted,
    sqlstate,
)

log = structlog.get_logger("jobplane.server")

# A lost database connection, or no pooled connection free in time, is
# UNAVAILABLE, not INTERNAL: the call may be repeated (submit is idempotent by
# request_id; watch resumes by seq).
DB_UNAVAILABLE = DatabaseUnavailable("the database is busy or unreachable right now; retry")
# Postgres refused the statement for want of room, not for what it is:
# disk_full (a data file could not grow) and out_of_memory. The transaction
# wrote nothing, and the same call passes once an operator has made room
# (docs/operations.md, "A full disk"): UNAVAILABLE, not INTERNAL.
_OUT_OF_ROOM = frozenset({"53100", "53200"})
# A deadlock or a serialization failure the store did not run again (or that
# came back each time): the call's transaction was rolled back whole, for
# another's sake, not for what it asked. ABORTED, not INTERNAL nor
# UNAVAILABLE: the database is up, and the caller repeats the call.
CONFLICT = Aborted(
    "the call met another change of the same jobs at the same moment and was rolled "
    "back; nothing was written: repeat it",
    retry_delay=0.1,
)


def error_for(exc: Exception, rpc: str) -> JobplaneError:
    """What to answer for ``exc``, raised while serving ``rpc``; logs the unexpected."""
    if isinstance(exc, JobplaneError):
        return exc
    if database_down(exc):
        log.warning("rpc.database_unavailable", rpc=rpc, error=describe_error(exc))
        return DB_UNAVAILABLE
    if sqlstate(exc) in _OUT_OF_ROOM:
        log.warning("rpc.database_full", rpc=rpc, error=describe_error(exc))
        return DB_UNAVAILABLE
    if conflicted(exc):
        log.warning("rpc.database_conflict", rpc=rpc, error=describe_error(exc))
        return CONFLICT
    if pool_exhausted(exc):  # the database answers: the pool is too small for the load
        log.warning("rpc.database_pool_exhausted", rpc=rpc, error=describe_error(exc))
        return DB_UNAVAILABLE
    log.error("rpc.failed", rpc=rpc, exc_info=exc)
    return InternalError()


def to_grpc_status(error: JobplaneError) -> grpc.Status:
    """The rich status for ``error``: code, message, ErrorInfo, field violation, retry delay."""
    info = any_pb2.Any()
    info.Pack(
        error_details_pb2.ErrorInfo(
            reason=error.reason,
            domain=ERROR_DOMAIN,
            metadata={**error.metadata, **({"field": error.field} if error.field else {})},
        )
    )
    details = [info]
    if error.field:
        bad = any_pb2.Any()
        bad.Pack(
            error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=error.field, description=error.message, reason=error.reason
                    )
                ]
            )
        )
        details.append(bad)
    if error.retry_delay is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(max(0, round(error.retry_delay * 1e9)))
        retry = any_pb2.Any()
        retry.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        details.append(retry)
    message = status_pb2.Status(code=error.code.value[0], message=error.message, details=details)
    return rpc_status.to_status(message)
