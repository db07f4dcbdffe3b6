"""What every refusal of the server must look like, checked from the client side."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

from jobplane.client._errors import rich_status
from jobplane.errors import ERROR_DOMAIN

# The client refuses trailing metadata over 8 KiB by default; a refusal must
# stay far below that whatever the request echoed.
MAX_ERROR_WIRE_BYTES = 4096

NEVER = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


@dataclass(frozen=True)
class Refusal:
    """A checked refusal: its code, ErrorInfo and the field at fault (if any)."""

    code: grpc.StatusCode
    reason: str
    field: str | None
    message: str
    wire_bytes: int


def _percent_encoded_length(message: str) -> int:
    # grpc-message travels percent-encoded: bytes outside 0x20..0x7e and '%'
    # take three characters each.
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in message.encode())


def wire_bytes(error: grpc.aio.AioRpcError) -> int:
    """What the status costs in trailing metadata: grpc-message plus the details."""
    size = _percent_encoded_length(error.details() or "")
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            size += len(base64.b64encode(value))
    return size


def check_refusal(
    error: grpc.aio.AioRpcError, *, core_codes: frozenset[grpc.StatusCode] = frozenset()
) -> Refusal:
    """Assert that ``error`` is a precise answer, and return what it says.

    Never INTERNAL or UNKNOWN; small; a ``google.rpc.ErrorInfo`` of our domain;
    a BadRequest naming the field for INVALID_ARGUMENT (except for a body that
    does not decode at all, MALFORMED_REQUEST). ``core_codes`` are codes
    gRPC itself may answer with before the application sees the call (e.g.
    RESOURCE_EXHAUSTED for a body over the receive limit): those carry no
    details.
    """
    code = error.code()
    assert code not in NEVER, f"{code.name}: {error.details()!r}"[:500]
    size = wire_bytes(error)
    assert size < MAX_ERROR_WIRE_BYTES, f"{code.name} error is {size} bytes on the wire"
    status = rich_status(error)
    if status is None and code in core_codes:
        return Refusal(code, code.name, None, error.details() or "", size)
    assert status is not None, f"{code.name} without a google.rpc.Status: {error.details()!r}"
    return _check_status(code, status, size)


def _check_status(code: grpc.StatusCode, status: status_pb2.Status, size: int) -> Refusal:
    infos: list[Any] = []
    fields: list[str] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            infos.append(info)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields.extend(v.field for v in bad.field_violations)
    assert len(infos) == 1, f"{code.name} has {len(infos)} ErrorInfo details"
    info = infos[0]
    assert info.domain == ERROR_DOMAIN
    assert info.reason and info.reason == info.reason.upper()
    # A body that does not decode has no field to name.
    if code == grpc.StatusCode.INVALID_ARGUMENT and info.reason != "MALFORMED_REQUEST":
        assert fields and all(fields), f"INVALID_ARGUMENT {info.reason} names no field"
        assert info.metadata.get("field") == fields[0]
    return Refusal(code, info.reason, fields[0] if fields else None, status.message, size)
