"""gRPC failures → the typed exceptions of :mod:`jobplane.errors`."""

from __future__ import annotations

import re
from typing import cast

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from jobplane.errors import ERROR_DOMAIN, InternalError, JobplaneError, error_for_reason

_DETAILS_KEY = "grpc-status-details-bin"

# Transport failures that grpc reports as CANCELLED, INTERNAL or UNKNOWN rather
# than UNAVAILABLE, depending on where the connection broke.
_TRANSPORT_DETAILS = re.compile(
    r"connection|socket|stream removed|rst_stream|goaway|broken pipe|end of file|\beof\b",
    re.IGNORECASE,
)
_TRANSPORT_CODES = frozenset(
    {grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
)


class WatchSequenceError(InternalError):
    """The server skipped events of a watched job (a server bug)."""

    reason = "WATCH_SEQUENCE_GAP"


def error_from_rpc(error: grpc.aio.AioRpcError) -> JobplaneError:
    """The :class:`JobplaneError` for a failed call, with ``error`` as its cause.

    The class comes from the ``google.rpc.ErrorInfo`` reason when the server
    sent one in domain ``jobplane.dev``, else from the status code. ``field``
    comes from the ErrorInfo metadata or the first BadRequest field violation,
    ``retry_delay`` from ``google.rpc.RetryInfo``.
    A reason or code without a class of its own gives a plain
    :class:`JobplaneError` whose ``reason`` and ``code`` still say what happened.
    """
    code = error.code()
    message = error.details() or code.name
    reason: str | None = None
    field: str | None = None
    retry_delay: float | None = None
    metadata: dict[str, str] = {}
    status = rich_status(error)
    if status is not None:
        message = status.message or message
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                # Only our own domain's reasons name our exception classes.
                if info.domain == ERROR_DOMAIN and reason is None:
                    reason = info.reason
                    metadata = dict(info.metadata)
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR) and field is None:
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                if bad.field_violations:
                    field = bad.field_violations[0].field
            elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR) and retry_delay is None:
                retry = error_details_pb2.RetryInfo()
                detail.Unpack(retry)
                retry_delay = retry.retry_delay.ToNanoseconds() / 1e9
    # The server adds the field to the ErrorInfo metadata; hand back the
    # metadata the error was raised with.
    field = metadata.pop("field", None) or field
    cls = error_for_reason(reason, code)
    result = cls(message, field=field, metadata=metadata, retry_delay=retry_delay)
    if cls is JobplaneError:
        result.code = code
        result.reason = reason or code.name
    result.__cause__ = error
    return result


def rich_status(error: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` in the trailing metadata of ``error``, if any."""
    try:
        # AioRpcError has the synchronous code(), details() and
        # trailing_metadata() that from_call reads.
        status = rpc_status.from_call(cast(grpc.Call, error))
    except ValueError:
        # Code or message differ from the status proto (a proxy rewrote the
        # status); its details are still the server's.
        return _raw_status(error)
    except DecodeError:
        return None
    return cast(status_pb2.Status | None, status)


def _raw_status(error: grpc.aio.AioRpcError) -> status_pb2.Status | None:
    for key, value in error.trailing_metadata() or ():
        if key == _DETAILS_KEY and isinstance(value, bytes):
            try:
                return status_pb2.Status.FromString(value)
            except DecodeError:
                return None
    return None


def is_transient(error: grpc.aio.AioRpcError) -> bool:
    """True when ``error`` means the connection was lost, not that the call was refused."""
    code = error.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    if code not in _TRANSPORT_CODES or _has_error_info(error):
        return False
    return bool(_TRANSPORT_DETAILS.search(error.details() or ""))


def is_retryable(error: grpc.aio.AioRpcError) -> bool:
    """True when a call that is safe to repeat should be repeated after ``error``.

    That is a lost connection (:func:`is_transient`) or a CANCELLED the caller
    did not ask for: cancelling the caller's task raises
    :class:`asyncio.CancelledError`, so a CANCELLED *status* comes from the
    other side — gRPC servers shed calls with it when more arrive at once than
    the application has picked up.
    """
    return is_transient(error) or error.code() == grpc.StatusCode.CANCELLED


def _has_error_info(error: grpc.aio.AioRpcError) -> bool:
    status = rich_status(error)
    return status is not None and any(
        d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR) for d in status.details
    )
