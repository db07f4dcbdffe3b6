"""JobplaneError → gRPC status with ErrorInfo (and BadRequest for a field)."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from jobplane.errors import ERROR_DOMAIN, JobplaneError


def to_grpc_status(error: JobplaneError) -> grpc.Status:
    """The rich status for ``error``: code, message, ErrorInfo, field violation."""
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
    message = status_pb2.Status(code=error.code.value[0], message=error.message, details=details)
    return rpc_status.to_status(message)
