"""gRPC errors as the client SDK receives them: a status code and message, and
the rich status details the server attaches (google.rpc ErrorInfo, RetryInfo, ...)."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from jobplane.errors import ERROR_DOMAIN


def _packed(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def rpc_error(
    code: grpc.StatusCode,
    message: str,
    *details: Any,
    wire_message: str | None = None,
) -> grpc.aio.AioRpcError:
    """An AioRpcError as grpc raises it for a status with ``details``."""
    trailing = grpc.aio.Metadata()
    if details:
        status = rpc_status.to_status(
            status_pb2.Status(
                code=code.value[0], message=message, details=[_packed(d) for d in details]
            )
        )
        trailing = grpc.aio.Metadata(*status.trailing_metadata)
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), trailing, details=wire_message or message
    )


def error_info(reason: str, domain: str = ERROR_DOMAIN, **metadata: str) -> Any:
    """The ErrorInfo detail naming ``reason`` (of jobplane's domain unless given)."""
    return error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=metadata)


def unavailable() -> grpc.aio.AioRpcError:
    """A stream or call cut off by a server going away."""
    return rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")


def tenant_limit(retry_delay: float) -> grpc.aio.AioRpcError:
    """A stream refused because the tenant holds its streams on that server; try
    again after ``retry_delay`` seconds."""
    delay = duration_pb2.Duration()
    delay.FromNanoseconds(round(retry_delay * 1e9))
    return rpc_error(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "this tenant already has 3 watch streams open on this server; close some first",
        error_info("TENANT_LIMIT_EXCEEDED", limit="watch_streams", max="3"),
        error_details_pb2.RetryInfo(retry_delay=delay),
    )
